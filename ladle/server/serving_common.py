"""What both endpoints share: model check, length check, SamplingParams, running requests against the engine
with disconnect handling, usage, and the SSE body around a stream's chunks (the chunks' bytes: stream_chunks.py).

Request lifetime (one `PromptRun` per prompt; the engine handles `n` inside one request):
    runs = [PromptRun(...)]             internal ids `cmpl-<uuid>`, never the client's X-Request-Id
    await start_runs(ctx, raw, runs)     first output of every run, raced against client disconnect, so a
                                         RequestRejected becomes a 400 before any SSE byte is written
    merge_runs(ctx, runs)                the rest, as (run, RequestOutput) pairs, in arrival order
    close_runs(ctx, runs)                always (finally): close the engine iterators, abort what is unfinished
Before that, `prepare(ctx, build, req)` validates, templates, tokenizes and makes SamplingParams off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import anyio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ladle.config import ServerConfig
from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import CompletionOutput, EngineClient, RequestOutput
from ladle.engine.logprobs import TokenTexts
from ladle.server.errors import OpenAIError, error_body, to_openai_error
from ladle.server.metrics import RequestTimer, ServerMetrics
from ladle.server.protocol import PromptTokensDetails, UsageInfo, random_id
from ladle.server.stream_chunks import SSE_DONE, sse, stream_interval_refusals
from ladle.server.validation import check_token_ids

T = TypeVar("T")
logger = logging.getLogger("ladle.server")
PREPARE_THREADS = 4  # concurrent tokenizations / chat templates; more requests queue for a thread

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class ClientDisconnected(Exception):
    """The HTTP client went away while we waited for the engine."""


class ServingContext:
    """What the handlers need: the engine, names, metrics, the request limits (`limits`, a ServerConfig), the
    thread pool that tokenizes off the event loop, and a token-string cache for logprobs."""

    def __init__(self, engine: EngineClient, metrics: Optional[ServerMetrics] = None,
                 extra_model_names: tuple[str, ...] = (), limits: Optional[ServerConfig] = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = len(engine.tokenizer)
        self.metrics = metrics
        self.limits = limits or ServerConfig()
        if refusals := stream_interval_refusals(self.limits.stream_interval):
            raise ValueError(refusals[0])
        self.accepted_names = {self.model_name, *[n for n in extra_model_names if n]}
        self._token_texts = TokenTexts(engine.tokenizer)
        self.executor = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="ladle-prepare")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the preparation thread pool (tokenizing, templating, decoding: never on the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def check_model(self, requested: Optional[str]) -> None:
        if requested is not None and requested not in self.accepted_names:
            raise OpenAIError(f"The model `{requested}` does not exist.", 404, "model", "NotFoundError")

    def token_str(self, token_id: int) -> str:
        """The text of one token as logprobs report it (decoded alone; a partial UTF-8 byte shows as U+FFFD)."""
        return self._token_texts[token_id]

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 naming the first id outside [0, vocabulary size)."""
        check_token_ids(ids, self.vocab_size, param)


async def prepare(ctx: ServingContext, build: Callable[..., T], *args: Any) -> T:
    """`build(*args)` (validate, template, tokenize, make SamplingParams) off the event loop. OpenAIError passes
    through; any other exception is a fault of ours: this request alone gets a 500 naming an id that the one log
    line (with the traceback) carries. Nothing of the request has reached the engine yet."""
    try:
        return await ctx.off_loop(build, *args)
    except OpenAIError:
        raise
    except Exception as e:
        error_id = random_id("prep")
        logger.exception("request %s: preparing it failed: %s: %s", error_id, type(e).__name__, e)
        raise OpenAIError(f"internal error while preparing the request (id {error_id}); the server log has the "
                          f"details", 500) from None


def resolve_max_tokens(requested: Optional[int], num_prompt_tokens: int, max_model_len: int,
                       default: Optional[int]) -> int:
    """The number of new tokens to ask for, or a 400 that states the limit and the counts.

    requested None: `default` clipped to what is left (None = everything left), as vLLM does.
    """
    if num_prompt_tokens == 0:
        raise OpenAIError("The prompt is empty (0 tokens); send at least one token.", 400, "prompt")
    left = max_model_len - num_prompt_tokens
    if requested is None:
        if left <= 0:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length "
                f"of the prompt.", 400, "messages")
        return left if default is None else min(default, left)
    if requested < 0:
        raise OpenAIError(f"max_tokens must be non-negative, got {requested}", 400, "max_tokens")
    if num_prompt_tokens + requested > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} in the "
            f"completion). Please reduce the length of the prompt or the completion.", 400, "max_tokens")
    return requested


