"""EngineOutput (token ids per child request) -> RequestOutput (detokenized choices per client request).

A client request with `n` choices is `n` child requests in the scheduler (ids `<parent>-<i>`). The processor
keeps one IncrementalDetokenizer per choice, enforces stop strings (reporting hits so the engine can finish
the child at the step boundary) and groups children back into one RequestOutput per parent: every step's changes
(streaming, the servers) or, with `final_only` (the offline LLM, which keeps only each request's last output), one
RequestOutput per parent when it finishes, holding every choice's finishing CompletionOutput. Both modes update
every choice's state (token ids, logprobs, detokenized text, stop strings) every step; final_only only skips
building the per-step output objects.
Runs on the engine thread (or the LLM caller's thread); not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ladle.core.outputs import FINISH_ERROR, FINISH_STOP, EngineOutput, TokenLogprobs
from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import CompletionOutput, RequestOutput
from ladle.engine.detokenizer import IncrementalDetokenizer


@dataclass
class _Choice:
    index: int
    detokenizer: Optional[IncrementalDetokenizer]
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprobs]] = None
    text_parts: list[str] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    error: Optional[str] = None
    final_output: Optional[CompletionOutput] = None  # the CompletionOutput that finished it (final_only mode)

    def __post_init__(self) -> None:
        if self.want_logprobs:
            self.logprobs = []

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class _Parent:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[_Choice]
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None
    queue_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        if len(self.choices) == 1:  # n == 1, the usual case: no generator per output
            return self.choices[0].finish_reason is not None
        return all(c.finish_reason is not None for c in self.choices)


@dataclass
class ProcessedOutputs:
    """request_outputs: one per parent that changed (final_only: one per parent that finished); stop_hits: (child
    id, stop string) the engine must finish with reason "stop"; failed_ids: children whose output could not be
    processed (the engine finishes them with reason "error")."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    stop_hits: list[tuple[str, str]] = field(default_factory=list)
    failed_ids: list[str] = field(default_factory=list)


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The scheduler id of choice `index`: the parent id itself when n == 1."""
    return parent_id if n == 1 else f"{parent_id}-{index}"


class OutputProcessor:
    """Args: tokenizer (None = token ids only, no text); final_only (report a parent only once it has finished,
    with one CompletionOutput per choice: the one that finished the choice, as the streaming mode reports it).

    `num_generation_tokens`: tokens appended to choices since start, i.e. the sum of every choice's token_ids (the
    completion_tokens clients are told), for `vllm:generation_tokens_total`. vLLM counts there too (its frontend's
    output processor, vllm/v1/engine/output_processor.py): a token the engine sampled for a choice already finished
    here (stop string found, aborted) is ignored, not counted."""

    def __init__(self, tokenizer: Any, final_only: bool = False) -> None:
        self.tokenizer = tokenizer
        self.final_only = final_only
        self.num_generation_tokens = 0
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}
        self._single_token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}  # by skip_special_tokens

    def add_request(self, parent_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[str]:
        """Register a client request; returns its child ids (one per choice)."""
        choices, child_ids = [], []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                               params.include_stop_str_in_output, params.skip_special_tokens,
                                               params.min_tokens,
                                               self._single_token_texts[bool(params.skip_special_tokens)])
            choices.append(_Choice(i, detok, params.logprobs is not None))
            child = child_request_id(parent_id, i, params.n)
            child_ids.append(child)
            self._child_to_parent[child] = (parent_id, i)
        self._parents[parent_id] = _Parent(parent_id, list(prompt_token_ids), choices)
        return child_ids

    def remove_request(self, parent_id: str) -> None:
        parent = self._parents.pop(parent_id, None)
        if parent is not None:
            for i in range(len(parent.choices)):
                self._child_to_parent.pop(child_request_id(parent_id, i, len(parent.choices)), None)

    @property
    def parent_ids(self) -> list[str]:
        return list(self._parents)

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self._parents.get(parent_id)
        if parent is None:
            return []
        return [child_request_id(parent_id, i, len(parent.choices)) for i in range(len(parent.choices))]

    def process(self, outputs: list[EngineOutput]) -> ProcessedOutputs:
        """Apply one step's EngineOutputs. Outputs for unknown children or already finished choices (e.g.
        the scheduler's echo of a stop-string finish) are ignored. Finished parents are removed."""
        result = ProcessedOutputs()
        changed: dict[str, list[CompletionOutput]] = {}
        for out in outputs:
            where = self._child_to_parent.get(out.request_id)
            if where is None:
                continue
            parent = self._parents[where[0]]
            choice = parent.choices[where[1]]
            if choice.finish_reason is not None:
                continue
            try:
                delta = self._apply(parent, choice, out, result)
            except Exception as exc:  # noqa: BLE001 — one bad output fails its request, not the engine
                choice.finish_reason, choice.error = FINISH_ERROR, f"output processing failed: {exc!r}"
                result.failed_ids.append(out.request_id)
                delta = CompletionOutput(index=choice.index, text=choice.text, token_ids=list(choice.token_ids),
                                         finish_reason=FINISH_ERROR, error=choice.error)
            if delta is None:  # final_only, still running
                continue
            if self.final_only:
                choice.final_output = delta
            changed.setdefault(parent.request_id, []).append(delta)
        for parent_id, deltas in changed.items():
            parent = self._parents[parent_id]
            finished = parent.finished
            if self.final_only:
                if not finished:
                    continue
                deltas = [c.final_output for c in parent.choices]  # type: ignore[misc]
            result.request_outputs.append(RequestOutput(
                request_id=parent_id, prompt_token_ids=parent.prompt_token_ids, outputs=deltas,
                finished=finished, num_cached_tokens=parent.num_cached_tokens,
                prompt_logprobs=parent.prompt_logprobs, queue_time=parent.queue_time))
            if finished:
                self.remove_request(parent_id)
        return result

    def _apply(self, parent: _Parent, choice: _Choice, out: EngineOutput,
               result: ProcessedOutputs) -> Optional[CompletionOutput]:
        """Update the choice's state with one output; its CompletionOutput (None in final_only mode while the choice
        runs on)."""
        if choice.index == 0:
            parent.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                parent.prompt_logprobs = out.prompt_logprobs
            if parent.queue_time is None:
                parent.queue_time = out.queue_time
        choice.token_ids.extend(out.new_token_ids)
        self.num_generation_tokens += len(out.new_token_ids)
        if choice.logprobs is not None:
            choice.logprobs.extend(out.new_logprobs or ())
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        text_delta = ""
        if choice.detokenizer is not None:
            text_ids = out.new_token_ids
            if finish_reason == FINISH_STOP and text_ids and not choice.detokenizer.include_stop:
                text_ids = text_ids[:-1]  # the EOS / stop token id that ended the output is not text (as vLLM)
            text_delta = choice.detokenizer.update(text_ids, finished=finish_reason is not None)
            if choice.detokenizer.stop_reason is not None and finish_reason is None:
                finish_reason, stop_reason = FINISH_STOP, choice.detokenizer.stop_reason
                child = child_request_id(parent.request_id, choice.index, len(parent.choices))
                result.stop_hits.append((child, stop_reason))
        if text_delta:
            choice.text_parts.append(text_delta)
        choice.finish_reason, choice.stop_reason, choice.error = finish_reason, stop_reason, out.error
        if finish_reason is None and self.final_only:
            return None
        new_logprobs = None if choice.logprobs is None else list(out.new_logprobs or [])
        delta = CompletionOutput(index=choice.index, text_delta=text_delta, token_ids_delta=list(out.new_token_ids),
                                 logprobs_delta=new_logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
                                 error=out.error)
        if finish_reason is not None:  # cumulative fields once, at the end: O(n) per choice, not O(n) per step
            delta.text, delta.token_ids = choice.text, choice.token_ids
            delta.logprobs = choice.logprobs
        return delta

    def fail_all(self, error: str, reason: str = "error") -> ProcessedOutputs:
        """Finish every open choice (engine death / shutdown): outputs carrying `reason` and `error`."""
        outs = [EngineOutput(request_id=child, finish_reason=reason, error=error)
                for pid in list(self._parents) for child in self.child_ids(pid)]
        return self.process(outs)
