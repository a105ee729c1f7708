"""A worker process: one per device (or CPU rank). Receives every step plan, runs its DP rank's
part on its model shard and caches, and returns its sampled tokens.

Startup: set up torch.distributed when there are several ranks (experts are sharded over them),
load the model, size and allocate the caches, then report ``ready`` with the cache geometry.
The worker exits when the engine core asks, or when its parent process is gone (then it also
removes the socket directory, since nothing above it may be left to do so). A malformed message
on the step socket is dropped (``ipc.parse``), never fatal; so is a plan without this rank's part.
"""

from __future__ import annotations

import logging
import os
import traceback

import msgspec
import zmq

from engine_core.config import EngineConfig
from engine_core.ipc import DropLog, Endpoints, parse, send
from engine_core.log_setup import configure_logging, worker_process_name
from engine_core.protocol import MessageType, StepPlan, StepResult, WorkerControl

from .memory import MallocTrimmer

log = logging.getLogger(__name__)
PARENT_CHECK_INTERVAL_MS = 1000
STEP_TYPES = {MessageType.STEP: StepPlan, MessageType.CONTROL: WorkerControl}


def _init_distributed(config: EngineConfig, rank: int, dist_port: int):
    import torch
    import torch.distributed as dist

    if config.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if config.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=config.dp_size)


def worker_main(config_json: bytes, endpoints_json: bytes, rank: int, dist_port: int, log_level: str) -> None:
    configure_logging(log_level, worker_process_name(rank))
    config = msgspec.json.decode(config_json, type=EngineConfig)
    endpoints = msgspec.json.decode(endpoints_json, type=Endpoints)
    parent = os.getppid()
    context = zmq.Context()
    steps = endpoints.socket(context, zmq.SUB, endpoints.steps, bind=False)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    results = endpoints.socket(context, zmq.PUSH, endpoints.results, bind=False)
    try:
        runner = _build_runner(config, rank, dist_port)
    except Exception as exc:  # report why, so the engine can tell the user (the frontend logs it once)
        # a bad file or too little memory needs no traceback (DEBUG shows it); anything else is likely a bug
        expected = isinstance(exc, (ValueError, OSError, RuntimeError)) and str(exc)
        reason = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        send(results, MessageType.CONTROL, WorkerControl("ready", rank, error=reason))
        log.log(logging.DEBUG if expected else logging.ERROR, "worker %d failed to start", rank, exc_info=True)
        return
    cap = runner.capacity
    send(results, MessageType.CONTROL, WorkerControl(
        "ready", rank, num_blocks=cap.num_blocks, num_slots=cap.num_slots, max_model_len=cap.max_model_len,
        vocab_size=runner.cfg.vocab_size, eos_token_id=runner.cfg.eos_token_id,
        device_name=describe_device(runner.device, config), kv_cache_dtype=_dtype_name(runner.cache.window[0].dtype)))
    poller = zmq.Poller()
    poller.register(steps, zmq.POLLIN)
    drops = DropLog(f"worker {rank} steps")
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
            if not handle_message(steps.recv_multipart(copy=False), runner, rank, results, drops):
                return
            trimmer.busy()
    finally:
        steps.close()
        results.close()
        context.term()


def describe_device(device, config: EngineConfig) -> str:
    """The device a worker runs on, as the startup summary shows it."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} {props.name} ({props.total_memory / 2**30:.1f} GiB)"
    threads = config.cpu_threads
    return f"cpu ({threads} thread{'s' if threads != 1 else ''})"


def _dtype_name(dtype) -> str:
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}.get(str(dtype), str(dtype))


def _build_runner(config: EngineConfig, rank: int, dist_port: int):
    from .model_runner import ModelRunner

    if config.dp_size == 1:
        return ModelRunner(config, rank)
    from .expert_parallel import ExpertParallelDispatcher

    _init_distributed(config, rank, dist_port)
    from model.config import V41Config

    cfg = V41Config.from_pretrained(config.model)
    dispatcher = ExpertParallelDispatcher.for_engine(
        rank, config.dp_size, cfg.num_routed_experts, cfg.num_experts_per_token, config.max_num_seqs,
        config.max_num_batched_tokens, config.expert_capacity_factor)
    return ModelRunner(config, rank, dispatcher)


def handle_message(frames: list, runner, rank: int, results, drops: DropLog) -> bool:
    """Act on one message from the step socket; False when asked to shut down."""
    message = parse(frames, STEP_TYPES, drops)
    if message is None:
        return True
    kind, body = message
    if kind is MessageType.STEP:
        if not 0 <= rank < len(body.ranks):
            drops.drop(f"step {body.step_id} has {len(body.ranks)} rank batch(es), none for rank {rank}")
            return True
        send(results, MessageType.STEP_RESULT, _run_step(runner, body, rank))
    elif body.command == "shutdown":
        return False
    elif body.command == "ping":
        send(results, MessageType.CONTROL, WorkerControl("pong", rank, nonce=body.nonce))
    elif body.command == "grammar" and body.grammar is not None:
        _prepare_grammar(runner, body.grammar)
    return True


def _prepare_grammar(runner, structured) -> None:
    """Start compiling in the background; a step that needs it takes the result (or the error)."""
    try:
        runner.structured.cache.submit(structured)
    except Exception:  # an unreadable tokenizer: the engine core fails the request itself
        log.exception("cannot prepare a grammar")


def _run_step(runner, plan: StepPlan, rank: int) -> StepResult:
    try:
        if runner.expert_parallel is not None:
            # every rank sees the whole plan, so all announce the same size without talking: the
            # MoE exchanges of this step shrink to the busiest rank's tokens
            runner.expert_parallel.set_step_tokens(max(sum(len(s.token_ids) for s in batch.sequences)
                                                       for batch in plan.ranks))
        return runner.collect(runner.execute(plan.step_id, plan.ranks[rank], plan.released_seq_ids))
    except Exception:
        log.exception("step %d failed", plan.step_id)
        return StepResult(plan.step_id, rank, [], error=traceback.format_exc(limit=8))