def make_sampling_params(req: Any, max_tokens: int, logprobs: Optional[int],
                         prompt_logprobs: Optional[int] = None, scoring_only: bool = False,
                         skip_special_tokens: Optional[bool] = None) -> SamplingParams:
    """SamplingParams from the request's OpenAI/vLLM fields; ValueError becomes a 400.

    scoring_only: the request asked for max_tokens 0 and runs one discarded token (min_tokens ignored).
    skip_special_tokens: overrides the request's field (False when an output parser needs the special-token
    markers); None keeps the request's.
    """
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=0 if scoring_only else req.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:  # SamplingParams' messages start with the field's name
        field_name = str(e).split(" ", 1)[0]
        known = field_name in SAMPLING_FIELDS  # fields with a default_factory (stop, ...) are no class attributes
        raise OpenAIError(str(e), 400, field_name if known else None) from e


@dataclass
class PromptRun:
    """One prompt's engine request and its accumulated state (choices are cumulative CompletionOutputs)."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    timer: RequestTimer
    request_id: str = field(default_factory=lambda: random_id("cmpl"))
    agen: Optional[AsyncIterator[RequestOutput]] = None
    first: Optional[RequestOutput] = None
    choices: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0
    finished: bool = False
    choice_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> its output tokens so far

    def absorb(self, out: RequestOutput) -> None:
        """Fold one RequestOutput in (latest cumulative state per choice; timers). The n choices decode side by
        side, so ITL/TPOT count tokens per sequence: the longest choice's count. Choices paced apart by
        --stream-interval (one held while another finished) arrive in different outputs, so the count is taken
        per choice, not as the largest delta of each output."""
        for c in out.outputs:
            self.choices[c.index] = c
            self.choice_tokens[c.index] = self.choice_tokens.get(c.index, 0) + len(c.token_ids_delta)
        num_new = max(self.choice_tokens.values(), default=0) - self.timer.num_tokens
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.timer.on_tokens(num_new, out.queue_time)
        if out.finished:
            self.finished = True
            self.timer.finish(len(self.prompt_ids), [len(c.token_ids) for c in self.choices.values()])


async def _until_disconnected(raw: Request) -> None:
    """Returns when the ASGI server reports `http.disconnect`. The JSON body was already read, so `receive()` just
    waits for that message: no polling (a 50 ms `is_disconnected()` poll per waiting request cost ~28 us each)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(raw: Optional[Request], aw: Awaitable[T]) -> T:
    """Await `aw`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(aw)
    if raw is None:
        return await task
    watcher = asyncio.ensure_future(_until_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


async def start_runs(ctx: ServingContext, raw: Optional[Request], runs: list[PromptRun]) -> None:
    """Submit every run and wait for its first output (raises OpenAIError / ClientDisconnected)."""
    if not ctx.engine.is_healthy():
        raise OpenAIError("the engine is not running", 503)
    for run in runs:
        run.agen = ctx.engine.generate(run.prompt_ids, run.params, request_id=run.request_id,
                                       stream_interval=ctx.limits.stream_interval)

    async def first(run: PromptRun) -> None:
        try:
            run.first = await run.agen.__anext__()  # type: ignore[union-attr]
        except StopAsyncIteration:
            raise OpenAIError("the engine ended the request without output", 500) from None
        except Exception as e:  # RequestRejected, EngineError, ValueError
            raise to_openai_error(e) from e

    await race_disconnect(raw, asyncio.gather(*(first(r) for r in runs)))


def _absorb(run: PromptRun, out: RequestOutput) -> None:
    run.absorb(out)
    for c in out.outputs:
        if (failure := engine_failure(c)) is not None:
            raise OpenAIError(failure, 500)


async def merge_runs(runs: list[PromptRun]) -> AsyncIterator[tuple[PromptRun, RequestOutput]]:
    """Yield (run, output) from every run until all finish; the first outputs come first. Raises OpenAIError
    (500) at the first choice the engine failed (finish_reason "error"), for streaming and non-streaming alike."""
    for run in runs:
        assert run.first is not None
        _absorb(run, run.first)
        yield run, run.first
    pending = [r for r in runs if not r.finished]
    if len(pending) == 1:  # the common case: no tasks needed
        run = pending[0]
        async for out in run.agen:  # type: ignore[union-attr]
            _absorb(run, out)
            yield run, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: PromptRun) -> None:
        try:
            async for out in run.agen:  # type: ignore[union-attr]
                await queue.put((run, out, None))
        except Exception as e:  # forwarded to the consumer
            await queue.put((run, None, e))
        finally:
            await queue.put((run, None, None))

    tasks = [asyncio.ensure_future(pump(r)) for r in pending]
    try:
        live = len(tasks)
        while live:
            run, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                live -= 1
                continue
            _absorb(run, out)
            yield run, out
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def close_runs(ctx: ServingContext, runs: list[PromptRun]) -> None:
    """Close the engine iterators and abort every unfinished run (idempotent, never raises).

    Shielded: it runs in `finally` blocks of cancelled tasks (client disconnect), where anyio would otherwise
    cancel every await again.
    """
    with anyio.CancelScope(shield=True):
        for run in runs:
            if run.agen is not None:
                with contextlib.suppress(BaseException):
                    await run.agen.aclose()  # type: ignore[attr-defined]
            if not run.finished:
                with contextlib.suppress(BaseException):
                    await ctx.engine.abort(run.request_id)


def engine_failure(c: CompletionOutput) -> Optional[str]:
    """The client-facing message for a choice the engine failed (finish_reason "error"), else None."""
    if c.finish_reason != "error":
        return None
    return f"the engine failed this request: {c.error or 'unknown error'}"


async def collect_runs(ctx: ServingContext, raw: Optional[Request], runs: list[PromptRun]) -> None:
    """Non-streaming: run to completion, aborting if the client disconnects."""

    async def drain() -> None:
        async for _ in merge_runs(runs):
            pass

    try:
        await start_runs(ctx, raw, runs)
        await race_disconnect(raw, drain())
    finally:
        await close_runs(ctx, runs)


async def stream_runs(ctx: ServingContext, raw: Optional[Request], runs: list[PromptRun],
                      body: Callable[[], AsyncIterator[str]]) -> Response:
    """Streaming: start every run (errors raise before any SSE byte, so they become 4xx/5xx), then stream
    `body()`, which owns closing the runs. A client gone during the start gets 499; any failure closes the runs."""
    try:
        await start_runs(ctx, raw, runs)
    except ClientDisconnected:
        await close_runs(ctx, runs)
        return Response(status_code=499)
    except BaseException:
        await close_runs(ctx, runs)
        raise
    return StreamingResponse(body(), media_type="text/event-stream")


def make_usage(runs: list[PromptRun]) -> UsageInfo:
    prompt = sum(len(r.prompt_ids) for r in runs)
    completion = sum(len(c.token_ids) for r in runs for c in r.choices.values())
    cached = sum(r.num_cached_tokens for r in runs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def clamp_logprob(value: float) -> float:
    """-inf (and NaN) are not JSON; report them as -9999.0, as vLLM does."""
    return value if value == value and value > -9999.0 else -9999.0


def stop_reason_or_none(value: object) -> Optional[Union[int, str]]:
    """The engine's stop_reason as the API reports it: the matched stop token id or string, else None."""
    return value if isinstance(value, (int, str)) else None


async def sse_body(ctx: ServingContext, runs: list[PromptRun], chunks: AsyncIterator[bytes],
                   usage_chunk: Callable[[], Optional[bytes]]) -> AsyncIterator[bytes]:
    """The SSE stream around an endpoint's `chunks`: those, then `usage_chunk()` (None: no usage chunk) and
    [DONE]. An error after the 200 went out becomes an error event and [DONE]; the runs are closed in every case
    (end, error, client gone)."""
    try:
        async for text in chunks:
            yield text
        if (usage := usage_chunk()) is not None:
            yield usage
        yield SSE_DONE
    except Exception as e:
        err = to_openai_error(e)
        yield sse(error_body(err.message, err.status))
        yield SSE_DONE
    finally:
        await close_runs(ctx, runs)


def include_usage(req: Any) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
