"""The offline API: `LLM(model=None, **engine_kwargs).generate(prompts, sampling_params)`, and `.chat(messages,
sampling_params)` (vLLM's: conversations through the chat template, then generate).

Where the engine core runs (`engine_core_process`, an EngineConfig field like any other kwarg):
  * its own process (True; the default on CUDA, as vLLM's LLM): ladle/engine/offline_core.py drives the same
    engine-core process as `ladle serve`; this process tokenizes, detokenizes and checks stop strings while the core
    steps, so output processing is off the step's critical path. A stop string finishes its request when the core
    hears of it, one or two steps after it was sampled (the extra tokens are dropped, as in the server).
  * the caller's thread (False; the default on CPU, where the model's intra-op threads need every core): EngineCore
    runs synchronously, and a stop string finishes its request right after the step that produced it.
Output processing is final-only either way (OutputProcessor(final_only=True)): every step still detokenizes and
checks stop strings, but RequestOutputs are built only for requests that finish.
"""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from typing import Any, Mapping, Optional, Sequence, Union

from ladle.config import EngineConfig
from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import EngineError, RequestOutput
from ladle.engine.config_resolve import ConfigError, resolve_device
from ladle.engine.engine_factory import EngineBundle, build_engine, engine_config_from_kwargs, preflight_refusals
from ladle.engine.logprobs import TokenTexts, offline_request_output
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.tokenizer import ChatInputError, chat_prompt_ids

Prompt = Union[str, list[int]]


def default_engine_core_process(device: str) -> bool:
    """The offline default of `engine_core_process` (LLM and `ladle generate`): its own process on CUDA (vLLM's
    default, multiprocessing), the caller's thread on CPU."""
    return resolve_device(device).startswith("cuda")


def _start(config: EngineConfig) -> tuple[Optional[EngineBundle], Optional[Any]]:
    """(bundle, None) with the core on this thread, (None, CoreProcessDriver) with it in its own process. Every
    refusal found without loading weights (engine_factory.preflight_refusals: the model path, the values, the
    checks against the model's config) is one ConfigError raised here, before a process starts, in both modes."""
    if refusals := preflight_refusals(config):
        raise ConfigError(*refusals, source="LLM(...) call")
    if config.parallel.engine_core_process:
        from ladle.engine.offline_core import CoreProcessDriver

        return None, CoreProcessDriver.start(config)
    return build_engine(config), None


def _offline_refusals(use_tqdm: bool, lora_request: Any) -> list[str]:
    """What `generate` and `chat` refuse of vLLM's common arguments (their defaults there are honoured here)."""
    refused = []
    if lora_request is not None:
        refused.append("lora_request (ladle has no LoRA: merge the adapter into the model's weights)")
    if use_tqdm:
        refused.append("use_tqdm=True (ladle shows no progress bar; leave it out or pass False)")
    return refused


