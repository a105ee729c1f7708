"""Workers as separate processes, one per DP rank, driven over ZeroMQ.

Step plans are broadcast on a PUB socket (every worker receives every plan and runs its rank's
part; see benchmarks/broadcast_bench.py for why PUB rather than a shared-memory ring at our
message sizes); each worker answers with one ``StepResult`` on a PUSH socket. A GPU worker sends
step N's results after it has launched step N+1 (workers/step_pipeline.py); when the engine waits
for the newest step it sent, it broadcasts ``collect`` instead. Startup is a handshake: each worker
reports ``joined`` once its links are open, then ``ready`` with its cache
geometry (or the error that stopped it), then a ping over the broadcast socket proves every
subscription is live before the first plan. A local worker process that dies is noticed while
waiting for results, and reported with its exit code.

Several nodes (``--nnodes``, engine_core/cluster.py): this executor starts only node 0's ranks; the
other nodes' ranks are started by their headless supervisors (engine_core/headless.py) and reach
the two links over tcp. Every rank must join within ``--join-timeout`` (the error names the ranks
and nodes that did not); a headless supervisor whose worker dies reports it at once (``died`` on
the results link), which ends the engine as a local death does.

Liveness (a worker that is alive but stuck: stopped, deadlocked, hung in a collective):

* busy: a step whose results have not all arrived ``step_timeout`` seconds after it was submitted
  raises ``WorkerStuckError`` naming the missing rank(s) and the step id;
* idle: every ``IDLE_PING_INTERVAL_S`` the engine pings the workers over the broadcast socket; a
  ping unanswered after ``idle_ping_timeout`` raises the same error. A pong needs no compute, so
  this timeout is much shorter than the step timeout: ``min(step_timeout, max(5 s, step_timeout /
  10))`` (12 s with the default 120 s), long enough for a loaded host or a GC pause.

The engine core turns the error into ``ENGINE_DEAD`` (see engine_process.py); stuck workers are
SIGKILLed at shutdown, since a stopped process ignores SIGTERM until it is continued.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from .cluster import NodeLayout, cluster_endpoints, dist_init_method
from .config import EngineConfig
from .executor import Executor, WorkerInfo
from .ipc import DropLog, Endpoints, parse, send
from .protocol import MessageType, StepPlan, StepResult, StructuredOutput, WorkerControl

log = logging.getLogger(__name__)
WORKER_START_TIMEOUT_S = 600.0
RESULT_WAIT_WARNING_S = 60.0
IDLE_PING_INTERVAL_S = 2.0
MIN_IDLE_PING_TIMEOUT_S = 5.0
SHUTDOWN_JOIN_S = 5.0
SHUTDOWN_LINGER_MS = 1000
RESULT_TYPES = {MessageType.STEP_RESULT: StepResult, MessageType.CONTROL: WorkerControl}


class WorkerDiedError(RuntimeError):
    pass


class WorkerStuckError(RuntimeError):
    """A worker is alive but did not answer a step or a ping within its timeout."""


def _raise_if_died(control: WorkerControl) -> None:
    """A headless node's report that one of its workers is gone ends the engine as a local death does."""
    if control.command == "died":
        raise WorkerDiedError(control.error or f"worker {control.rank} died")


