"""A worker process: one per device (or CPU rank). Receives every step plan, runs its DP rank's
part on its model shard and caches, and returns its sampled tokens.

Startup: set up torch.distributed when there are several ranks (experts are sharded over them),
load the model, size and allocate the caches, then report ``ready`` with the cache geometry.
The worker exits when the engine core asks, or when its parent process is gone.
"""

from __future__ import annotations

import logging
import os
import traceback

import msgspec
import zmq

from engine_core.config import EngineConfig
from engine_core.ipc import Endpoints, decode_as, make_socket, send, split
from engine_core.protocol import MessageType, StepPlan, StepResult, WorkerControl

log = logging.getLogger(__name__)
PARENT_CHECK_INTERVAL_MS = 1000


def _init_distributed(config: EngineConfig, rank: int, dist_port: int):
    import torch
    import torch.distributed as dist

    if config.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if config.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=config.dp_size)


def worker_main(config_json: bytes, endpoints_json: bytes, rank: int, dist_port: int, log_level: str) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s worker{rank} %(name)s: %(message)s")
    config = msgspec.json.decode(config_json, type=EngineConfig)
    endpoints = msgspec.json.decode(endpoints_json, type=Endpoints)
    parent = os.getppid()
    context = zmq.Context()
    steps = make_socket(context, zmq.SUB, endpoints.steps, bind=False)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    results = make_socket(context, zmq.PUSH, endpoints.results, bind=False)
    try:
        runner = _build_runner(config, rank, dist_port)
    except Exception as exc:  # report why, so the engine can tell the user
        send(results, MessageType.CONTROL, WorkerControl("ready", rank, error=f"{type(exc).__name__}: {exc}"))
        log.exception("worker %d failed to start", rank)
        return
    cap = runner.capacity
    send(results, MessageType.CONTROL, WorkerControl(
        "ready", rank, num_blocks=cap.num_blocks, num_slots=cap.num_slots, max_model_len=cap.max_model_len,
        vocab_size=runner.cfg.vocab_size, eos_token_id=runner.cfg.eos_token_id))
    poller = zmq.Poller()
    poller.register(steps, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(PARENT_CHECK_INTERVAL_MS):
                if os.getppid() != parent:
                    log.warning("engine core is gone; worker %d exits", rank)
                    return
                continue
            kind, payload = split(steps.recv_multipart(copy=False))
            if kind is MessageType.STEP:
                plan = decode_as(payload, StepPlan)
                send(results, MessageType.STEP_RESULT, _run_step(runner, plan, rank))
            elif kind is MessageType.CONTROL:
                control = decode_as(payload, WorkerControl)
                if control.command == "shutdown":
                    return
                if control.command == "ping":
                    send(results, MessageType.CONTROL, WorkerControl("pong", rank, nonce=control.nonce))
    finally:
        steps.close()
        results.close()
        context.term()


def _build_runner(config: EngineConfig, rank: int, dist_port: int):
    from .model_runner import ModelRunner

    if config.dp_size == 1:
        return ModelRunner(config, rank)
    from .expert_parallel import ExpertParallelDispatcher

    _init_distributed(config, rank, dist_port)
    from model.config import V41Config

    experts = V41Config.from_pretrained(config.model).num_routed_experts
    return ModelRunner(config, rank, ExpertParallelDispatcher(rank, config.dp_size, experts))


def _run_step(runner, plan: StepPlan, rank: int) -> StepResult:
    try:
        return runner.collect(runner.execute(plan.step_id, plan.ranks[rank]))
    except Exception:
        log.exception("step %d failed", plan.step_id)
        return StepResult(plan.step_id, rank, [], error=traceback.format_exc(limit=8))
