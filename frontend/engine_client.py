"""What the HTTP layer needs from an engine: submit a request and stream its outputs, abort, health.

``ZmqEngineClient`` (frontend/zmq_engine_client.py) talks to a real engine-core process over ZeroMQ;
``FakeEngineClient`` (frontend/fake_engine.py) produces tokens without a model, for testing and
benchmarking the frontend alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine_core.protocol import RequestOutput, SamplingParams, SchedulerStats


class EngineDeadError(RuntimeError):
    """The engine core or a worker died; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting (--max-queued-requests)."""


@dataclass(frozen=True)
class EngineInfo:
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None


class EngineClientBase(ABC):
    info: EngineInfo

    @abstractmethod
    async def start(self) -> None:
        """Start (or connect to) the engine; returns when it can take requests."""

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its output deltas; the last one has ``finish_reason`` set.

        If the consumer stops iterating early (client disconnect: the task is cancelled or the
        generator closed), the request is aborted in the engine. Raises ``QueueFullError`` before
        the first output when the waiting queue is full, ``EngineDeadError`` if the engine dies,
        ``ValueError`` when the engine rejects the request."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request (idempotent)."""

    @abstractmethod
    async def check_health(self, timeout: float = 5.0) -> bool:
        """True when every process is alive and a round trip through the engine loop answers in time."""

    @abstractmethod
    def stats(self) -> SchedulerStats:
        """The latest scheduler gauges the engine reported (summed over DP ranks)."""

    @abstractmethod
    async def shutdown(self) -> None: ...
