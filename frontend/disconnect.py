"""Client disconnects cancel generation, streaming or not.

The ASGI server reports a closed connection as an ``http.disconnect`` message on ``receive()``.
We listen for it in a task that races the work (the way vLLM's ``with_cancellation`` does, and
not by polling ``request.is_disconnected()``, which misses disconnects while the handler awaits
the engine). When the client goes first, the work is cancelled; cancellation closes the engine
generators, and closing a generator aborts its engine request.

* ``run_until_disconnect``: a non-streaming handler's work (the request body must already be read:
  until then ``receive()`` returns the body, not the disconnect).
* ``SSEResponse``: a streaming response that also listens while streaming, and always closes its
  event generator, so the engine request is aborted even when the client vanishes between tokens
  (Starlette's ``StreamingResponse`` cancels the sending task but leaves the generator to the GC).
  While it waits for the next event it sends an SSE comment (``: keep-alive``) every
  ``keepalive_s``, so proxies with idle timeouts keep the connection of a slow request open.

Both register with the admission's drain: when the shutdown timeout runs out, a stream ends with
an error event and ``[DONE]``, a non-streaming request with a 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import error_body, stopped_by_shutdown

if TYPE_CHECKING:
    from .admission import Admission

log = logging.getLogger(__name__)
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody receives it, it only shows in the access log
KEEPALIVE_FRAME = b": keep-alive\n\n"


class ClientDisconnected(Exception):
    pass


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_and_wait(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnect(raw: Request, work: Awaitable[T], admission: "Admission | None" = None) -> T:
    """``await work``, unless the client disconnects first: then the work is cancelled (and its
    cleanup awaited) and ``ClientDisconnected`` is raised. At the drain deadline the work is
    cancelled too, and a 503 raised."""
    work_task = asyncio.ensure_future(work)
    listener = asyncio.create_task(wait_for_disconnect(raw.receive))
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        work_task.cancel()

    untrack = admission.track(stop) if admission is not None else None
    try:
        await asyncio.wait((work_task, listener), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself (server shutdown)
        if not work_task.done():
            await _cancel_and_wait(work_task)
        await _cancel_and_wait(listener)
        if untrack is not None:
            untrack()
    if stopped:
        raise stopped_by_shutdown()
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


class SSEResponse(Response):
    """Server-sent events from an async generator of ready-made ``data: ...\\n\\n`` frames."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None, *,
                 keepalive_s: float = 15.0, admission: "Admission | None" = None,
                 on_close: Callable[[], None] | None = None):
        # like StreamingResponse: no body attribute, so no Content-Length header
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})
        self.events = events
        self.keepalive_s, self.admission, self.on_close = keepalive_s, admission, on_close
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self._stream(send))
        listener = asyncio.create_task(wait_for_disconnect(receive))
        stopped = False

        def stop() -> None:
            nonlocal stopped
            stopped = True
            stream.cancel()

        untrack = self.admission.track(stop) if self.admission is not None else None
        client_gone = False
        try:
            await asyncio.wait((stream, listener), return_when=asyncio.FIRST_COMPLETED)
            client_gone = listener.done()
        finally:
            await _cancel_and_wait(stream, listener)
            try:
                await self.events.aclose()  # a no-op when it ran to the end or was cancelled inside
            finally:
                if untrack is not None:
                    untrack()
                if self.on_close is not None:
                    self.on_close()
        if stopped and not client_gone:
            await self._send_shutdown_error(send)
        elif stream.done() and not stream.cancelled() and stream.exception() is not None:
            log.error("streaming a response failed", exc_info=stream.exception())

    async def _send_shutdown_error(self, send: Send) -> None:
        """The drain deadline passed: tell the client in-band, then end the stream."""
        error = stopped_by_shutdown()
        frame = b"data: " + msgspec.json.encode(error_body(error.message, error.type, error.param, error.code))
        try:
            if not self._started:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": frame + b"\n\ndata: [DONE]\n\n", "more_body": False})
        except Exception:  # the client went away meanwhile
            log.debug("could not send the shutdown error event", exc_info=True)

    async def _stream(self, send: Send) -> None:
        self._started = True
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        events = self.events.__aiter__()
        while True:
            # the next frame in a task, so waiting for it can time out (for a keep-alive) without
            # cancelling the generator
            pending = asyncio.ensure_future(events.__anext__())
            try:
                while True:
                    done, _ = await asyncio.wait((pending,), timeout=self.keepalive_s)
                    if done:
                        break
                    await send({"type": "http.response.body", "body": KEEPALIVE_FRAME, "more_body": True})
            except BaseException:  # cancelled: stop the generator and let it clean up before aclose()
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
                raise
            try:
                frame = pending.result()
            except StopAsyncIteration:
                break
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
