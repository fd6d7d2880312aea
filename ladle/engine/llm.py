"""The offline API: `LLM(model=None, **engine_kwargs).generate(prompts, sampling_params)`.

Runs the EngineCore synchronously on the caller's thread (no engine thread). Stop strings found by the
detokenizer finish their request right after the step that produced them. Output processing is final-only
(OutputProcessor(final_only=True)): every step still detokenizes and checks stop strings, but RequestOutputs are
built only for requests that finish.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional, Sequence, Union

from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import RequestOutput
from ladle.engine.engine_factory import EngineBundle, build_engine, engine_config_from_kwargs
from ladle.engine.logprobs import TokenTexts, offline_request_output
from ladle.engine.output_processor import OutputProcessor

Prompt = Union[str, list[int]]


class LLM:
    """Args: model (HF dir, .gguf, or None for the embedded SmolLM2), any EngineConfig field by name
    (dtype, max_model_len, block_size, kv_cache_memory_bytes, enable_prefix_caching, max_num_seqs,
    max_num_batched_tokens, seed, device, load_format, ...). `bundle` injects a prebuilt engine (tests).
    Raises ValueError for a CUDA-only field (gpu_memory_utilization, cuda_graph_sizes) on a CPU run, as `ladle serve`
    refuses its flag (engine_factory.engine_config_from_kwargs)."""

    def __init__(self, model: Optional[str] = None, *, bundle: Optional[EngineBundle] = None, **kwargs: Any) -> None:
        self.bundle = bundle if bundle is not None else build_engine(engine_config_from_kwargs(model, **kwargs))
        self.core = self.bundle.core
        self.tokenizer = self.bundle.tokenizer
        self.engine_config = self.bundle.engine_config
        self.processor = OutputProcessor(self.tokenizer, final_only=True)
        self._token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (if any; they also stop when this process exits)."""
        self.core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[RequestOutput]:
        """Generate for every prompt (strings are tokenized; token-id lists used as is) and return one final
        RequestOutput per prompt, in order, each with all `n` choices (cumulative text, token ids, logprobs).
        Logprobs come in vLLM's form (engine/logprobs.py): `outputs[c].logprobs[i]` and `prompt_logprobs[i]` (None
        for i = 0) are dicts token id -> Logprob(logprob, rank, decoded_token) holding the sampled (prompt) token
        once and the top `logprobs` (`prompt_logprobs`) alternatives.

        Raises RequestRejected (nothing of this call stays queued) when a request can never fit, ValueError when
        logprobs / prompt_logprobs exceed the vocabulary size.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        assert len(params_list) == len(prompts), "one SamplingParams per prompt, or a single one"
        if self.tokenizer is not None:  # the runner's top-k cannot give more alternatives than the vocabulary has
            for params in params_list:
                params.check_logprobs_limit(len(self.tokenizer), "the vocabulary size")
        order: list[str] = []
        try:
            requests = []
            for prompt, params in zip(prompts, params_list):
                ids = self._encode(prompt)
                parent_id = f"cmpl-{uuid.uuid4().hex}"
                order.append(parent_id)
                requests += self.core.make_child_requests(self.processor.add_request(parent_id, ids, params), ids,
                                                          params)
            self.core.add_requests(requests)
        except BaseException:
            for pid in order:
                self.processor.remove_request(pid)
            raise
        return self._run(order)

    def _run(self, order: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while self.core.has_unfinished_requests():
            outputs = self.core.step()
            processed = self.processor.process(outputs)
            self.core.finish_processed(processed.stop_hits, processed.failed_ids)
            for ro in processed.request_outputs:  # final_only: one per request, when it finished
                final[ro.request_id] = ro
        return [offline_request_output(final[pid], self._token_texts) for pid in order]
