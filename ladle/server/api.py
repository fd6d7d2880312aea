"""The FastAPI app (`build_app`) and the uvicorn runner (`run_server`).

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health (503 once the engine loop is dead),
/version, /tokenize, /detokenize, /metrics, /debug/dispatch. While serving, a stats line is logged every
`log_stats_interval` seconds (stats_log.py; `--disable-log-stats` turns it off); `--disable-uvicorn-access-log`
turns uvicorn's per-request access log off.
A pure ASGI middleware (not BaseHTTPMiddleware, which would hide client disconnects from the handlers)
enforces `--api-key` on /v1/*, refuses a body over `--max-request-body-bytes` (413) before anything parses it,
turns an exception no handler caught into a 500 body (so the keep-alive connection survives: Starlette's own
last-resort handler re-raises, and uvicorn then closes the connection) and echoes the client's X-Request-Id header
(never used as an internal id).
The engine is created before uvicorn starts (load errors print plainly) and shut down in the lifespan, so
SIGTERM (handled by uvicorn) aborts everything and exits cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import logging
import signal
import socket
import sys
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ladle.config import EngineConfig, ServerConfig, env_flag
from ladle.engine.client import EngineClient
from ladle.engine.core_process import freeze_startup_objects
from ladle.server.errors import OpenAIError, error_body, error_json, install_error_handlers
from ladle.server.metrics import CONTENT_TYPE, ServerMetrics
from ladle.server.parsers import parser_flag_refusals
from ladle.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                   ModelCard, ModelList, TokenizeRequest, TokenizeResponse, ladle_version, random_id)
from ladle.server.serving_chat import ChatHandler, chat_prompt_ids
from ladle.server.serving_common import ServingContext, prepare
from ladle.server.serving_completions import CompletionHandler
from ladle.server.stats_log import StatsLogger
from ladle.server.validation import check_model_fields

logger = logging.getLogger("ladle.server")


_BODY_METHODS = {"POST", "PUT", "PATCH"}
# The collector's young-generation threshold while the app serves (CPython's default: 700 net allocations). Streaming
# allocates a few container objects per token and per chunk that die young; at 700 the young passes cost about 13% of
# the API server's CPU time at 128 streams (benchmarks/serve_chunk_rate.py, its gc column: ~280 young passes and 2-3
# full ones per 32k chunks, timed with gc.callbacks), at 20000 under 1%. Restored when the app stops.
SERVING_GC_GEN0_THRESHOLD = 20_000


class EdgeMiddleware:
    """Bearer-token check on /v1/*, body-size limit, last-resort 500 and X-Request-Id echo, as a plain ASGI
    wrapper."""

    def __init__(self, app: Any, api_key: Optional[str], max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope.get("path", "").startswith("/v1") and scope.get("method") != "OPTIONS":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await _send_error(send, "Unauthorized: a valid API key is required", 401)
                return
        client_id = headers.get("x-request-id")
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if client_id is not None:
                    message = dict(message)
                    message["headers"] = list(message.get("headers", [])) + [
                        (b"x-request-id", client_id.encode("latin-1"))]
            await send(message)

        if scope.get("method") in _BODY_METHODS:
            receive = await self._read_body(headers, receive, send_with_id)
            if receive is None:
                return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 — no handler took it: this request alone fails
            error_id = random_id("err")
            logger.error("request %s (%s %s) failed", error_id, scope.get("method"), scope.get("path"),
                         exc_info=exc)
            if not started:
                await _send_error(send_with_id, f"internal error (id {error_id}); the server log has the details",
                                  500)

    async def _read_body(self, headers: dict, receive: Any, send: Any) -> Optional[Any]:
        """Read the whole body, refusing it (413, connection closed) as soon as it is known to exceed the limit:
        from Content-Length before reading, else while reading. Returns a `receive` that replays the body and then
        forwards to the server's (http.disconnect), or None when the request was answered or the client left."""
        limit = self.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _send_too_large(send, int(declared), limit)
            return None
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # http.disconnect: nobody to answer
            body += message.get("body", b"")
            if len(body) > limit:
                await _send_too_large(send, None, limit)
                return None
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return replay


async def _send_error(send: Any, message: str, status: int, param: Optional[str] = None,
                      close: bool = False) -> None:
    """The same body and headers as the app's error responses (errors.ErrorJSONResponse), from the middleware."""
    body = error_json(message, status, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(b"connection", b"close")] if close else []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_too_large(send: Any, size: Optional[int], limit: int) -> None:
    """413; `size` is the declared Content-Length, None for a chunked body cut off at the limit."""
    told = f"is {size} bytes" if size is not None else "is longer"
    await _send_error(send, f"the request body {told}; at most {limit} bytes are allowed (--max-request-body-bytes)",
                      413, close=True)


def _config_dict(config: Any) -> Any:
    if config is None:
        return {}
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return str(config)


def _dispatch_snapshot() -> Any:
    """ladle.observe.dispatch's counters if the module is there, else {}."""
    try:
        from ladle.observe import dispatch
    except Exception:
        return {}
    return dispatch.snapshot()


def build_app(engine: EngineClient, server_config: Optional[ServerConfig] = None) -> FastAPI:
    """An app serving `engine`. The lifespan shuts the engine down when the server stops."""
    server_config = server_config or ServerConfig()
    refusals = parser_flag_refusals(server_config.tool_call_parser, server_config.reasoning_parser,
                                    server_config.enable_auto_tool_choice)
    if refusals:  # `ladle serve` refuses these before loading; this is for apps built in code
        raise ValueError("; ".join(refusals))
    engine_config = getattr(engine, "engine_config", None)
    model_cfg = getattr(engine_config, "model", None)
    extra = (getattr(model_cfg, "served_model_name", None), getattr(model_cfg, "model", None))
    metrics = ServerMetrics(engine.get_stats, engine.model_name, int(engine.max_model_len))
    ctx = ServingContext(engine, metrics, extra_model_names=tuple(n for n in extra if n), limits=server_config)
    completions, chat = CompletionHandler(ctx), ChatHandler(ctx)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        stats_task = None
        if not server_config.disable_log_stats:
            stats_task = asyncio.ensure_future(StatsLogger(engine.get_stats, server_config.log_stats_interval).run())
        freeze_startup_objects()  # the API server's own startup objects leave the collector's generations too
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], SERVING_GC_GEN0_THRESHOLD), *thresholds[1:])
        yield
        gc.set_threshold(*thresholds)
        if stats_task is not None:
            stats_task.cancel()
        logger.info("shutting down the engine")
        with contextlib.suppress(Exception):
            await engine.shutdown()
        ctx.executor.shutdown(wait=False, cancel_futures=True)
        runner_cfg = getattr(engine_config, "runner", None)
        # --dispatch-report: the fast-path table at shutdown (an engine-core process prints its own)
        if getattr(runner_cfg, "dispatch_report", False) and not getattr(engine, "prints_dispatch_report", False):
            from ladle.observe import dispatch

            print(dispatch.format_table(), flush=True)

    app = FastAPI(title="ladle", version=ladle_version(), lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.handle(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.handle(req, raw)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=ctx.model_name, root=getattr(model_cfg, "model", None) or ctx.model_name,
                         max_model_len=ctx.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy():
            return Response(status_code=200)
        return JSONResponse(error_body("the engine loop is not running", 503), status_code=503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": ladle_version(), "engine_config": _config_dict(engine_config)})

    def tokenize_sync(req: TokenizeRequest) -> TokenizeResponse:
        check_model_fields(req)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", 400, "prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = list(ctx.tokenizer.encode(req.prompt, add_special_tokens=add_special))
        else:
            ids = chat_prompt_ids(ctx.tokenizer, ChatCompletionRequest(
                messages=req.messages, chat_template_kwargs=req.chat_template_kwargs,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                tools=req.tools), add_special_tokens=bool(req.add_special_tokens))  # None: off, the template adds them
        strs = [ctx.tokenizer.convert_ids_to_tokens(i) for i in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)

    def detokenize_sync(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model_fields(req)
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        return JSONResponse((await prepare(ctx, tokenize_sync, req)).model_dump())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await prepare(ctx, detokenize_sync, req)).model_dump())

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE)

    from ladle.server.debug import engine_snapshot, router as debug_router  # /debug/shapes, /debug/steps

    @app.get("/debug/dispatch")
    async def debug_dispatch(raw: Request) -> JSONResponse:
        if getattr(engine, "observe_snapshot", None) is None:
            return JSONResponse(_dispatch_snapshot())
        return JSONResponse(await engine_snapshot(raw, "dispatch"))

    app.include_router(debug_router)
    app.add_middleware(EdgeMiddleware, api_key=server_config.api_key,
                       max_body_bytes=server_config.max_request_body_bytes)
    return app


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Build the engine, serve until SIGINT/SIGTERM, shut the engine down. Returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ladle.engine.async_engine import AsyncEngine

    try:  # bind before loading the model, so a busy port fails in a second, not after the load
        sock = bind_socket(server_config.host, server_config.port)
    except OSError as e:
        print(f"ladle serve: error: cannot listen on {server_config.host}:{server_config.port}: {e.strerror or e} "
              "(pass another --port, or stop the process using it)", file=sys.stderr)
        return 1
    try:
        engine = AsyncEngine.from_config(engine_config)
    except Exception as e:  # load/config errors carry user-facing messages; no traceback unless asked
        if env_flag("LADLE_DEBUG"):
            raise
        print(f"ladle serve: error: {e}\n(set LADLE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    app = build_app(engine, server_config)
    logger.info("serving %s on http://%s:%d", engine.model_name, server_config.host, server_config.port)
    config = uvicorn_config(app, server_config)
    # uvicorn shuts down gracefully on SIGTERM (lifespan -> engine.shutdown()) and then re-raises the signal
    # under the handler that was installed before it started: make that one a clean exit (status 0).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    EngineStoppingServer(config, engine).run(sockets=[sock])
    return 0


def uvicorn_config(app: FastAPI, server_config: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings from the server flags (`--disable-uvicorn-access-log`: uvicorn's access_log=False)."""
    return uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=server_config.log_level,
                          timeout_graceful_shutdown=5, lifespan="on",
                          access_log=not server_config.disable_uvicorn_access_log)


class EngineStoppingServer(uvicorn.Server):
    """Aborts every request as soon as a stop signal arrives, so open streams end with finish_reason "abort" and
    `[DONE]` instead of being cut after uvicorn's graceful-shutdown timeout. Then uvicorn shuts down as usual."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient):
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.create_task(self._engine.shutdown())


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn (it listens on it). Raises OSError when the address is taken or invalid."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
