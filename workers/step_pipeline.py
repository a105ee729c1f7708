"""A worker's steps, launched one ahead of their results.

The engine core sends plan N+1 before it waits for step N (zero-overhead scheduling), so when plan
N+1 arrives the worker launches it first and only then waits for step N's results and sends them:
the device starts step N+1 as soon as it finishes step N, while the hosts return step N's tokens,
update the scheduler and plan step N+2. Waiting first would leave the device idle for all of that.

When the engine core waits for the newest step it sent (nothing more to plan yet, or ``--no-zos``),
no next plan will come to push it out: it sends ``collect`` and the worker sends what it holds.
Results always leave in step order, a failed launch's error after its predecessor's results.

Only where launching is asynchronous (CUDA). On a CPU worker ``execute`` computes the whole step
before it returns, so holding its results back would delay them by a step and leave the worker
idle while the engine core plans: there each step's results are sent as soon as it is launched.
"""

from __future__ import annotations

import logging
import traceback

from engine_core.ipc import send
from engine_core.protocol import MessageType, StepPlan, StepResult

log = logging.getLogger(__name__)


class StepPipeline:
    """Holds at most one launched step whose results have not been sent."""

    def __init__(self, runner, rank: int, results, one_ahead: bool):
        """``runner``: the worker's ``ModelRunner``; ``results``: the socket results are sent on;
        ``one_ahead``: hold a step's results until the next step is launched (asynchronous launches)."""
        self.runner, self.rank, self.results, self.one_ahead = runner, rank, results, one_ahead
        self._pending = None  # (step id, the runner's PendingStep)

    def run(self, plan: StepPlan) -> None:
        """Launch ``plan``'s part of this rank, then send the previous step's results."""
        previous, self._pending = self._pending, None
        try:
            launched = self._launch(plan)
        except Exception:
            log.exception("step %d failed", plan.step_id)
            self._send_results(previous)
            send(self.results, MessageType.STEP_RESULT,
                 StepResult(plan.step_id, self.rank, [], error=traceback.format_exc(limit=8)))
            return
        self._send_results(previous)
        self._pending = (plan.step_id, launched)
        if not self.one_ahead:
            self.flush()

    def flush(self) -> None:
        """Send the results of the step held, if any (the engine core is waiting for them)."""
        pending, self._pending = self._pending, None
        self._send_results(pending)

    def _launch(self, plan: StepPlan):
        runner, shape = self.runner, None
        if runner.expert_parallel is not None:
            from .cuda_graphs import StepShape  # here: the worker's message loop imports no torch
            # every rank sees the whole plan, so all announce the same size without talking: the
            # MoE exchanges of this step shrink to the busiest rank's tokens; and all decide alike
            # whether the step replays a CUDA graph, and which one
            runner.expert_parallel.set_step_tokens(max(sum(len(s.token_ids) for s in batch.sequences)
                                                       for batch in plan.ranks))
            shape = StepShape.of([batch.sequences for batch in plan.ranks])
        return runner.execute(plan.step_id, plan.ranks[self.rank], plan.released_seq_ids, shape)

    def _send_results(self, pending) -> None:
        if pending is None:
            return
        step_id, launched = pending
        try:
            result = self.runner.collect(launched)
        except Exception:
            log.exception("step %d failed", step_id)
            result = StepResult(step_id, self.rank, [], error=traceback.format_exc(limit=8))
        send(self.results, MessageType.STEP_RESULT, result)
