"""How the engine core reaches its workers: ``submit`` a step plan, later ``collect`` its results.

``submit`` must return as soon as the step is launched, so that the core can plan the next step
while this one runs (zero-overhead scheduling); ``collect`` blocks until the step's results (one
``StepResult`` per DP rank) are on the CPU. Steps are executed in submission order.

``InProcessExecutor`` runs one worker in the engine's own process (the offline ``LLM`` with one
rank, tests); ``engine_core.mp_executor.MultiprocExecutor`` runs one worker process per DP rank
(``serve``, ``generate``, and the offline ``LLM`` with ``dp_size`` > 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from .config import EngineConfig
from .protocol import StepPlan, StepResult, StructuredOutput


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core learns from the workers at startup."""

    num_blocks: int  # per rank, including the padding block 0
    num_slots: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None


class Executor(ABC):
    info: WorkerInfo

    @abstractmethod
    def submit(self, plan: StepPlan) -> Any: ...

    @abstractmethod
    def collect(self, handle: Any) -> list[StepResult]: ...

    def shutdown(self) -> None:
        pass

    def check_health(self, idle: bool = False) -> None:
        """Raise if a worker is gone or stuck (``idle``: no step is in flight, so probing is cheap)."""

    def prepare_grammar(self, structured: StructuredOutput) -> None:
        """Let the workers compile a grammar in the background while its request waits for the
        engine core's own compile, so that no step compiles one (in-process: one shared cache)."""


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if config.dp_size != 1:
            raise ValueError("the in-process executor runs a single rank; use the multiprocess executor for --dp > 1")
        from workers.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        cfg, cap = self.runner.cfg, self.runner.capacity
        self.info = WorkerInfo(cap.num_blocks, cap.num_slots, cap.max_model_len, cfg.vocab_size, cfg.eos_token_id)

    def submit(self, plan: StepPlan):
        return self.runner.execute(plan.step_id, plan.ranks[0], plan.released_seq_ids)

    def collect(self, handle) -> list[StepResult]:
        return [self.runner.collect(handle)]
