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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody receives it, it only shows in the access log


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


async def run_until_disconnect(raw: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then the work is cancelled (and its
    cleanup awaited) and ``ClientDisconnected`` is raised."""
    work_task = asyncio.ensure_future(work)
    listener = asyncio.create_task(wait_for_disconnect(raw.receive))
    try:
        await asyncio.wait((work_task, listener), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself (server shutdown)
        if not work_task.done():
            await _cancel_and_wait(work_task)
        await _cancel_and_wait(listener)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


class SSEResponse(Response):
    """Server-sent events from an async generator of ready-made ``data: ...\\n\\n`` frames."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None):
        # like StreamingResponse: no body attribute, so no Content-Length header
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self._stream(send))
        listener = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait((stream, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_and_wait(stream, listener)
            await self.events.aclose()  # a no-op when it ran to the end or was cancelled inside
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            log.error("streaming a response failed", exc_info=stream.exception())

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for frame in self.events:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
