"""POST /v1/chat/completions: chat template, logprobs (OpenAI's chat format), streaming and not.

Stream shape (OpenAI): per choice a first chunk with delta {"role": "assistant", "content": ""}, then content
deltas, the last one carrying finish_reason; with stream_options.include_usage one more chunk with empty
choices and the usage; then `data: [DONE]`. With `--reasoning-parser` / `--tool-call-parser` (chat_output.py) the
deltas carry `reasoning_content` and OpenAI-shaped `tool_calls` too, and the message `reasoning_content` /
`tool_calls`.
`max_tokens` / `max_completion_tokens` (the newer name wins); omitted = everything the context has left.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

import jinja2

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ladle.core.outputs import TokenLogprobs
from ladle.engine.tokenizer import ChatInputError
from ladle.engine.tokenizer import chat_prompt_ids as engine_chat_prompt_ids
from ladle.server.chat_output import ChatOutputs
from ladle.server.errors import OpenAIError
from ladle.server.metrics import RequestTimer
from ladle.server.protocol import (ChatChoiceLogprobs, ChatCompletionRequest, ChatCompletionResponse,
                                   ChatCompletionResponseChoice, ChatLogprobToken, ChatResponseMessage, random_id)
from ladle.server.serving_common import (ClientDisconnected, PromptRun, ServingContext, clamp_logprob, collect_runs,
                                         include_usage, make_sampling_params, make_usage, merge_runs, prepare,
                                         resolve_max_tokens, sse_body, stop_reason_or_none, stream_runs)
from ladle.server.stream_chunks import SSE_DONE, SSEFrame
from ladle.server.validation import check_logprobs_count, check_sampling_fields

logger = logging.getLogger("ladle.server")


def chat_prompt_ids(tokenizer, req: ChatCompletionRequest, add_special_tokens: bool = False) -> list[int]:
    """`req.messages` through the chat template (engine/tokenizer.chat_prompt_ids: chat_template_kwargs,
    continue_final_message, tools), tokenized (`add_special_tokens`: the tokenizer's own on top of the template's;
    /tokenize's field). continue_final_message drops the default add_generation_prompt.
    Blocking: call it off the event loop. The request's text was checked already (validation.check_model_fields).
    Refused messages and kwargs (ChatInputError) are a 400 naming the field. Template errors are the client's (the
    template rejects these messages, roles, tools or kwargs): a 400 that quotes the template's own message
    (jinja2.TemplateError, raised by `raise_exception` in the template) or names the exception type only."""
    try:
        return engine_chat_prompt_ids(
            tokenizer, [m.model_dump(exclude_none=True) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message, tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs, add_special_tokens=add_special_tokens)
    except ChatInputError as e:
        raise OpenAIError(str(e), 400, e.param) from None
    except jinja2.TemplateError as e:
        raise OpenAIError(f"could not apply the chat template: {e}", 400, "messages") from None
    except Exception as e:  # the template met input it cannot render (e.g. a tool call of the wrong shape)
        logger.info("chat template failed on a request's messages: %s: %s", type(e).__name__, e)
        raise OpenAIError(f"could not apply the chat template to these messages ({type(e).__name__})", 400,
                          "messages") from None


def _chat_logprobs(ctx: ServingContext, token_ids: list[int], entries: Optional[list[TokenLogprobs]],
                   k: int) -> list[dict[str, Any]]:
    """OpenAI chat logprobs of `token_ids` as plain dicts (protocol.ChatLogprobToken's fields)."""
    out = []
    for i, tid in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        s = ctx.token_str(tid)
        if not entry:
            out.append({"token": s, "logprob": -9999.0, "bytes": list(s.encode()), "top_logprobs": []})
            continue
        tops = []
        for a, lp, _rank in entry[1:1 + k]:
            alt = ctx.token_str(a)
            tops.append({"token": alt, "logprob": clamp_logprob(lp), "bytes": list(alt.encode())})
        out.append({"token": s, "logprob": clamp_logprob(entry[0][1]), "bytes": list(s.encode()), "top_logprobs": tops})
    return out


# The fields of a chat chunk's `delta` (OpenAI's ChatCompletionStreamResponseDelta, with vLLM's reasoning_content):
# a parser's delta body keeps these, those that are set.
_DELTA_FIELDS = ("role", "content", "reasoning_content", "tool_calls")


def _delta(body: dict[str, Any]) -> dict[str, Any]:
    """A parser's delta body as the chunk's `delta`: the _DELTA_FIELDS that are set."""
    return {k: v for k, v in body.items() if v is not None and k in _DELTA_FIELDS}


def _stream_choice(index: int, delta: dict[str, Any], logprobs: Optional[dict] = None,
                   finish_reason: Optional[str] = None, stop_reason: Optional[object] = None) -> dict[str, Any]:
    """A chat chunk's choice as a plain dict (OpenAI's stream choice, with vLLM's stop_reason)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


class ChatHandler:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    def _build_run(self, req: ChatCompletionRequest) -> tuple[PromptRun, bool, ChatOutputs]:
        """Validate, template, tokenize, make the SamplingParams (runs on the preparation pool, off the loop)."""
        ctx = self.ctx
        check_sampling_fields(req, ctx.limits, ctx.vocab_size)
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        check_logprobs_count(req.top_logprobs, ctx.limits, ctx.vocab_size, "top_logprobs")
        outputs = ChatOutputs(ctx.limits, req)
        prompt_ids = chat_prompt_ids(ctx.tokenizer, req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), ctx.max_model_len, None)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = make_sampling_params(req, max(max_tokens, 1), top, scoring_only=max_tokens == 0,
                                      skip_special_tokens=False if outputs.active else None)
        run = PromptRun(index=0, prompt_ids=prompt_ids, prompt_text="", params=params,
                        timer=RequestTimer(ctx.metrics))
        return run, max_tokens == 0, outputs

    async def handle(self, req: ChatCompletionRequest, raw: Request) -> Response:
        run, zero, outputs = await prepare(self.ctx, self._build_run, req)
        runs = [run]
        if zero:  # max_tokens 0: nothing to generate
            response = self._response(req, run, outputs, zero=True)
            if req.stream:
                return StreamingResponse(self._replay(req, response), media_type="text/event-stream")
            return JSONResponse(response.model_dump())
        if req.stream:
            return await stream_runs(self.ctx, raw, runs, lambda: self._stream(req, run, outputs))
        try:
            await collect_runs(self.ctx, raw, runs)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._response(req, run, outputs).model_dump())

    # ------------------------------------------------------------------------------------ non-streaming
    def _response(self, req: ChatCompletionRequest, run: PromptRun, outputs: ChatOutputs,
                  zero: bool = False) -> ChatCompletionResponse:
        choices = []
        for i in range(req.n):
            c = run.choices.get(i)
            logprobs = ChatChoiceLogprobs(content=[]) if req.logprobs else None
            if zero or c is None:
                choices.append(ChatCompletionResponseChoice(index=i, message=ChatResponseMessage(content=""),
                                                            logprobs=logprobs, finish_reason="length"))
                continue
            if req.logprobs:
                logprobs = ChatChoiceLogprobs(content=[ChatLogprobToken(**t) for t in _chat_logprobs(
                    self.ctx, c.token_ids, c.logprobs, req.top_logprobs or 0)])
            choices.append(ChatCompletionResponseChoice(
                index=i, message=ChatResponseMessage(**outputs.message(i, c.text)), logprobs=logprobs,
                finish_reason=outputs.finish_reason(i, c.finish_reason),
                stop_reason=stop_reason_or_none(c.stop_reason)))
        usage = make_usage([run])
        return ChatCompletionResponse(id=random_id("chatcmpl"), model=self.ctx.model_name, choices=choices,
                                      usage=usage)

    async def _replay(self, req: ChatCompletionRequest, response: ChatCompletionResponse) -> AsyncIterator[bytes]:
        frame = SSEFrame(response.id, "chat.completion.chunk", response.model, response.created)
        for ch in response.choices:
            yield frame.choice(_stream_choice(ch.index, {"role": "assistant", "content": ""}))
            yield frame.choice(_stream_choice(ch.index, {"content": ch.message.content or ""},
                                              finish_reason=ch.finish_reason))
        if include_usage(req):
            yield frame.usage(response.usage)
        yield SSE_DONE

    # ------------------------------------------------------------------------------------ streaming
    def _stream(self, req: ChatCompletionRequest, run: PromptRun, outputs: ChatOutputs) -> AsyncIterator[bytes]:
        """Per choice a role chunk, then one chunk per delta body of each output (the engine client paces outputs
        by --stream-interval): plain dicts, encoded once."""
        ctx = self.ctx
        frame = SSEFrame(random_id("chatcmpl"), "chat.completion.chunk", ctx.model_name)
        top = req.top_logprobs or 0

        def usage_chunk() -> Optional[bytes]:
            return frame.usage(make_usage([run])) if include_usage(req) else None

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(req.n):
                yield frame.choice(_stream_choice(i, {"role": "assistant", "content": ""}))
            async for _run, out in merge_runs([run]):
                for c in out.outputs:
                    logprobs = None
                    if req.logprobs:
                        logprobs = {"content": _chat_logprobs(ctx, c.token_ids_delta, c.logprobs_delta, top),
                                    "refusal": None}
                    bodies = outputs.feed(c.index, c.text_delta, final=c.finish_reason is not None)
                    bodies = [b for b in bodies if b.get("content") != ""] or [{}]
                    if bodies == [{}] and not c.finish_reason and not (logprobs and logprobs["content"]):
                        continue
                    if not outputs.active and bodies == [{}]:
                        bodies = [{"content": ""}]  # without parsers every chunk carries `content`, as before
                    finish = outputs.finish_reason(c.index, c.finish_reason)
                    last = len(bodies) - 1
                    for k, body in enumerate(bodies):
                        yield frame.choice(_stream_choice(
                            c.index, _delta(body), logprobs if k == 0 else None, finish if k == last else None,
                            stop_reason_or_none(c.stop_reason) if k == last else None))

        return sse_body(ctx, [run], chunks(), usage_chunk)  # no pass-through generator: one frame less per chunk
