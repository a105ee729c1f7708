"""The OpenAI-compatible HTTP server: ``build_app`` (any ``EngineClientBase``; tests inject the
fake engine) and ``run_server`` (``mini-deepinfer serve``: the ZMQ engine client on uvicorn+uvloop).

Middleware, outermost first: X-Request-Id (every response carries it, errors included), CORS
(only with ``--allowed-origins``; answers preflights before auth sees them), bearer-token auth
(all routes but /health, and /metrics unless ``--metrics-require-key``), the drain guard (503
once draining) and the body limit (413, counted while the body is read). They are plain ASGI
callables, not ``BaseHTTPMiddleware``, which would buffer streams and hide client disconnects
from the handlers.

``run_app`` serves with graceful drain: the first SIGTERM/SIGINT stops admission (new requests
get 503 with Retry-After, /health says "draining") while the listener stays open; requests in
flight get up to ``shutdown_timeout`` seconds to finish, then end with an error; then uvicorn
shuts down (the engine with it) and the process exits 0. A second signal forces the exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .admission import Admission
from .api import build_router
from .engine_client import EngineClientBase
from .errors import APIError, error_body, install_error_handlers, shutting_down
from .serving import ServingContext
from .tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # load balancers and Prometheus carry no key
API_KEY_ENV = "MINI_DEEPINFER_API_KEY"  # so the key need not appear in `ps`
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
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


async def send_error(send: Send, error: APIError, extra_headers: tuple = ()) -> None:
    """An OpenAI error envelope, sent by a middleware (outside the app's exception handlers)."""
    body = msgspec.json.encode(error_body(error.message, error.type, error.param, error.code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items()), *extra_headers]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        await send_error(send, APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                        "invalid_request_error", None, "invalid_api_key"),
                         ((b"www-authenticate", b"Bearer"),))


