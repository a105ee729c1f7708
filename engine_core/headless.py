"""A headless node (``serve --headless --node-rank R``, R > 0): this node's share of the DP ranks
and a supervisor over them, with no frontend and no engine core.

The node runs ``dp / nnodes`` worker processes, global ranks ``R * dp/nnodes`` and up (layout and
ports: engine_core/cluster.py). They connect to the engine core on node 0 over tcp and join
torch.distributed there; it does not matter which node starts first. This process supervises them
and watches the engine core:

* a worker that exits while the engine core still needs it is reported to the engine core at once
  (``WorkerControl("died")`` on the results link). The engine core treats it as the death of a
  local worker: every request ends with an error, ``/health`` turns 503 and the server exits
  non-zero. The node stops its other workers and exits 1.
* the engine core's ``shutdown`` (the server stopping) ends the workers; the node exits 0 once
  they are gone.
* the engine core disappearing (its connection closed, or silent past the ZMQ heartbeat timeout,
  when node 0 is cut off) stops the workers: the node exits 1.
* SIGTERM or SIGINT stops the workers, tells the engine core (which cannot run without them) and
  exits 0.
* node 0 refusing the CURVE handshake (another cluster key) stops the workers: the node exits 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from workers.worker_process import STARTUP_FAILED_EXIT_CODE

from .cluster import NodeLayout, cluster_endpoints, dist_init_method
from .config import EngineConfig
from .ipc import DropLog, Endpoints, parse, send
from .mp_executor import start_workers
from .protocol import MessageType, WorkerControl

log = logging.getLogger(__name__)
POLL_MS = 200
HEARTBEAT_IVL_MS = 2000  # ZMTP pings on the link to node 0, so a silent node 0 counts as gone...
HEARTBEAT_TIMEOUT_MS = 20000  # ...after this long without an answer (well above a loaded host's pauses)
ENGINE_GONE_GRACE_S = 5.0  # after node 0 went away: time for the workers to act on a shutdown that came first
EARLY_EXIT_REPORT_DELAY_S = 2.0  # a worker that could not start reports why itself: that report goes first
STOP_WORKERS_S = 5.0
WAITING_LOG_INTERVAL_S = 30.0
LINK_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class HeadlessNode:
    def __init__(self, config: EngineConfig, log_level: str):
        self.config, self.log_level = config, log_level
        self.layout = NodeLayout.of(config)
        self.host = socket.gethostname()
        self.endpoints: Endpoints = cluster_endpoints(config)
        self.context = zmq.Context()
        self.monitor: zmq.Socket | None = None
        # control messages of the broadcast link only (the PUB filters by the first frame): the
        # supervisor must see "shutdown" but has no use for the step plans
        self.control = self.endpoints.socket(self.context, zmq.SUB, self.endpoints.steps, bind=False,
                                             prepare=self._prepare_control)
        self.report = self.endpoints.socket(self.context, zmq.PUSH, self.endpoints.results, bind=False)
        self.processes: list[multiprocessing.Process] = []
        self.connected = False
        self.handshake_failed = False
        self.shutdown_requested = False
        self.engine_gone_at: float | None = None
        self.early_exit_at: float | None = None  # when a worker that could not start exited
        self.signalled: str | None = None
        self._drops = DropLog(f"node {config.node_rank} control")

    def _prepare_control(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.SUBSCRIBE, MessageType.CONTROL.value)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.monitor = sock.get_monitor_socket(LINK_EVENTS)

    # ------------------------------------------------------------------ the supervisor loop
    def run(self) -> int:
        config, ranks = self.config, self.layout.local_ranks
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.processes = start_workers(config, self.endpoints, ranks, dist_init_method(config), self.log_level)
        log.info("node %d of %d on %s: started ranks %d-%d (pids %s); engine core at %s (ports %d, %d), "
                 "torch.distributed rendezvous at %s", config.node_rank, config.nnodes, self.host, ranks.start,
                 ranks.stop - 1, ", ".join(str(p.pid) for p in self.processes), config.master_addr,
                 config.master_port + 1, config.master_port + 2, dist_init_method(config))
        waiting_logged = time.monotonic()
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(POLL_MS))
                if self.monitor in events:
                    self._link_events()
                if self.handshake_failed:  # retrying cannot help: the keys or the peer are wrong
                    log.error("node %d: %s refused the CURVE handshake: --cluster-key-file must hold the same "
                              "secret as node 0's; stopping the workers", config.node_rank, self.endpoints.steps)
                    return 1
                if self.control in events:
                    self._control_messages()
                if self.signalled is not None:
                    log.warning("node %d: %s; stopping its workers", config.node_rank, self.signalled)
                    self._report(ranks.start, f"node {config.node_rank} ({self.host}) was stopped ({self.signalled}), "
                                              f"and {self.layout.describe_ranks(ranks)} with it")
                    return 0
                code = self._check_workers()
                if code is not None:
                    return code
                if self.engine_gone_at is not None and time.monotonic() - self.engine_gone_at > ENGINE_GONE_GRACE_S:
                    log.error("node %d: the engine core at %s is gone; stopping the workers", config.node_rank,
                              config.master_addr)
                    return 1
                if not self.connected and time.monotonic() - waiting_logged > WAITING_LOG_INTERVAL_S:
                    waiting_logged = time.monotonic()
                    log.info("node %d: waiting for the engine core at %s:%d", config.node_rank, config.master_addr,
                             config.master_port + 1)
        finally:
            self._stop_workers()
            self.control.disable_monitor()
            self.monitor.close()
            self.control.close()
            self.report.close(linger=int(STOP_WORKERS_S * 1000))  # a death report must leave before we do
            self.context.term()

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signal.Signals(signum).name

    def _link_events(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.engine_gone_at is None:
                # (after a disconnect, the engine core these workers served is gone for good)
                self.connected = True
                log.info("node %d: connected to the engine core at %s", self.config.node_rank,
                         self.endpoints.steps)
            elif event in HANDSHAKE_FAILED:
                self.handshake_failed = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self.engine_gone_at = time.monotonic()
                log.info("node %d: the engine core closed its connection", self.config.node_rank)

    def _control_messages(self) -> None:
        while self.control.poll(0):
            message = parse(self.control.recv_multipart(copy=False), {MessageType.CONTROL: WorkerControl},
                            self._drops)
            if message is not None and message[1].command == "shutdown":
                if not self.shutdown_requested:
                    log.info("node %d: the engine core is shutting down", self.config.node_rank)
                self.shutdown_requested = True

    def _check_workers(self) -> int | None:
        """The node's exit code once it should end because of its workers, else None."""
        exited = [(rank, p) for rank, p in zip(self.layout.local_ranks, self.processes) if not p.is_alive()]
        if not exited:
            return None
        if self.shutdown_requested or self.engine_gone_at is not None:
            if len(exited) < len(self.processes):
                return None  # the others are on their way out
            clean = self.shutdown_requested and all(p.exitcode == 0 for _, p in exited)
            log.info("node %d: all workers exited; %s", self.config.node_rank,
                     "the engine core shut down" if self.shutdown_requested else "the engine core is gone")
            return 0 if clean else 1
        rank, process = exited[0]
        if process.exitcode == STARTUP_FAILED_EXIT_CODE:
            # it has sent the engine core the reason, and the engine core will shut every node down:
            # report only if that does not happen (our report would race with the better reason)
            if self.early_exit_at is None:
                self.early_exit_at = time.monotonic()
            if time.monotonic() - self.early_exit_at < EARLY_EXIT_REPORT_DELAY_S:
                return None
        reason = f"worker {rank} on node {self.config.node_rank} ({self.host}) exited (code {process.exitcode})"
        log.error("%s; telling the engine core and stopping the node", reason)
        self._report(rank, reason)
        return 1

    def _report(self, rank: int, reason: str) -> None:
        send(self.report, MessageType.CONTROL, WorkerControl("died", rank, error=reason))

    def _stop_workers(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + STOP_WORKERS_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()  # SIGKILL also ends a worker blocked in a collective or stopped
                process.join(timeout=5)


def run_headless(config: EngineConfig, log_level: str) -> int:
    """``serve --headless``: run this node's workers until the engine core ends them; the exit code."""
    return HeadlessNode(config, log_level).run()
