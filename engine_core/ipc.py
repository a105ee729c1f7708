"""ZeroMQ plumbing shared by the frontend, the engine core and the workers.

Every link uses one long-lived socket per direction. Endpoints are ``ipc://`` paths in a private
temporary directory, unique per server instance, so two servers on one machine never collide
(all processes share one host; a multi-host launch would use ``tcp://`` addresses instead). A message is a multipart frame
list: ``[MessageType byte, msgpack payload]``.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

import msgspec
import zmq

from .protocol import MessageType, decode, encode


@dataclass(frozen=True)
class Endpoints:
    """Addresses of one server instance's links."""

    requests: str  # frontend PUSH -> engine core PULL
    outputs: str  # engine core PUSH -> frontend PULL
    steps: str  # engine core PUB -> workers SUB
    results: str  # workers PUSH -> engine core PULL

    @classmethod
    def local(cls) -> "Endpoints":
        base = tempfile.mkdtemp(prefix="mini-deepinfer-")
        tag = uuid.uuid4().hex[:8]
        return cls(*(f"ipc://{os.path.join(base, f'{name}-{tag}')}" for name in ("req", "out", "step", "res")))

    def cleanup(self) -> None:
        for address in (self.requests, self.outputs, self.steps, self.results):
            if address.startswith("ipc://"):
                path = address[len("ipc://"):]
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self.requests.startswith("ipc://"):
            try:
                os.rmdir(os.path.dirname(self.requests[len("ipc://"):]))
            except OSError:
                pass


def make_socket(context: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # unbounded queues: dropping a step plan or a token would corrupt state; flow control is the
    # scheduler's job (max_num_seqs, max_queued_requests)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def send(sock: zmq.Socket, kind: MessageType, message: msgspec.Struct, flags: int = 0) -> None:
    sock.send_multipart([kind.value, encode(message)], flags=flags, copy=False)


async def asend(sock, kind: MessageType, message: msgspec.Struct) -> None:
    """``send`` for a ``zmq.asyncio`` socket."""
    await sock.send_multipart([kind.value, encode(message)], copy=False)


def split(frames: list) -> tuple[MessageType, bytes]:
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    kind = MessageType(bytes(frames[0]))
    return kind, frames[1]


def decode_as(payload, kind: type):
    return decode(payload if isinstance(payload, (bytes, memoryview)) else payload.buffer, kind)
