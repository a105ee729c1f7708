"""The OpenAI-compatible HTTP server: ``build_app`` (any ``EngineClientBase``; tests inject the
fake engine) and ``run_server`` (``mini-deepinfer serve``: the ZMQ engine client on uvicorn+uvloop).

Middleware, outermost first: X-Request-Id (every response carries it, errors included), CORS
(only with ``--allowed-origins``; answers preflights before auth sees them), bearer-token auth
(all routes but /health, and /metrics unless ``--metrics-require-key``), the drain guard (503
once draining) and the body limit (413, counted while the body is read). They are plain ASGI
callables, not ``BaseHTTPMiddleware``, which would buffer streams and hide client disconnects
from the handlers.

``run_server`` (``serve``) starts the engine before it opens the port, so a failure to start is one
line and exit code 1, and logs the startup summary once it listens. ``run_app`` serves with
graceful drain: the first SIGTERM/SIGINT stops admission (new requests
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
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_core.config import EngineConfig

from .admission import Admission
from .api import build_router
from .engine_client import EngineClientBase, EngineDeadError
from .errors import APIError, error_body, install_error_handlers, shutting_down
from .generation_config import load_sampling_defaults
from .metrics import DEFAULT_PREFIX, FrontendMetrics
from .server_config import API_KEY_ENV, ServerConfig
from .serving import ServingContext
from .stats_logger import StatsLogger
from .tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # load balancers and Prometheus carry no key
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
              metrics_require_key: bool = False, sse_keepalive_s: float = 15.0,
              served_model_names: tuple[str, ...] = (), metrics_prefix: str = DEFAULT_PREFIX,
              vllm_metrics_alias: bool = True, log_requests: bool = False,
              log_stats_interval: float | None = None) -> FastAPI:
    """The app. ``max_running_seqs``: sequences the engine runs at once (default: the engine's
    ``max_num_seqs`` when it has one); with ``max_queued_requests`` it sets the admission capacity.
    ``served_model_names``: every name /v1/models lists (``model_name``, the first, by default).
    ``log_requests``: a log line per finished request; ``log_stats_interval``: seconds between two
    stats lines while busy (None: none)."""
    if max_running_seqs is None:
        max_running_seqs = int(getattr(engine, "max_num_seqs", 0))
    admission = Admission(max_running_seqs, max_queued_requests, max_seqs_per_request)
    metrics = FrontendMetrics(engine, model_name=model_name, prefix=metrics_prefix, vllm_alias=vllm_metrics_alias,
                              log_requests=log_requests)
    ctx = ServingContext(engine, tokenizer, model_name, admission, sse_keepalive_s, metrics=metrics)
    ctx.served_model_names = tuple(served_model_names) or (model_name,)  # every name `model` may give
    metrics.set_pending_source(lambda: ctx.pending_first_output)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        hook: Callable[[], None] | None = getattr(app.state, "on_started", None)
        if hook is not None:
            hook()
        tasks = [asyncio.create_task(_watch_engine(app, engine), name="engine-watch")]
        if log_stats_interval is not None:
            tasks.append(asyncio.create_task(StatsLogger(engine, metrics, log_stats_interval).run(), name="stats-log"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await engine.shutdown()

    app = FastAPI(title="mini-deepinfer", summary="OpenAI-compatible DeepSeek-V4.1 inference", lifespan=lifespan)
    app.state.serving = ctx
    install_error_handlers(app)
    app.include_router(build_router(ctx, created=int(time.time()), model_names=ctx.served_model_names))
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

    def run(self, prepare: Callable[[], Awaitable[bool]] | None = None,
            on_listening: Callable[[], None] | None = None) -> bool:
        """Serve until the drain ends. ``prepare`` runs first on the server's event loop (False: do not
        serve, return False); ``on_listening`` is called once the socket listens."""
        config = self.server.config
        factory = getattr(config, "get_loop_factory", None)
        if factory is None:  # older uvicorn: it installs its loop policy instead
            config.setup_event_loop()
        with asyncio.Runner(loop_factory=factory() if factory is not None else None) as runner:
            return runner.run(self._main(prepare, on_listening))

    async def _main(self, prepare, on_listening) -> bool:
        if prepare is not None and not await self._interruptible(prepare):
            return False
        watcher = asyncio.ensure_future(self._when_listening(on_listening)) if on_listening is not None else None
        try:
            await self.server.serve()  # (a port in use: uvicorn logs it and raises SystemExit)
        finally:
            if watcher is not None:
                watcher.cancel()
        return True

    async def _when_listening(self, callback: Callable[[], None]) -> None:
        while not self.server.started:
            await asyncio.sleep(0.02)
        callback()

    @staticmethod
    async def _interruptible(prepare: Callable[[], Awaitable[bool]]) -> bool:
        """``prepare()``, cancelled by SIGINT/SIGTERM (uvicorn's handlers are not installed yet, and the
        event loop's own Ctrl-C handling does not reach a uvloop loop); False if interrupted."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(prepare())
        signals = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
        for sig in signals:
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            log.warning("interrupted before the server started")
            return False
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)