class _BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes",
                         "invalid_request_error", None, "request_too_large")


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` (413): at once when Content-Length says so, otherwise as
    soon as the bytes received pass the limit, so an oversized (or chunked, unsized) body is never
    held in memory whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await send_error(send, _BodyTooLarge(self.max_bytes), ((b"connection", b"close"),))
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)  # the app's APIError handler answers 413
            return message

        await self.app(scope, limited_receive, send)


class DrainGuard:
    """While draining, every new request but /health and /metrics gets 503 with Retry-After."""

    def __init__(self, app: ASGIApp, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.admission.draining and scope["path"] not in OPEN_PATHS:
            return await send_error(send, shutting_down())
        await self.app(scope, receive, send)


async def _watch_engine(app: FastAPI, engine: EngineClientBase) -> None:
    """Notice an engine death between requests (clients that report it, via ``is_dead``)."""
    while not getattr(engine, "is_dead", False):
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    log.error("the engine died; /health now answers 503")
    hook: Callable[[], None] | None = getattr(app.state, "on_engine_dead", None)
    if hook is not None:
        hook()


def build_app(engine: EngineClientBase, tokenizer: Tokenizer | None, model_name: str, api_key: str | None,
              allowed_origins: list[str], max_queued_requests: int, *, max_running_seqs: int | None = None,
              max_seqs_per_request: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              metrics_require_key: bool = False, sse_keepalive_s: float = 15.0) -> FastAPI:
    """The app. ``max_running_seqs``: sequences the engine runs at once (default: the engine's
    ``max_num_seqs`` when it has one); with ``max_queued_requests`` it sets the admission capacity."""
    if max_running_seqs is None:
        max_running_seqs = int(getattr(engine, "max_num_seqs", 0))
    admission = Admission(max_running_seqs, max_queued_requests, max_seqs_per_request)
    ctx = ServingContext(engine, tokenizer, model_name, admission, sse_keepalive_s)

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
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(DrainGuard, admission=admission)
    if api_key:
        open_paths = frozenset({"/health"}) if metrics_require_key else OPEN_PATHS
        app.add_middleware(BearerAuthMiddleware, api_key=api_key, open_paths=open_paths)
    if allowed_origins:  # no CORS headers at all unless origins are given
        # credentials (cookies, auth headers) only for named origins, never for any origin
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_credentials="*" not in allowed_origins,
                           allow_methods=["*"], allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
    return app


class DrainingServer:
    """Runs a uvicorn server with our own signal handling (see the module docstring)."""

    def __init__(self, config, admission: Admission, shutdown_timeout: float):
        import uvicorn

        self.admission, self.shutdown_timeout = admission, shutdown_timeout
        self.server = uvicorn.Server(config)
        self.forced = False
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        # uvicorn's handlers would close the listener at the first signal and re-raise the signal
        # at exit (a non-zero status): ours drain first and exit normally
        self.server.capture_signals = self._capture_signals  # type: ignore[method-assign]

    @contextlib.contextmanager
    def _capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._loop = asyncio.get_running_loop()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        if self._draining:  # the second signal: stop now
            log.warning("second signal: exiting without waiting for requests in flight")
            self.forced = True
            self.server.force_exit = self.server.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self.drain(), name="drain")

    async def drain(self) -> None:
        admission = self.admission
        admission.start_drain()
        log.info("draining: no new requests; waiting up to %.1f s for %d in flight", self.shutdown_timeout,
                 admission.active)
        deadline = time.monotonic() + self.shutdown_timeout
        while admission.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission.active:
            log.warning("shutdown timeout: stopping %d requests still in flight", admission.stop_all())
            grace = time.monotonic() + 2.0  # for their error events to be written
            while admission.active and time.monotonic() < grace:
                await asyncio.sleep(0.02)
        self.server.should_exit = True

    def run(self, sockets=None) -> None:
        self.server.run(sockets=sockets)


def run_app(app: FastAPI, host: str, port: int, *, shutdown_timeout: float = 30.0, log_level: str = "info",
            loop: str = "uvloop") -> DrainingServer:
    """Serve ``app`` until SIGTERM/SIGINT and a graceful drain; returns the (stopped) server."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, loop=loop, log_level=log_level, timeout_graceful_shutdown=3)
    server = DrainingServer(config, app.state.serving.admission, shutdown_timeout)
    app.state.server = server.server
    server.run()
    return server


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM and a drain (exit 0), or until the engine dies or fails to start,
    or a second signal forces the exit (exit 1)."""
    from engine_core.config import engine_config_from_args

    from .zmq_engine_client import ZmqEngineClient

    config = engine_config_from_args(args)
    try:
        tokenizer: Tokenizer | None = Tokenizer(config.model)
    except TokenizerError as exc:
        log.warning("no tokenizer (%s): only token-id prompts will work", exc)
        tokenizer = None
    model_name = args.served_model_name or Path(config.model).resolve().name
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    app = build_app(ZmqEngineClient(config), tokenizer, model_name, resolve_api_key(args), origins,
                    config.max_queued_requests, max_running_seqs=config.max_num_seqs * config.dp_size,
                    max_seqs_per_request=config.max_seqs_per_request,
                    max_request_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
                    metrics_require_key=getattr(args, "metrics_require_key", False))
    log_level = str(getattr(args, "log_level", "info")).lower()
    engine_died = False

    def on_engine_dead() -> None:
        nonlocal engine_died
        engine_died = True
        app.state.server.should_exit = True

    host = f"[{args.host}]" if ":" in args.host else args.host
    app.state.on_engine_dead = on_engine_dead
    app.state.on_started = lambda: log.info("serving %r (max_model_len %d) at http://%s:%d/v1", model_name,
                                            app.state.serving.max_model_len, host, args.port)
    server = run_app(app, args.host, args.port, shutdown_timeout=getattr(args, "shutdown_timeout", 30.0),
                     log_level=log_level)
    if not server.server.started:
        log.error("the server did not start (see the errors above)")
        return 1
    if engine_died:
        log.error("exiting because the engine died")
        return 1
    if server.forced:
        log.error("forced exit before the requests in flight finished")
        return 1
    return 0


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else the MINI_DEEPINFER_API_KEY environment variable (kept out of `ps`)."""
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


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
