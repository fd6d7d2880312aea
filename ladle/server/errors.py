"""OpenAI error bodies and the mapping from exceptions to HTTP status codes.

Body: {"error": {"message", "type", "param", "code"}} (OpenAI's shape; vLLM uses the same), `type` a name ending in
"Error", rendered by one serializer (`error_json`) whether a handler or ladle.server.api's ASGI middleware (401,
413, last-resort 500) answers. FastAPI's 422 for request validation is replaced by 400 with this body.

A body FastAPI did not read as JSON (a Content-Type other than application/json or a `+json` type, or none: FastAPI's
`strict_content_type`) is a 400 that says to send the header, not pydantic's "Input should be a valid dictionary".
It is not read as JSON anyway: OpenAI's API and vLLM's server refuse it too, and a browser sends a cross-site POST
with text/plain, form or no Content-Type without a CORS preflight, so a web page could drive a local server.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ladle.engine.client import EngineError, RequestRejected
from ladle.server.protocol import ErrorInfo, ErrorResponse, random_id

logger = logging.getLogger("ladle.server")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error with a status code, raised anywhere in a handler, rendered as an OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, err_type: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")


def error_body(message: str, status: int, param: Optional[str] = None, err_type: Optional[str] = None) -> dict:
    err = OpenAIError(message, status, param, err_type)
    return ErrorResponse(error=ErrorInfo(message=message, type=err.err_type, param=param, code=status)).model_dump()


def render_error(content: Any) -> bytes:
    """An error body as bytes, compact. ASCII-escaped: an error about text that is not valid Unicode must still
    render."""
    return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_json(message: str, status: int, param: Optional[str] = None) -> bytes:
    """The error body as bytes (for answers sent below the app, by the ASGI middleware)."""
    return render_error(error_body(message, status, param))


class ErrorJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return render_error(content)


def error_response(message: str, status: int, param: Optional[str] = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(message, status, param), status_code=status)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Map engine / validation exceptions to an OpenAIError (status + message)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestRejected):  # subclass of ValueError: check first
        return OpenAIError(str(exc), 400)
    if isinstance(exc, ValueError):  # SamplingParams validation
        return OpenAIError(str(exc), 400)
    if isinstance(exc, EngineError):
        return OpenAIError(f"engine error: {exc}", 500)
    error_id = random_id("err")  # the client sees the id, the log has the exception
    logger.error("error %s: %s: %s", error_id, type(exc).__name__, exc, exc_info=exc)
    return OpenAIError(f"internal error (id {error_id}); the server log has the details", 500)


def _field_path(loc: list) -> Optional[str]:
    """pydantic's error location as a field path (`messages[0].content`), without its union-branch tags
    (`str`, `list[dict[str,any]]`)."""
    path = ""
    for x in loc:
        if isinstance(x, int):
            path += f"[{x}]"
        elif x.isidentifier() and x not in ("str", "int", "float", "bool", "list", "dict"):
            path += f".{x}" if path else x
        else:
            break
    return path or None


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    parts, param = [], None
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"malformed JSON: {err.get('msg')}")
            continue
        where = ".".join(str(x) for x in loc) or "body"
        param = param or _field_path(loc)
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def _body_not_json(exc: RequestValidationError) -> bool:
    """Whether FastAPI validated the body as raw bytes: it did not read it as JSON (its Content-Type)."""
    return any(tuple(err.get("loc", ())) == ("body",) and isinstance(err.get("input"), (bytes, bytearray))
               for err in exc.errors())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if _body_not_json(exc):
            given = request.headers.get("content-type")
            told = f"this request's Content-Type is {given[:80]!r}" if given else "this request has no Content-Type"
            return error_response(f"the request body must be JSON sent with the header Content-Type: "
                                  f"application/json ({told})", 400)
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return ErrorJSONResponse(
            ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.err_type, param=exc.param,
                                          code=exc.status)).model_dump(),
            status_code=exc.status,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    # No handler for Exception: Starlette runs that one in its outermost middleware and re-raises afterwards, so
    # uvicorn would close the keep-alive connection. ladle.server.api.EdgeMiddleware answers those with a 500.