def run_app(app: FastAPI, host: str, port: int, *, shutdown_timeout: float = 30.0, access_log: bool = True,
            loop: str = "uvloop", prepare: Callable[[], Awaitable[bool]] | None = None,
            on_listening: Callable[[], None] | None = None) -> DrainingServer:
    """Serve ``app`` until SIGTERM/SIGINT and a graceful drain; returns the (stopped) server.
    uvicorn's loggers keep no handlers of their own: their lines take the process's log format."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, loop=loop, log_config=None, log_level=None,
                            access_log=access_log, timeout_graceful_shutdown=3)
    server = DrainingServer(config, app.state.serving.admission, shutdown_timeout)
    app.state.server = server.server
    server.run(prepare, on_listening)
    return server


def run_server(server_config: ServerConfig, engine_config: EngineConfig, log_level: str = "INFO") -> int:
    """Start the engine, then serve until SIGINT/SIGTERM and a drain (exit 0); exit 1 if the engine
    fails to start or dies, or a second signal forces the exit."""
    from .startup_summary import summary_lines
    from .zmq_engine_client import ZmqEngineClient

    try:
        tokenizer: Tokenizer | None = Tokenizer(engine_config.model)
    except TokenizerError as exc:
        log.warning("no tokenizer (%s): only token-id prompts will work", exc)
        tokenizer = None
    names = server_config.model_names(engine_config.model)
    engine = ZmqEngineClient(engine_config, log_level=log_level)
    c = server_config
    app = build_app(engine, tokenizer, names[0], c.resolved_api_key, c.origins, engine_config.max_queued_requests,
                    max_running_seqs=engine_config.max_num_seqs * engine_config.dp_size,
                    max_seqs_per_request=engine_config.max_seqs_per_request, max_request_bytes=c.max_request_bytes,
                    metrics_require_key=c.metrics_require_key, served_model_names=names,
                    metrics_prefix=c.metrics_prefix, vllm_metrics_alias=c.vllm_metrics_alias,
                    log_requests=not c.disable_log_requests,
                    log_stats_interval=None if c.disable_log_stats else c.log_stats_interval)
    # --generation-config: the defaults of the sampling knobs a request leaves out (ValueError: exit 2)
    app.state.serving.sampling_defaults = load_sampling_defaults(engine_config.model, engine_config.generation_config)
    engine_died = engine_ready = False

    def on_engine_dead() -> None:
        nonlocal engine_died
        engine_died = True
        app.state.server.should_exit = True

    async def start_engine() -> bool:
        """The engine first, so that a failure is one line and the port opens only when it can serve."""
        nonlocal engine_ready
        try:
            await engine.start()
        except EngineDeadError as exc:
            log.error("%s", exc)
            await engine.shutdown()
            return False
        except asyncio.CancelledError:  # Ctrl-C while the model loads
            await engine.shutdown()
            raise
        engine_ready = True
        return True

    def on_listening() -> None:
        host = f"[{c.host}]" if ":" in c.host else c.host
        for line in summary_lines(engine_config.model, names, engine.summary, f"http://{host}:{c.port}",
                                  engine_config.model_overrides):
            log.info("%s", line)

    app.state.on_engine_dead = on_engine_dead
    server = run_app(app, c.host, c.port, shutdown_timeout=c.shutdown_timeout,
                     access_log=not c.disable_uvicorn_access_log, prepare=start_engine, on_listening=on_listening)
    if not server.server.started:
        if engine_ready:  # (an engine that failed to start, or a signal, has said why already)
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
