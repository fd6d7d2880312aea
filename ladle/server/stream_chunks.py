"""The bytes of a streamed response (SSE), without a pydantic model per chunk, and `--stream-interval`'s pacing.

Each chunk is a plain dict with exactly the fields the protocol's stream models have (protocol.py:
CompletionStreamResponse, ChatCompletionStreamResponse; tests/server/test_stream_golden.py holds the JSON to the one
those models wrote), encoded once with msgspec into a frame whose shared fields were encoded when the response began.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import msgspec

from ladle.engine.client import CompletionOutput
from ladle.engine.output_stream import merge_choice_outputs
from ladle.server.protocol import UsageInfo

json_encode = msgspec.json.encode  # UTF-8 JSON bytes, non-ASCII kept as is (json.dumps(ensure_ascii=False))
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One SSE event (`data: <json>` + blank line) of a plain JSON value."""
    return b"data: " + json_encode(obj) + b"\n\n"


class SSEFrame:
    """The events of one streamed response, without a pydantic model per chunk: the fields every chunk shares
    (`id`, `object`, `created`, `model`) are encoded once; each chunk encodes only its choice (a plain dict with the
    fields of protocol.CompletionStreamChoice / ChatCompletionStreamChoice) or its usage.

    `object`: "text_completion" or "chat.completion.chunk". `created`: seconds since the epoch (one per response,
    as OpenAI's and vLLM's chunks carry).
    """

    def __init__(self, response_id: str, object_name: str, model: str, created: Optional[int] = None):
        head = json_encode({"id": response_id, "object": object_name,
                            "created": int(time.time()) if created is None else created, "model": model})
        self._open = b"data: " + head[:-1] + b',"choices":['

    def choice(self, choice: dict) -> bytes:
        """`data: {...,"choices":[<choice>]}` + blank line."""
        return self._open + json_encode(choice) + b"]}\n\n"

    def usage(self, usage: UsageInfo) -> bytes:
        """The usage chunk: no choices, `usage` set."""
        return self._open + b'],"usage":' + json_encode(usage.model_dump()) + b"}\n\n"


class StreamPacer:
    """`--stream-interval N`: which choice outputs become a chunk now; the others are held and merged into the next.

    vLLM's rule (RequestState.make_request_output in vllm/v1/engine/output_processor.py): a choice's output is sent
    when it finishes, when nothing of the choice was sent yet (the first token goes at once: TTFT is unchanged), or
    when at least N tokens arrived since the last send. With N tokens per output that is every output; with one
    token per step and T tokens, 1 + ceil((T - 1) / N) chunks. N = 1 passes every output through.
    """

    def __init__(self, interval: int):
        self.interval = interval
        self._held: dict[Any, CompletionOutput] = {}
        self._sent: set = set()

    def take(self, key: Any, c: CompletionOutput) -> Optional[CompletionOutput]:
        """Choice `key`'s new output -> what to send now (merged with what was held), or None (held)."""
        if self.interval == 1:
            return c
        held = self._held.pop(key, None)
        if held is not None:
            c = merge_choice_outputs(held, c)
        if c.finish_reason is not None or key not in self._sent or len(c.token_ids_delta) >= self.interval:
            self._sent.add(key)
            return c
        self._held[key] = c
        return None


def stream_interval_refusals(stream_interval: Any) -> list[str]:
    """`--stream-interval` below 1 (or not an int): the refusal line; [] when usable."""
    if isinstance(stream_interval, int) and not isinstance(stream_interval, bool) and stream_interval >= 1:
        return []
    return [f"--stream-interval {stream_interval}: tokens per streamed chunk must be an integer >= 1 (1 sends "
            f"every token as it comes, vLLM's default)"]
