"""The OpenAI-compatible HTTP server: ``build_app`` (any ``EngineClientBase``; tests inject the
fake engine) and ``run_server`` (``mini-deepinfer serve``: the ZMQ engine client on uvicorn+uvloop).

Middleware, outermost first: X-Request-Id (every response carries it, errors included), CORS
(answers preflights before auth sees them), bearer-token auth (all routes but /health and
/metrics). They are plain ASGI callables, not ``BaseHTTPMiddleware``, which would buffer streams
and hide client disconnects from the handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .api import build_router
from .engine_client import EngineClientBase
from .errors import error_body, install_error_handlers
from .serving import ServingContext
from .tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # load balancers and Prometheus carry no key
ENGINE_WATCH_INTERVAL_S = 0.5
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII: safe in a header and in engine ids


class RequestIdMiddleware:
    """Takes the client's X-Request-Id (or makes one), keeps it in ``scope["state"]`` for the
    handlers, and echoes it on the response."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        body = msgspec.json.encode(error_body("Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                              "invalid_request_error", None, "invalid_api_key"))
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


async def _watch_engine(app: FastAPI, engine: EngineClientBase) -> None:
    """Notice an engine death between requests (clients that report it, via ``is_dead``)."""
    while not getattr(engine, "is_dead", False):
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    log.error("the engine died; /health now answers 503")
    hook: Callable[[], None] | None = getattr(app.state, "on_engine_dead", None)
    if hook is not None:
        hook()


def build_app(engine: EngineClientBase, tokenizer: Tokenizer | None, model_name: str, api_key: str | None,
              allowed_origins: list[str], max_queued_requests: int, *, model_root: str | None = None) -> FastAPI:
    ctx = ServingContext(engine, tokenizer, model_name, max_queued_requests, model_root)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        hook: Callable[[], None] | None = getattr(app.state, "on_started", None)
        if hook is not None:
            hook()
        watcher = asyncio.create_task(_watch_engine(app, engine), name="engine-watch")
        try:
            yield
        finally:
            watcher.cancel()
            await engine.shutdown()

    app = FastAPI(title="mini-deepinfer", summary="OpenAI-compatible DeepSeek-V4.1 inference", lifespan=lifespan)
    app.state.serving = ctx
    install_error_handlers(app)
    app.include_router(build_router(ctx, created=int(time.time())))
    # add_middleware puts each new one outside the previous ones
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_credentials=True,
                       allow_methods=["*"], allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
    return app


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (exit 0), or until the engine dies or fails to start (exit 1)."""
    import uvicorn

    from engine_core.config import engine_config_from_args

    from .zmq_engine_client import ZmqEngineClient

    config = engine_config_from_args(args)
    try:
        tokenizer: Tokenizer | None = Tokenizer(config.model)
    except TokenizerError as exc:
        log.warning("no tokenizer (%s): only token-id prompts will work", exc)
        tokenizer = None
    model_name = args.served_model_name or Path(config.model).name
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    app = build_app(ZmqEngineClient(config), tokenizer, model_name, args.api_key, origins,
                    config.max_queued_requests, model_root=config.model)
    log_level = str(getattr(args, "log_level", "info")).lower()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop", log_level=log_level,
                                           timeout_graceful_shutdown=10))
    engine_died = False

    def on_engine_dead() -> None:
        nonlocal engine_died
        engine_died = True
        server.should_exit = True

    host = f"[{args.host}]" if ":" in args.host else args.host
    app.state.on_engine_dead = on_engine_dead
    app.state.on_started = lambda: log.info("serving %r (max_model_len %d) at http://%s:%d/v1", model_name,
                                            app.state.serving.max_model_len, host, args.port)
    server.run()
    if not server.started:
        log.error("the server did not start (see the errors above)")
        return 1
    if engine_died:
        log.error("exiting because the engine died")
        return 1
    return 0


class BackgroundServer:
    """An app served by uvicorn in a daemon thread on a free port (tests and the frontend benchmark)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning", loop: str = "uvloop"):
        import socket
        import threading

        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))  # bound here, so the port is ours before the thread starts
        self.host, self.port = host, self._socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, loop=loop, log_level=log_level, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