def idle_ping_timeout(step_timeout: float) -> float:
    return min(step_timeout, max(MIN_IDLE_PING_TIMEOUT_S, step_timeout / 10))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(config: EngineConfig, endpoints: Endpoints, ranks: range, dist_init: str,
                  log_level: str) -> list[multiprocessing.Process]:
    """One spawned worker process per global rank in ``ranks`` (daemons: they die with their parent)."""
    from workers.worker_process import worker_main

    ctx = multiprocessing.get_context("spawn")
    config_json, endpoints_json = msgspec.json.encode(config), msgspec.json.encode(endpoints)
    processes = [ctx.Process(target=worker_main, name=f"mini-deepinfer-worker{rank}", daemon=True,
                             args=(config_json, endpoints_json, rank, dist_init, log_level))
                 for rank in ranks]
    for process in processes:
        process.start()
    return processes


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, endpoints: Endpoints, log_level: str = "INFO"):
        if config.headless:
            raise ValueError("a headless node runs no engine core: it only starts its workers")
        self.layout = NodeLayout.of(config)
        self.num_ranks = config.dp_size
        if self.layout.multi_node:  # the step and result links go to the other nodes too
            endpoints = cluster_endpoints(config, endpoints)
        self.config, self.endpoints = config, endpoints
        self.context = zmq.Context()
        # over tcp, count peers that fail the CURVE handshake: the likely reason a node never joins
        self._handshake_failures = 0
        self._monitors: dict[zmq.Socket, zmq.Socket] = {}  # bound socket -> its monitor
        watch = self._watch_handshakes if self.layout.multi_node else None
        try:
            self.steps = endpoints.socket(self.context, zmq.PUB, endpoints.steps, bind=True, prepare=watch)
            self.results = endpoints.socket(self.context, zmq.PULL, endpoints.results, bind=True, prepare=watch)
        except zmq.ZMQError as exc:  # over tcp: a port in use, or --master-addr not an address of this host
            self.context.destroy(linger=0)
            raise OSError(f"the engine core cannot listen on {endpoints.steps} and {endpoints.results}: "
                          f"{exc}") from None
        self._drops = DropLog("engine core results")
        self._submitted: dict[int, float] = {}  # step id -> when it was sent
        self._newest_step: int | None = None  # the last plan sent: the workers hold its results until told
        self._stuck: set[int] = set()
        self._nonce = 0
        self._ping: tuple[int, float, set[int]] | None = None  # outstanding idle ping: nonce, sent at, answered
        self._last_ping = time.monotonic()
        dist_init = dist_init_method(config) if self.layout.multi_node else f"tcp://127.0.0.1:{_free_port()}"
        # the local processes, in the order of this node's ranks
        self.processes = start_workers(config, endpoints, self.layout.local_ranks, dist_init, log_level)
        self._buffered: dict[tuple[int, int], StepResult] = {}  # (step, rank) results that came early
        self._ready: set[int] = set()  # ranks that reported ready (and so read the step socket)
        try:
            self.info = self._handshake()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ startup
    def _handshake(self) -> WorkerInfo:
        joined: dict[int, str] = {}  # rank -> the host it runs on
        ready: dict[int, WorkerControl] = {}
        started = time.monotonic()
        deadline = started + WORKER_START_TIMEOUT_S
        while len(ready) < self.num_ranks:
            control = self._next_control("starting")
            if control is not None and control.command in ("joined", "ready"):
                if control.rank not in joined:  # ("joined" carries the worker's host name in device_name)
                    joined[control.rank] = control.device_name if control.command == "joined" else ""
                    self._log_joined(control.rank, joined)
                if control.command == "ready":
                    if control.error:
                        raise RuntimeError(f"worker {control.rank} failed to start: {control.error}")
                    ready[control.rank] = control
                    self._ready.add(control.rank)
            now = time.monotonic()
            if self.layout.multi_node and len(joined) < self.num_ranks and now - started > self.config.join_timeout:
                raise TimeoutError(self._join_timeout_message(joined))
            if now > deadline:
                raise TimeoutError(f"workers did not become ready within {WORKER_START_TIMEOUT_S:.0f} s; "
                                   "check the worker log lines above (model loading, memory)")
        # a SUB socket only receives what is published after its subscription reached us: ping
        # over the broadcast socket until every worker has answered one
        answered: set[int] = set()
        while len(answered) < self.num_ranks:
            self._nonce += 1  # idle pings continue the sequence: a late answer here never counts there
            send(self.steps, MessageType.CONTROL, WorkerControl("ping", nonce=self._nonce))
            poll_until = time.monotonic() + 0.1
            while time.monotonic() < poll_until and len(answered) < self.num_ranks:
                if self.results.poll(20):
                    message = self._recv()
                    if message is not None and message[0] is MessageType.CONTROL:
                        _raise_if_died(message[1])
                        if message[1].command == "pong":
                            answered.add(message[1].rank)
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not answer the broadcast ping")
        self._stop_watching_handshakes()
        first = next(iter(ready.values()))
        self.devices = [ready[rank].device_name for rank in sorted(ready)]  # for the startup summary
        self.kv_cache_dtype = first.kv_cache_dtype
        info = WorkerInfo(
            num_blocks=min(r.num_blocks for r in ready.values()),
            num_slots=min(r.num_slots for r in ready.values()),
            max_model_len=first.max_model_len, vocab_size=first.vocab_size, eos_token_id=first.eos_token_id)
        log.info("%d worker(s) ready: %d KV blocks and %d state slots per rank", len(ready), info.num_blocks - 1,
                 info.num_slots)
        return info

    def _next_control(self, phase: str) -> WorkerControl | None:
        """The next control message (None after 200 ms without one); raises if a worker died."""
        if self.results.poll(200):
            message = self._recv()
            if message is not None and message[0] is MessageType.CONTROL:
                _raise_if_died(message[1])
                return message[1]
        self._count_handshake_failures()
        self._check_alive(phase)
        return None

    def _log_joined(self, rank: int, joined: dict[int, str]) -> None:
        if not self.layout.multi_node:
            return
        if rank not in self.layout.local_ranks:
            log.info("rank %d (node %d) joined from %s", rank, self.layout.node_of(rank), joined[rank] or "?")
        if len(joined) == self.num_ranks:
            log.info("all %d ranks joined (%d nodes x %d); loading the model", self.num_ranks, self.layout.nnodes,
                     self.layout.ranks_per_node)

    def _join_timeout_message(self, joined: dict[int, str]) -> str:
        missing = [rank for rank in range(self.num_ranks) if rank not in joined]
        nodes = sorted({self.layout.node_of(rank) for rank in missing} - {0})
        config = self.config
        text = (f"{self.layout.describe_ranks(missing)} did not join within {config.join_timeout:g} s "
                f"(--join-timeout)")
        if nodes:
            text += (f"; start `serve --headless --nnodes {config.nnodes} --node-rank R --master-addr "
                     f"{config.master_addr} --master-port {config.master_port} --dp {config.dp_size}` on node(s) "
                     f"{', '.join(map(str, nodes))}, reaching this host on tcp ports {config.master_port} to "
                     f"{config.master_port + 2}")
        if self._handshake_failures:
            text += (f"; {self._handshake_failures} connection(s) failed the CURVE handshake: is "
                     "--cluster-key-file the same file on every node?")
        return text

    def _watch_handshakes(self, sock: zmq.Socket) -> None:
        self._monitors[sock] = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def _count_handshake_failures(self) -> None:
        for monitor in self._monitors.values():
            while monitor.poll(0):
                recv_monitor_message(monitor)
                self._handshake_failures += 1

    def _stop_watching_handshakes(self) -> None:
        for sock, monitor in self._monitors.items():
            sock.disable_monitor()
            monitor.close()
        self._monitors.clear()

    def _check_alive(self, phase: str) -> None:
        for rank, process in zip(self.layout.local_ranks, self.processes):
            if not process.is_alive():
                raise WorkerDiedError(f"worker {rank} exited (code {process.exitcode}) while {phase}")

    def _recv(self):
        """One message from the results socket, or None if it was malformed (dropped)."""
        message = parse(self.results.recv_multipart(copy=False), RESULT_TYPES, self._drops)
        if message is None:
            return None
        kind, body = message
        if not 0 <= body.rank < self.num_ranks:
            self._drops.drop(f"{kind.name} from unknown rank {body.rank}")
            return None
        return message

    def prepare_grammar(self, structured: StructuredOutput) -> None:
        send(self.steps, MessageType.CONTROL, WorkerControl("grammar", grammar=structured))

    # ------------------------------------------------------------------ steps
    def submit(self, plan: StepPlan) -> int:
        self._submitted[plan.step_id] = time.monotonic()
        send(self.steps, MessageType.STEP, plan)
        self._newest_step = plan.step_id
        return plan.step_id

    def collect(self, step_id: int) -> list[StepResult]:
        ranks = range(self.num_ranks)
        if step_id == self._newest_step:  # no later plan will push its results out of the workers
            send(self.steps, MessageType.CONTROL, WorkerControl("collect", nonce=step_id))
            self._newest_step = None
        submitted = self._submitted.pop(step_id, time.monotonic())
        waited_since = time.monotonic()
        while not all((step_id, r) in self._buffered for r in ranks):
            if not self.results.poll(100):
                self._check_alive("running a step")
                missing = [r for r in ranks if (step_id, r) not in self._buffered]
                if time.monotonic() - submitted > self.config.step_timeout:
                    self._declare_stuck(missing, f"step {step_id}", self.config.step_timeout)
                if time.monotonic() - waited_since > RESULT_WAIT_WARNING_S:
                    log.warning("step %d: still waiting for rank(s) %s after %.0f s", step_id, missing,
                                RESULT_WAIT_WARNING_S)
                    waited_since = time.monotonic()
                continue
            self._handle(self._recv())
        return [self._buffered.pop((step_id, r)) for r in ranks]

    def _handle(self, message) -> None:
        if message is None:
            return
        kind, body = message
        if kind is MessageType.STEP_RESULT:
            self._buffered[(body.step_id, body.rank)] = body
            return
        _raise_if_died(body)
        if body.command == "pong" and self._ping is not None and body.nonce == self._ping[0]:
            self._ping[2].add(body.rank)

    def _declare_stuck(self, ranks: list[int], what: str, timeout: float) -> None:
        self._stuck.update(ranks)
        log.error("%s: rank(s) %s did not answer within %.1f s; declaring them stuck", what, ranks, timeout)
        raise WorkerStuckError(f"worker rank(s) {ranks} stuck: {what} unanswered after {timeout:.1f} s")

    def check_health(self, idle: bool = False) -> None:
        """Raise if a worker is gone or stuck; while ``idle``, keep a ping in flight to prove liveness."""
        self._check_alive("serving")
        while self.results.poll(0):
            self._handle(self._recv())
        now = time.monotonic()
        if self._ping is not None:
            nonce, sent, answered = self._ping
            if len(answered) == self.num_ranks:
                self._ping = None
            elif now - sent > idle_ping_timeout(self.config.step_timeout):
                missing = [r for r in range(self.num_ranks) if r not in answered]
                self._declare_stuck(missing, f"idle ping {nonce}", idle_ping_timeout(self.config.step_timeout))
        if idle and self._ping is None and now - self._last_ping > IDLE_PING_INTERVAL_S:
            self._nonce += 1
            self._ping = (self._nonce, now, set())
            self._last_ping = now
            send(self.steps, MessageType.CONTROL, WorkerControl("ping", nonce=self._nonce))

    def shutdown(self) -> None:
        for rank, process in zip(self.layout.local_ranks, self.processes):
            if rank in self._stuck:  # a stopped or wedged process would not act on a request to exit
                process.kill()  # (another node's supervisor ends its own)
            elif rank not in self._ready and process.is_alive():  # still starting: it reads no request yet
                process.terminate()
        try:  # every node's workers get it; a headless node then exits
            send(self.steps, MessageType.CONTROL, WorkerControl("shutdown"))
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + SHUTDOWN_JOIN_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()  # SIGKILL: also ends a stopped process, which SIGTERM would not
                process.join(timeout=5)
        self._stop_watching_handshakes()
        # over tcp the other nodes' workers must still get the shutdown: let it leave before closing
        self.steps.close(linger=SHUTDOWN_LINGER_MS if self.layout.multi_node else 0)
        self.results.close()
        self.context.term()
