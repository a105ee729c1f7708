"""The engine-core process: IO threads around one single-threaded busy loop.

* input thread: receives frontend messages (add, abort, utility), decodes them, queues them;
* busy loop: apply queued messages (aborts take effect between steps), run one engine step,
  hand the step's outputs (batched) to the output thread;
* output thread: encodes and sends ``EngineOutputs`` / ``UtilityResponse`` to the frontend.

ZeroMQ and msgspec release the GIL, so (de)serialization overlaps the loop. On startup the process
starts the workers and tells the frontend ``ready`` (with the model facts) or why it failed; if a
worker dies or is stuck (a step or, while idle, a ping unanswered past its timeout: see
mp_executor.py), it tells the frontend ``ENGINE_DEAD`` and exits non-zero, so every in-flight
request ends with an error, /health answers 503 and the server exits.

A malformed frontend message is dropped (``ipc.parse``), never fatal. When the frontend is gone
(killed, so it could not clean up), the engine core stops its workers and removes the socket
directory itself.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback

import msgspec
import zmq

from .config import EngineConfig
from .core import EngineCore
from .engine_summary import build_summary
from .ipc import DropLog, Endpoints, parse, send
from .log_setup import configure_logging
from .mp_executor import MultiprocExecutor
from .protocol import (AbortRequests, AddRequest, EngineOutputs, MessageType, RequestOutput, UtilityRequest,
                       UtilityResponse)

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.5
PARENT_CHECK_S = 1.0


class EngineProcess:
    def __init__(self, config: EngineConfig, endpoints: Endpoints, log_level: str):
        self.config, self.endpoints = config, endpoints
        self.context = zmq.Context()
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.core = EngineCore(config, MultiprocExecutor(config, endpoints, log_level))
        self._last_stats = None

    # ------------------------------------------------------------------ IO threads
    def _input_thread(self) -> None:
        sock = self.endpoints.socket(self.context, zmq.PULL, self.endpoints.requests, bind=False)
        types = {MessageType.ADD: AddRequest, MessageType.ABORT: AbortRequests, MessageType.UTILITY: UtilityRequest}
        drops = DropLog("engine core input")
        while True:
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.ContextTerminated:
                return
            message = parse(frames, types, drops)
            if message is not None:
                self.inbox.put(message)

    def _output_thread(self) -> None:
        sock = self.endpoints.socket(self.context, zmq.PUSH, self.endpoints.outputs, bind=False)
        while True:
            item = self.outbox.get()
            if item is None:
                sock.close()
                return
            kind, message = item
            send(sock, kind, message)

    # ------------------------------------------------------------------ the busy loop
    def run(self) -> None:
        threading.Thread(target=self._input_thread, name="engine-input", daemon=True).start()
        output = threading.Thread(target=self._output_thread, name="engine-output", daemon=True)
        output.start()
        core = self.core
        executor = core.executor
        summary = build_summary(self.config, executor.info, core.max_model_len, getattr(executor, "devices", []),
                                getattr(executor, "kv_cache_dtype", ""))
        self.outbox.put((MessageType.UTILITY_RESPONSE, UtilityResponse(
            -1, "ready", core.stats(), max_model_len=core.max_model_len, vocab_size=core.vocab_size,
            eos_token_id=core.scheduler.config.eos_token_id, summary=summary)))
        # Everything alive now (modules, the executor, the pools) lives as long as the process: take
        # it out of the collector's full passes, which otherwise rescan it every few hundred steps
        # (measured: ~30 ms pauses at 1024 running sequences, docs/benchmarks.md).
        gc.collect()
        gc.freeze()
        parent = os.getppid()
        last_parent_check = time.monotonic()
        while True:
            outputs = self._drain_inbox(block=not core.has_work)
            if core.has_work:
                outputs += core.step()
            stats = core.stats()
            if outputs or stats != self._last_stats:
                self.outbox.put((MessageType.OUTPUTS, EngineOutputs(outputs, stats, time.time())))
                self._last_stats = stats
            if time.monotonic() - last_parent_check > PARENT_CHECK_S:
                last_parent_check = time.monotonic()
                core.executor.check_health(idle=not core.has_work)
                if os.getppid() != parent:
                    log.warning("frontend is gone; engine core exits")
                    return

    def _drain_inbox(self, block: bool) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        try:
            item = self.inbox.get(timeout=IDLE_POLL_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return outputs
        while True:
            kind, message = item
            if kind is MessageType.ADD:
                try:
                    self.core.add_request(message)
                except ValueError as exc:  # rejected: finish it at once with the reason
                    outputs.append(RequestOutput(message.request_id, [], "abort", error=str(exc)))
                except Exception as exc:  # noqa: BLE001 - an odd request must not take the engine down
                    log.exception("rejecting request %r", message.request_id)
                    outputs.append(RequestOutput(message.request_id, [], "abort",
                                                 error=f"the engine could not take the request: {type(exc).__name__}"))
            elif kind is MessageType.ABORT:
                outputs += self.core.abort(message.request_ids)
            elif kind is MessageType.UTILITY:
                self.outbox.put((MessageType.UTILITY_RESPONSE, UtilityResponse(message.call_id, "pong",
                                                                                self.core.stats())))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return outputs

    def shutdown(self) -> None:
        self.outbox.put(None)
        self.core.shutdown()


def engine_main(config_json: bytes, endpoints_json: bytes, log_level: str) -> None:
    """Entry point of the engine-core process (started by the frontend with the spawn method)."""
    configure_logging(log_level, "engine-core")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = msgspec.json.decode(config_json, type=EngineConfig)
    endpoints = msgspec.json.decode(endpoints_json, type=Endpoints)
    parent = os.getppid()
    process = None
    try:
        process = EngineProcess(config, endpoints, log_level)
        process.run()
    except SystemExit:
        raise
    except BaseException as exc:
        if process is None and isinstance(exc, (ValueError, OSError, RuntimeError)) and str(exc):
            # a startup failure with a clear reason (a bad file, too little memory, a worker that could
            # not start): the frontend logs it as one line; DEBUG shows where it came from
            log.debug("engine core failed to start", exc_info=True)
            reason = str(exc)
        else:
            log.error("engine core failed: %s", exc)
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
        _tell_frontend_dead(endpoints, reason)
        sys.exit(1)
    finally:
        if process is not None:
            process.shutdown()
        if os.getppid() != parent:  # the frontend died without cleaning up: we outlive it
            endpoints.cleanup()


def _tell_frontend_dead(endpoints: Endpoints, reason: str) -> None:
    context = zmq.Context()
    sock = endpoints.socket(context, zmq.PUSH, endpoints.outputs, bind=False)
    sock.setsockopt(zmq.LINGER, 2000)
    send(sock, MessageType.ENGINE_DEAD, UtilityResponse(-1, reason))
    sock.close()
    context.term()
