"""A worker process: one per device (or CPU rank). Receives every step plan, runs its DP rank's
part on its model shard and caches, and returns its sampled tokens (on a GPU, one step behind the
plans it has launched: workers.step_pipeline).

Startup: report ``joined`` (with the host name) as soon as the links to the engine core are open,
set up torch.distributed when there are several ranks (experts are sharded over them), load the
model, size and allocate the caches, then report ``ready`` with the cache geometry. The worker's
parent is the engine core, or on another node the headless supervisor (engine_core/headless.py);
the worker exits when the engine core asks, or when its parent process is gone (then it also
removes the socket directory, since nothing above it may be left to do so). A malformed message
on the step socket is dropped (``ipc.parse``), never fatal; so is a plan without this rank's part.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import socket
import sys

import msgspec
import zmq

from engine_core.cluster import NodeLayout
from engine_core.config import EngineConfig
from engine_core.ipc import DropLog, Endpoints, parse, send
from engine_core.log_setup import configure_logging, worker_process_name
from engine_core.protocol import MessageType, StepPlan, WorkerControl

from .memory import MallocTrimmer
from .step_pipeline import StepPipeline

log = logging.getLogger(__name__)
PARENT_CHECK_INTERVAL_MS = 1000
STEP_TYPES = {MessageType.STEP: StepPlan, MessageType.CONTROL: WorkerControl}
FAILURE_REPORT_LINGER_MS = 5000  # a startup error must reach the engine core, even over a slow link
PR_SET_PDEATHSIG = 1  # prctl(2)
STARTUP_FAILED_EXIT_CODE = 3  # "could not start, and the engine core was told why" (for a headless supervisor)


def _init_distributed(config: EngineConfig, rank: int, dist_init_method: str):
    import torch
    import torch.distributed as dist

    if config.device == "cuda":
        torch.cuda.set_device(NodeLayout.of(config).local_rank(rank))
    backend = "nccl" if config.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=dist_init_method, rank=rank, world_size=config.dp_size)


def worker_main(config_json: bytes, endpoints_json: bytes, rank: int, dist_init_method: str, log_level: str) -> None:
    """``rank``: the global DP rank; ``dist_init_method``: torch.distributed's rendezvous (``tcp://host:port``)."""
    configure_logging(log_level, worker_process_name(rank))
    config = msgspec.json.decode(config_json, type=EngineConfig)
    endpoints = msgspec.json.decode(endpoints_json, type=Endpoints)
    parent = os.getppid()
    if config.headless:
        _die_with_parent(parent)
    context = zmq.Context()
    steps = endpoints.socket(context, zmq.SUB, endpoints.steps, bind=False)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    results = endpoints.socket(context, zmq.PUSH, endpoints.results, bind=False)
    send(results, MessageType.CONTROL, WorkerControl("joined", rank, device_name=socket.gethostname()))
    try:
        runner = _build_runner(config, rank, dist_init_method)
    except Exception as exc:  # report why, so the engine can tell the user (the frontend logs it once)
        # a bad file or too little memory needs no traceback (DEBUG shows it); anything else is likely a bug
        expected = isinstance(exc, (ValueError, OSError, RuntimeError)) and str(exc)
        reason = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        send(results, MessageType.CONTROL, WorkerControl("ready", rank, error=reason))
        log.log(logging.DEBUG if expected else logging.ERROR, "worker %d failed to start", rank, exc_info=True)
        if expected and config.headless:  # node 0 says why; so does this node's own log
            log.error("worker %d failed to start: %s", rank, reason)
        results.close(linger=FAILURE_REPORT_LINGER_MS)
        sys.exit(STARTUP_FAILED_EXIT_CODE)
    cap = runner.capacity
    send(results, MessageType.CONTROL, WorkerControl(
        "ready", rank, num_blocks=cap.num_blocks, num_slots=cap.num_slots, max_model_len=cap.max_model_len,
        vocab_size=runner.cfg.vocab_size, eos_token_id=runner.cfg.eos_token_id,
        device_name=describe_device(runner.device, config), kv_cache_dtype=runner.cache.storage_summary()))
    # Everything alive now (the model, its caches, the compiled kernels) lives as long as the worker:
    # take it out of the collector's full passes. Measured on a CPU worker of the tiny model: ~172 k
    # objects, a full pass 73-80 ms (a step stalls that long), under 1 ms once they are frozen.
    gc.collect()
    gc.freeze()
    poller = zmq.Poller()
    poller.register(steps, zmq.POLLIN)
    drops = DropLog(f"worker {rank} steps")
    pipeline = StepPipeline(runner, rank, results, one_ahead=runner.device.type == "cuda")
    trimmer = MallocTrimmer()  # gives the heap's free pages back once the worker is idle
    try:
        while True:
            if not poller.poll(PARENT_CHECK_INTERVAL_MS):
                trimmer.idle()
                if os.getppid() != parent:
                    log.warning("engine core is gone; worker %d exits", rank)
                    endpoints.cleanup()
                    return
                continue
            if not handle_message(steps.recv_multipart(copy=False), pipeline, drops):
                return
            trimmer.busy()
    finally:
        steps.close()
        results.close()
        context.term()


def _die_with_parent(parent: int) -> None:
    """On a headless node: end with the supervisor, even while blocked in the torch.distributed
    rendezvous or a collective, where the parent check of the step loop cannot run (Linux; the
    supervisor starts its workers from its main thread, which lives as long as it does)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the step loop's parent check remains
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def describe_device(device, config: EngineConfig) -> str:
    """The device a worker runs on, as the startup summary shows it."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{device} {props.name} ({props.total_memory / 2**30:.1f} GiB)"
    else:
        threads = config.cpu_threads
        name = f"cpu ({threads} thread{'s' if threads != 1 else ''})"
    return f"{name} on {socket.gethostname()}" if config.nnodes > 1 else name



def _build_runner(config: EngineConfig, rank: int, dist_init_method: str):
    from .model_runner import ModelRunner

    if config.dp_size == 1:
        return ModelRunner(config, rank)
    from .expert_parallel import ExpertParallelDispatcher

    _init_distributed(config, rank, dist_init_method)
    if config.nnodes > 1:  # each node resolved its own flags: all must agree before any exchange
        from .rank_agreement import check_ranks_agree

        check_ranks_agree(config, rank)
    dispatcher = ExpertParallelDispatcher.for_config(rank, config, config.model_config())
    return ModelRunner(config, rank, dispatcher)


def handle_message(frames: list, pipeline: StepPipeline, drops: DropLog) -> bool:
    """Act on one message from the step socket; False when asked to shut down."""
    message = parse(frames, STEP_TYPES, drops)
    if message is None:
        return True
    kind, body = message
    rank = pipeline.rank
    if kind is MessageType.STEP:
        if not 0 <= rank < len(body.ranks):
            drops.drop(f"step {body.step_id} has {len(body.ranks)} rank batch(es), none for rank {rank}")
            return True
        pipeline.run(body)
    elif body.command == "collect":
        pipeline.flush()
    elif body.command == "shutdown":
        return False
    elif body.command == "ping":
        send(pipeline.results, MessageType.CONTROL, WorkerControl("pong", rank, nonce=body.nonce))
    elif body.command == "grammar" and body.grammar is not None:
        _prepare_grammar(pipeline.runner, body.grammar)
    return True


def _prepare_grammar(runner, structured) -> None:
    """Start compiling in the background; a step that needs it takes the result (or the error)."""
    try:
        runner.structured.cache.submit(structured)
    except Exception:  # an unreadable tokenizer: the engine core fails the request itself
        log.exception("cannot prepare a grammar")
