"""Workers as separate processes, one per DP rank, driven over ZeroMQ.

Step plans are broadcast on a PUB socket (every worker receives every plan and runs its rank's
part; see benchmarks/broadcast_bench.py for why PUB rather than a shared-memory ring at our
message sizes); each worker answers with one ``StepResult`` on a PUSH socket. Startup is a
handshake: each worker reports ``ready`` with its cache geometry (or the error that stopped it),
then a ping over the broadcast socket proves every subscription is live before the first plan.
A worker process that dies is noticed while waiting for results, and reported with its exit code.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import time

import msgspec
import zmq

from .config import EngineConfig
from .executor import Executor, WorkerInfo
from .ipc import Endpoints, decode_as, make_socket, send, split
from .protocol import MessageType, StepPlan, StepResult, WorkerControl

log = logging.getLogger(__name__)
WORKER_START_TIMEOUT_S = 600.0
RESULT_WAIT_WARNING_S = 60.0


class WorkerDiedError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, endpoints: Endpoints, log_level: str = "INFO"):
        from workers.worker_process import worker_main

        self.config, self.endpoints = config, endpoints
        self.context = zmq.Context()
        self.steps = make_socket(self.context, zmq.PUB, endpoints.steps, bind=True)
        self.results = make_socket(self.context, zmq.PULL, endpoints.results, bind=True)
        ctx = multiprocessing.get_context("spawn")
        config_json, endpoints_json = msgspec.json.encode(config), msgspec.json.encode(endpoints)
        dist_port = _free_port()
        self.processes = [
            ctx.Process(target=worker_main, name=f"mini-deepinfer-worker{rank}", daemon=True,
                        args=(config_json, endpoints_json, rank, dist_port, log_level))
            for rank in range(config.dp_size)
        ]
        for process in self.processes:
            process.start()
        self._buffered: dict[tuple[int, int], StepResult] = {}  # (step, rank) results that came early
        try:
            self.info = self._handshake()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ startup
    def _handshake(self) -> WorkerInfo:
        ready: dict[int, WorkerControl] = {}
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while len(ready) < len(self.processes):
            control = self._recv_control(deadline, "starting")
            if control.command != "ready":
                continue
            if control.error:
                raise RuntimeError(f"worker {control.rank} failed to start: {control.error}")
            ready[control.rank] = control
        # a SUB socket only receives what is published after its subscription reached us: ping
        # over the broadcast socket until every worker has answered one
        answered: set[int] = set()
        nonce = 0
        while len(answered) < len(self.processes):
            nonce += 1
            send(self.steps, MessageType.CONTROL, WorkerControl("ping", nonce=nonce))
            poll_until = time.monotonic() + 0.1
            while time.monotonic() < poll_until and len(answered) < len(self.processes):
                if self.results.poll(20):
                    kind, payload = split(self.results.recv_multipart(copy=False))
                    if kind is MessageType.CONTROL:
                        control = decode_as(payload, WorkerControl)
                        if control.command == "pong":
                            answered.add(control.rank)
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not answer the broadcast ping")
        first = next(iter(ready.values()))
        info = WorkerInfo(
            num_blocks=min(r.num_blocks for r in ready.values()),
            num_slots=min(r.num_slots for r in ready.values()),
            max_model_len=first.max_model_len, vocab_size=first.vocab_size, eos_token_id=first.eos_token_id)
        log.info("%d worker(s) ready: %d KV blocks and %d state slots per rank", len(ready), info.num_blocks - 1,
                 info.num_slots)
        return info

    def _recv_control(self, deadline: float, phase: str) -> WorkerControl:
        while True:
            if self.results.poll(200):
                kind, payload = split(self.results.recv_multipart(copy=False))
                if kind is MessageType.CONTROL:
                    return decode_as(payload, WorkerControl)
            self._check_alive(phase)
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not become ready within {WORKER_START_TIMEOUT_S:.0f} s; "
                                   "check the worker log lines above (model loading, memory)")

    def _check_alive(self, phase: str) -> None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise WorkerDiedError(f"worker {rank} exited (code {process.exitcode}) while {phase}")

    # ------------------------------------------------------------------ steps
    def submit(self, plan: StepPlan) -> int:
        send(self.steps, MessageType.STEP, plan)
        return plan.step_id

    def collect(self, step_id: int) -> list[StepResult]:
        ranks = range(len(self.processes))
        waited_since = time.monotonic()
        while not all((step_id, r) in self._buffered for r in ranks):
            if not self.results.poll(100):
                self._check_alive("running a step")
                if time.monotonic() - waited_since > RESULT_WAIT_WARNING_S:
                    missing = [r for r in ranks if (step_id, r) not in self._buffered]
                    log.warning("step %d: still waiting for rank(s) %s after %.0f s", step_id, missing,
                                RESULT_WAIT_WARNING_S)
                    waited_since = time.monotonic()
                continue
            kind, payload = split(self.results.recv_multipart(copy=False))
            if kind is MessageType.STEP_RESULT:
                result = decode_as(payload, StepResult)
                self._buffered[(result.step_id, result.rank)] = result
        return [self._buffered.pop((step_id, r)) for r in ranks]

    def check_health(self) -> None:
        self._check_alive("serving")

    def shutdown(self) -> None:
        try:
            send(self.steps, MessageType.CONTROL, WorkerControl("shutdown"))
        except zmq.ZMQError:
            pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        self.steps.close()
        self.results.close()
        self.context.term()
