"""ZeroMQ plumbing shared by the frontend, the engine core and the workers.

Every link uses one long-lived socket per direction. A message is a multipart frame list:
``[MessageType byte, msgpack payload]``.

Who may talk on a link:

* ``ipc://`` endpoints (one host) live in a private directory (mode 0700, sockets 0600), unique per
  server instance, so only the server's own user can connect: no rogue subscriber reads plans and
  no rogue puller steals requests. Whichever process outlives the others removes the directory.
* ``tcp://`` endpoints (several hosts) always use ZMQ CURVE: one keypair for the binding (server)
  side and one for the connecting (client) side, handed to the processes inside the serialized
  ``Endpoints`` (never on a command line). On one host the launcher makes them
  (``Endpoints.tcp``); across nodes every node derives the same ones from the shared cluster key
  (engine_core/cluster.py). A peer without the server's public key cannot complete the handshake,
  so it neither reads nor injects anything.

Every receive loop parses with ``parse``, which never raises: a malformed message (wrong frame
count, unknown type byte, undecodable or mistyped payload) is logged, rate-limited, and dropped.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from .protocol import MessageType, decode, encode

log = logging.getLogger(__name__)
DROP_LOG_INTERVAL_S = 5.0  # at most one "dropped" line per channel per interval (a flood must not flood the log)
IPC_DIR_MAX_LEN = 90  # leaves room for "/req-12345678" within the 107-byte limit
LINKS = ("requests", "outputs", "steps", "results")


@dataclass(frozen=True)
class Endpoints:
    """Addresses of one server instance's links, and the CURVE keys of its ``tcp://`` links (Z85 text)."""

    requests: str  # frontend PUSH (bind) -> engine core PULL
    outputs: str  # engine core PUSH -> frontend PULL (bind)
    steps: str  # engine core PUB (bind) -> workers SUB
    results: str  # workers PUSH -> engine core PULL (bind)
    server_public: str = ""
    server_secret: str = ""
    client_public: str = ""
    client_secret: str = ""

    @classmethod
    def local(cls) -> "Endpoints":
        base = tempfile.mkdtemp(prefix="mini-deepinfer-")
        if len(base) > IPC_DIR_MAX_LEN:  # a socket path must fit in sockaddr_un (107 bytes): long TMPDIRs break bind
            os.rmdir(base)
            base = tempfile.mkdtemp(prefix="mini-deepinfer-", dir="/tmp")
        os.chmod(base, 0o700)  # mkdtemp already does; stated here because security depends on it
        tag = uuid.uuid4().hex[:8]
        return cls(*(f"ipc://{os.path.join(base, f'{name}-{tag}')}" for name in ("req", "out", "step", "res")))

    @classmethod
    def tcp(cls, host: str = "127.0.0.1", ports: tuple[int, int, int, int] | None = None) -> "Endpoints":
        """``tcp://`` links (multi-node) with fresh CURVE keypairs."""
        ports = ports or tuple(_free_port(host) for _ in LINKS)
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(*(f"tcp://{host}:{port}" for port in ports), server_public.decode(), server_secret.decode(),
                   client_public.decode(), client_secret.decode())

    @property
    def directory(self) -> str | None:
        """The private socket directory of ``ipc://`` links (None over tcp)."""
        if not self.requests.startswith("ipc://"):
            return None
        return os.path.dirname(self.requests[len("ipc://"):])

    def socket(self, context: zmq.Context, kind: int, address: str, bind: bool,
               prepare: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
        """A socket on one of these links; CURVE whenever the address is ``tcp://``. ``prepare`` runs
        before the socket binds or connects (options and monitors that must see the first connection)."""
        curve = None
        if address.startswith("tcp://"):
            if not (self.server_public and self.server_secret and self.client_public and self.client_secret):
                raise ValueError(f"{address}: tcp:// links need CURVE keys (use Endpoints.tcp)")
            curve = (self.server_public, self.server_secret, self.client_public, self.client_secret)
        return make_socket(context, kind, address, bind, curve, prepare)

    def cleanup(self) -> None:
        """Remove the socket files and their directory (idempotent; any process may call it)."""
        for address in (self.requests, self.outputs, self.steps, self.results):
            if address.startswith("ipc://"):
                try:
                    os.unlink(address[len("ipc://"):])
                except OSError:
                    pass
        if self.directory is not None:
            try:
                os.rmdir(self.directory)
            except OSError:
                pass


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_socket(context: zmq.Context, kind: int, address: str, bind: bool,
                curve: tuple[str, str, str, str] | None = None,
                prepare: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
    """``curve`` = (server public, server secret, client public, client secret): the binding side
    is the CURVE server, the connecting side a client that must know the server's public key."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # unbounded queues: dropping a step plan or a token would corrupt state; flow control is the
    # scheduler's job (max_num_seqs, max_queued_requests)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        server_public, server_secret, client_public, client_secret = (k.encode() for k in curve)
        if bind:
            sock.curve_server = True
            sock.curve_secretkey = server_secret
            sock.curve_publickey = server_public
        else:
            sock.curve_serverkey = server_public
            sock.curve_publickey = client_public
            sock.curve_secretkey = client_secret
    if prepare is not None:
        prepare(sock)
    if bind:
        sock.bind(address)
        if address.startswith("ipc://"):
            os.chmod(address[len("ipc://"):], 0o600)
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


class DropLog:
    """Counts dropped messages of one channel and logs them at most once per interval."""

    def __init__(self, channel: str, interval: float = DROP_LOG_INTERVAL_S):
        self.channel, self.interval = channel, interval
        self.dropped = 0
        self._unlogged = 0
        self._last = float("-inf")

    def drop(self, why: str) -> None:
        self.dropped += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last >= self.interval:
            log.warning("%s: dropped %d malformed message(s); latest: %s", self.channel, self._unlogged, why[:200])
            self._unlogged, self._last = 0, now


def parse(frames: list, types: dict[MessageType, type], drops: DropLog):
    """``(kind, message)`` for a well-formed message of an expected type, else None (dropped).

    Never raises: a peer's bytes must not be able to kill or wedge a receive loop."""
    try:
        kind, payload = split(frames)
        expected = types.get(kind)
        if expected is None:
            raise ValueError(f"unexpected message type {kind.name}")
        return kind, decode_as(payload, expected)
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the peer's fault: drop it
        drops.drop(f"{type(exc).__name__}: {exc}")
        return None
