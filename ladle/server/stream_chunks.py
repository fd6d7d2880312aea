"""The bytes of a streamed response (SSE), without a pydantic model per chunk, and `--stream-interval`'s check
(the pacing itself: ladle/engine/output_stream.py, where the engine client feeds each request's outputs).

Each chunk is a plain dict with the fields of OpenAI's stream chunks (CreateCompletionResponse's choice /
CreateChatCompletionStreamResponse's, plus vLLM's `stop_reason` and `reasoning_content`; the chat choice:
serving_chat._stream_choice, its delta's fields: serving_chat._DELTA_FIELDS), encoded once with msgspec into a frame
whose shared fields were encoded when the response began. tests/server/test_stream_golden.py holds the JSON to what
the pydantic stream models it replaced wrote; tests/server/test_openai_schema.py to OpenAI's schema.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import msgspec

from ladle.server.protocol import UsageInfo

json_encode = msgspec.json.encode  # UTF-8 JSON bytes, non-ASCII kept as is (json.dumps(ensure_ascii=False))
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One SSE event (`data: <json>` + blank line) of a plain JSON value."""
    return b"data: " + json_encode(obj) + b"\n\n"


class SSEFrame:
    """The events of one streamed response, without a pydantic model per chunk: the fields every chunk shares
    (`id`, `object`, `created`, `model`) are encoded once; each chunk encodes only its choice (a plain dict:
    index, text or delta, logprobs, finish_reason, stop_reason) or its usage.

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


def stream_interval_refusals(stream_interval: Any) -> list[str]:
    """`--stream-interval` below 1 (or not an int): the refusal line; [] when usable."""
    if isinstance(stream_interval, int) and not isinstance(stream_interval, bool) and stream_interval >= 1:
        return []
    return [f"--stream-interval {stream_interval}: tokens per streamed chunk must be an integer >= 1 (1 sends "
            f"every token as it comes, vLLM's default)"]