class LLM:
    """Args: model (HF dir, .gguf, or None for the embedded SmolLM2), any EngineConfig field by name
    (dtype, max_model_len, block_size, kv_cache_memory_bytes, enable_prefix_caching, max_num_seqs,
    max_num_batched_tokens, seed, device, load_format, ...). `bundle` injects a prebuilt engine (tests).
    Raises ValueError for a CUDA-only field (gpu_memory_utilization, cuda_graph_sizes) on a CPU run, as `ladle serve`
    refuses its flag (engine_factory.engine_config_from_kwargs), and one ConfigError (a ValueError) naming every
    setting the model's config refuses, before anything loads or a process starts. A dropped LLM stops its engine."""

    def __init__(self, model: Optional[str] = None, *, bundle: Optional[EngineBundle] = None, **kwargs: Any) -> None:
        if "served_model_name" in kwargs:  # a serving field: the offline LLM reports no model name anywhere
            raise ConfigError("served_model_name: the offline LLM serves no API and reports no model name; it is the "
                              "name `ladle serve MODEL --served-model-name NAME` answers to", source="LLM(...) call")
        if bundle is None:
            if "engine_core_process" not in kwargs:  # vLLM's offline default (multiprocessing) where it pays
                kwargs["engine_core_process"] = default_engine_core_process(str(kwargs.get("device", "auto")))
            bundle, remote = _start(engine_config_from_kwargs(model, **kwargs))
            self._attach(bundle, remote, owned=True)
        else:
            self._attach(bundle, None, owned=False)

    @classmethod
    def from_engine_config(cls, engine_config: EngineConfig) -> "LLM":
        """An LLM on a complete EngineConfig (`ladle generate` builds one from its flags); its
        `parallel.engine_core_process` is taken as is."""
        llm = cls.__new__(cls)
        llm._attach(*_start(engine_config), owned=True)
        return llm

    def _attach(self, bundle: Optional[EngineBundle], remote: Optional[Any], owned: bool) -> None:
        self.remote = remote  # CoreProcessDriver when the core runs in its own process
        self.bundle = bundle
        self.core = bundle.core if bundle is not None else None  # None: the core is in its own process
        front = bundle if bundle is not None else remote
        self.tokenizer = front.tokenizer
        self.engine_config = front.engine_config
        self.processor = OutputProcessor(self.tokenizer, final_only=True)
        self._token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None
        self._closed = False
        # an engine this LLM started stops once: on shutdown(), or when the LLM is garbage-collected (a dropped LLM
        # must not keep its core process, KV cache and workers until the interpreter exits), or at exit. An
        # injected bundle belongs to the caller: only shutdown() stops it.
        stop = (remote or self.core).shutdown
        self._stop = weakref.finalize(self, stop) if owned else stop

    def core_stats(self) -> dict:
        """The engine core's stats snapshot (ladle/engine/core_process.core_stats: SchedulerStats fields,
        `step_host_seconds` per phase, `num_steps`); with the core in its own process, as of its last message."""
        if self.remote is not None:
            return dict(self.remote.stats)
        from ladle.engine.core_process import core_stats

        return core_stats(self.core)

    def shutdown(self) -> None:
        """Stop the engine-core process or the tensor-parallel worker processes (if any; they also stop when this
        process exits). Idempotent; a later generate() raises EngineError."""
        self._closed = True
        self._stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        """Token ids of prompt `index`; ValueError naming the first id outside the vocabulary (the model would index
        past its embedding rows, failing the whole step of every request batched with it)."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        ids = [int(t) for t in prompt]
        vocab_size = len(self.tokenizer) if self.tokenizer is not None else None
        if vocab_size is not None and ids and not (0 <= min(ids) and max(ids) < vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"token id {bad} in prompt {index} is out of range [0, {vocab_size}) (the vocabulary)")
        return ids

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False, lora_request: Any = None) -> list[RequestOutput]:
        """Generate for every prompt (strings are tokenized; token-id lists used as is) and return one final
        RequestOutput per prompt, in order, each with all `n` choices (cumulative text, token ids, logprobs) and
        `prompt` (the prompt text; None for token ids), as vLLM. Logprobs come in vLLM's form (engine/logprobs.py): `outputs[c].logprobs[i]` and `prompt_logprobs[i]` (None
        for i = 0) are dicts token id -> Logprob(logprob, rank, decoded_token) holding the sampled (prompt) token
        once and the top `logprobs` (`prompt_logprobs`) alternatives.

        Raises RequestRejected (nothing of this call stays queued) when a request can never fit, ValueError
        (before anything is queued) when logprobs / prompt_logprobs exceed the vocabulary size or a token-id prompt
        holds an id outside the vocabulary, EngineError after shutdown(). vLLM's `use_tqdm` and `lora_request` are
        taken so ported calls run: use_tqdm=False and lora_request=None; anything else is refused (ValueError).
        """
        refused = _offline_refusals(use_tqdm, lora_request)
        if refused:
            raise ValueError("LLM.generate does not support: " + "; ".join(refused))
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if self._closed:
            raise EngineError("this LLM was shut down (llm.shutdown() or the end of its `with` block); "
                              "create a new LLM to generate again")
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts: "
                             f"pass one per prompt, or a single one for all")
        if self.tokenizer is not None:  # the runner's top-k cannot give more alternatives than the vocabulary has
            for params in params_list:
                params.check_logprobs_limit(len(self.tokenizer), "the vocabulary size")
        encoded = [self._encode(prompt, i) for i, prompt in enumerate(prompts)]
        prompts_in: list[tuple[str, list[str], list[int], SamplingParams]] = []
        try:
            for ids, params in zip(encoded, params_list):
                parent_id = f"cmpl-{uuid.uuid4().hex}"
                prompts_in.append((parent_id, self.processor.add_request(parent_id, ids, params), ids, params))
            if self.remote is not None:
                final = self.remote.run(self.processor, prompts_in)
            else:
                self.core.add_requests([r for parent_id, child_ids, ids, params in prompts_in
                                        for r in self.core.make_child_requests(child_ids, ids, params)])
                final = self._run()
        except BaseException:
            if self.core is not None:  # an interrupt mid-run: free the call's blocks (the driver does this itself)
                self.core.abort_requests([c for p in prompts_in for c in p[1]])
            for parent_id, *_ in prompts_in:
                self.processor.remove_request(parent_id)
            raise
        return [dataclasses.replace(offline_request_output(final[p[0]], self._token_texts),
                                    prompt=prompt if isinstance(prompt, str) else None)
                for p, prompt in zip(prompts_in, prompts)]

    def chat(self, messages: Union[Sequence[Mapping[str, Any]], Sequence[Sequence[Mapping[str, Any]]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, use_tqdm: bool = False,
             lora_request: Any = None, chat_template: Optional[str] = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list[dict[str, Any]]] = None,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the chat template, then generate() on its token ids; one final
        RequestOutput per conversation, in order (`prompt` None, as vLLM's chat).

        messages: one conversation (a list of {"role", "content"} dicts, OpenAI's shape; content a string or a list
        of {"type": "text"} parts) or a list of them. sampling_params: one for all, or one per conversation.
        The prompt is engine/tokenizer.chat_prompt_ids, the server's own: the tokenizer's chat template (or
        `chat_template`, a Jinja string), `add_generation_prompt` / `continue_final_message` (not both), `tools`
        and `chat_template_kwargs` as transformers' apply_chat_template takes them; the template writes the special
        tokens, the tokenizer adds none.

        Raises ValueError for what ladle does not honour: lora_request (no LoRA), mm_processor_kwargs and
        non-text content parts (text only), chat_template_content_format "openai" (content reaches the template as
        a string: "auto" / "string"), use_tqdm=True (no progress bar); ChatInputError (a ValueError) naming the
        conversation and field of a refused message or template argument; ValueError when the tokenizer has no
        chat template and none is given; then whatever generate() raises.
        """
        refused = _offline_refusals(use_tqdm, lora_request)
        if mm_processor_kwargs is not None:
            refused.append("mm_processor_kwargs (ladle takes text only)")
        if chat_template_content_format not in ("auto", "string"):
            refused.append(f"chat_template_content_format={chat_template_content_format!r} (ladle passes content to "
                           f"the template as a string: 'auto' or 'string')")
        if refused:
            raise ValueError("LLM.chat does not support: " + "; ".join(refused))
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer (chat template); this LLM has none: use generate() with "
                             "token ids")
        if isinstance(messages, (str, bytes)) or (messages and isinstance(messages[0], (str, bytes))):
            raise ValueError("LLM.chat takes messages, not text: one conversation is a list of {'role', 'content'} "
                             "dicts, e.g. [{'role': 'user', 'content': 'hello'}], or pass a list of conversations; "
                             "for raw text use generate()")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompt_ids = []
        for k, conversation in enumerate(conversations):
            try:
                prompt_ids.append(chat_prompt_ids(
                    self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
                    chat_template_kwargs=chat_template_kwargs))
            except ChatInputError as e:
                raise ChatInputError(f"conversation {k}: {e}", e.param) from None
        return self.generate(prompt_ids, sampling_params)

    def _run(self) -> dict[str, RequestOutput]:
        """The in-process loop: step the core until it has nothing left; parent id -> final RequestOutput."""
        final: dict[str, RequestOutput] = {}
        while self.core.has_unfinished_requests():
            outputs = self.core.step()
            processed = self.processor.process(outputs)
            self.core.finish_processed(processed.stop_hits, processed.failed_ids)
            for ro in processed.request_outputs:  # final_only: one per request, when it finished
                final[ro.request_id] = ro
        return final
