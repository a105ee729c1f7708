"""The frontend's link to a real engine-core process, over ZeroMQ (asyncio).

One PUSH socket carries requests and aborts to the engine core, one PULL socket brings back its
outputs (batched per step); both are bound here, on endpoints unique to this server. A task reads
outputs and routes each delta to its request's queue; another watches the engine process, so a
crash is noticed even when no output arrives. A request whose consumer goes away (client
disconnect cancels the handler) is aborted in the engine.

The output reader survives any bytes: a malformed message is logged (rate-limited) and dropped.
The monitor also pings the engine loop each second; a loop that answers nothing for longer than a
step may take (``step_timeout``) plus ``ENGINE_UNRESPONSIVE_GRACE_S`` is declared dead, so no
stream waits forever even if the engine core itself is wedged. The socket directory is removed at
shutdown, or at interpreter exit if shutdown never ran.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from engine_core.config import EngineConfig
from engine_core.engine_process import engine_main
from engine_core.ipc import DropLog, Endpoints, asend, parse
from engine_core.protocol import (AbortRequests, AddRequest, EngineOutputs, EngineSummary, MessageType,
                                  RequestOutput, SamplingParams, SchedulerStats, UtilityRequest, UtilityResponse)

from .engine_client import EngineClientBase, EngineDeadError, EngineInfo

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 900.0
MONITOR_INTERVAL_S = 1.0
ENGINE_UNRESPONSIVE_GRACE_S = 10.0
OUTPUT_TYPES = {MessageType.OUTPUTS: EngineOutputs, MessageType.UTILITY_RESPONSE: UtilityResponse,
                MessageType.ENGINE_DEAD: UtilityResponse}


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class ZmqEngineClient(EngineClientBase):
    def __init__(self, config: EngineConfig, log_level: str = "INFO", endpoints: Endpoints | None = None):
        """``log_level``: the engine core's and the workers' (``--log-level``); ``endpoints``: default, a
        private ``ipc://`` directory; ``Endpoints.tcp()`` for CURVE over TCP."""
        self.config, self.log_level = config, log_level
        self.endpoints = endpoints or Endpoints.local()
        atexit.register(self.endpoints.cleanup)
        self._drops = DropLog("frontend engine outputs")
        self.context = zmq.asyncio.Context()
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stats = SchedulerStats()
        self._dead_reason: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.process: multiprocessing.Process | None = None
        self.summary: EngineSummary | None = None  # what the engine reported when ready

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine core and wait until it is ready; a second call returns at once (the
        server starts the engine before it listens, the app's lifespan calls this again)."""
        if self.process is not None:
            return
        self.requests = self.endpoints.socket(self.context, zmq.PUSH, self.endpoints.requests, bind=True)
        self.outputs = self.endpoints.socket(self.context, zmq.PULL, self.endpoints.outputs, bind=True)
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=engine_main, name="mini-deepinfer-engine-core",
                                   args=(msgspec.json.encode(self.config), msgspec.json.encode(self.endpoints),
                                         self.log_level))
        self.process.start()
        ready = await self._wait_ready()
        self.info = EngineInfo(ready.max_model_len, ready.vocab_size, ready.eos_token_id)
        self.summary = ready.summary
        if ready.stats is not None:
            self._stats = ready.stats
        self._tasks = [asyncio.create_task(self._read_outputs(), name="engine-outputs"),
                       asyncio.create_task(self._monitor(), name="engine-monitor")]

    async def _wait_ready(self) -> UtilityResponse:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if await self.outputs.poll(200):
                parsed = parse(await self.outputs.recv_multipart(copy=False), OUTPUT_TYPES, self._drops)
                if parsed is None or parsed[0] is MessageType.OUTPUTS:
                    continue
                kind, message = parsed
                if kind is MessageType.ENGINE_DEAD:
                    raise EngineDeadError(f"the engine failed to start: {message.result}")
                if kind is MessageType.UTILITY_RESPONSE and message.result == "ready":
                    return message
            elif not self.process.is_alive():
                raise EngineDeadError(f"the engine process exited during startup (code {self.process.exitcode})")
        raise EngineDeadError(f"the engine did not become ready within {STARTUP_TIMEOUT_S:.0f} s")

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
        self.requests.close()
        self.outputs.close()
        self.context.term()
        self.endpoints.cleanup()
        atexit.unregister(self.endpoints.cleanup)

    # ------------------------------------------------------------------ background tasks
    async def _read_outputs(self) -> None:
        while True:
            parsed = parse(await self.outputs.recv_multipart(copy=False), OUTPUT_TYPES, self._drops)
            if parsed is None:
                continue
            try:
                self._route(*parsed)
            except Exception:  # noqa: BLE001 - the reader must outlive any one message
                log.exception("could not route an engine message")

    def _route(self, kind: MessageType, message) -> None:
        if kind is MessageType.OUTPUTS:
            self._stats = message.stats
            for output in message.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
        elif kind is MessageType.UTILITY_RESPONSE:
            future = self._pending_calls.pop(message.call_id, None)
            if future is not None and not future.done():
                future.set_result(message)
            if message.stats is not None:
                self._stats = message.stats
        elif kind is MessageType.ENGINE_DEAD:
            self._die(message.result)

    async def _monitor(self) -> None:
        unresponsive_after = self.config.step_timeout + ENGINE_UNRESPONSIVE_GRACE_S
        ping: tuple[asyncio.Future, float] | None = None
        while self._dead_reason is None:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            if not self.process.is_alive():
                self._die(f"the engine process exited (code {self.process.exitcode})")
            elif self._tasks[0].done():
                self._die("the engine output reader stopped")
            elif ping is None or ping[0].done():
                call_id, future = self._call()
                future.add_done_callback(_consume)  # nobody awaits a liveness ping: mark its failure seen
                ping = (future, time.monotonic())
                await asend(self.requests, MessageType.UTILITY, UtilityRequest(call_id, "ping"))
            elif time.monotonic() - ping[1] > unresponsive_after:
                self._die(f"the engine core did not answer for {unresponsive_after:.0f} s")

    def _call(self) -> tuple[int, asyncio.Future]:
        """A call id and the future its utility response will resolve."""
        call_id = next(self._call_ids)
        future = self._pending_calls[call_id] = asyncio.get_running_loop().create_future()
        return call_id, future

    def _die(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        log.error("engine dead: %s", reason)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await asend(self.requests, MessageType.ADD, AddRequest(request_id, prompt_token_ids, params, time.time()))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.error:
                    finished = True
                    raise ValueError(item.error)
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self._dead_reason is None:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await asend(self.requests, MessageType.ABORT, AbortRequests([request_id]))

    async def check_health(self, timeout: float = 5.0) -> bool:
        if self._dead_reason is not None or self.process is None or not self.process.is_alive():
            return False
        call_id, future = self._call()
        await asend(self.requests, MessageType.UTILITY, UtilityRequest(call_id, "ping"))
        try:
            response = await asyncio.wait_for(future, timeout)
        except (asyncio.TimeoutError, EngineDeadError):
            return False
        finally:
            self._pending_calls.pop(call_id, None)
        return response.result == "pong"

    def stats(self) -> SchedulerStats:
        return self._stats
