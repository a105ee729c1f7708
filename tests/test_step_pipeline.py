"""A worker launches step N+1 before it sends step N's results (workers/step_pipeline.py): the
order of launches, collects and sent results, with a runner that records its calls and real
ZeroMQ sockets, and when the engine core sends ``collect``; ``--no-zos`` with real worker processes
in tests/test_offline_dp.py."""

from __future__ import annotations

import msgspec

from engine_core.mp_executor import MultiprocExecutor
from engine_core.protocol import MessageType, RankBatch, StepPlan, StepResult, WorkerControl
from workers.step_pipeline import StepPipeline


class RecordingRunner:
    """Stands in for the ModelRunner: records the order of its calls; a step id in ``fail`` fails to launch."""

    expert_parallel = None

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def execute(self, step_id, work, released, shape):
        self.calls.append(("execute", step_id))
        if step_id in self.fail:
            raise RuntimeError(f"launch {step_id} failed")
        return step_id

    def collect(self, pending):
        self.calls.append(("collect", pending))
        return StepResult(pending, 0, [])


def _sent(pull) -> list[tuple[int, bool]]:
    """(step id, failed) of every result sent so far."""
    out = []
    while pull.poll(200):
        kind, payload = pull.recv_multipart()
        assert kind == MessageType.STEP_RESULT.value
        result = msgspec.msgpack.decode(payload, type=StepResult)
        out.append((result.step_id, bool(result.error)))
    return out


def _plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, False, [RankBatch([])])


def test_results_leave_one_step_behind_the_launches(push_pull):
    push, pull = push_pull
    runner = RecordingRunner()
    pipeline = StepPipeline(runner, 0, push, one_ahead=True)
    pipeline.run(_plan(1))
    assert _sent(pull) == [] and runner.calls == [("execute", 1)]
    pipeline.run(_plan(2))
    assert runner.calls[1:] == [("execute", 2), ("collect", 1)]  # step 2 launched before step 1 is waited for
    assert _sent(pull) == [(1, False)]
    pipeline.flush()  # the engine waits for the newest step: nothing else will push it out
    assert _sent(pull) == [(2, False)]
    pipeline.flush()  # nothing held: nothing sent
    assert _sent(pull) == [] and runner.calls[-1] == ("collect", 2)


def test_a_failed_launch_reports_after_its_predecessor(push_pull):
    push, pull = push_pull
    pipeline = StepPipeline(RecordingRunner(fail={4}), 0, push, one_ahead=True)
    pipeline.run(_plan(3))
    pipeline.run(_plan(4))
    assert _sent(pull) == [(3, False), (4, True)]
    pipeline.flush()  # the failed step is not held
    assert _sent(pull) == []


def test_without_asynchronous_launches_results_leave_at_once(push_pull):
    """A CPU worker's launch computes the step: its results are sent before the next plan is read."""
    push, pull = push_pull
    runner = RecordingRunner()
    pipeline = StepPipeline(runner, 0, push, one_ahead=False)
    pipeline.run(_plan(1))
    assert _sent(pull) == [(1, False)]
    pipeline.run(_plan(2))
    assert _sent(pull) == [(2, False)]
    assert runner.calls == [("execute", 1), ("collect", 1), ("execute", 2), ("collect", 2)]
    pipeline.flush()  # the engine's "collect": nothing held
    assert _sent(pull) == []


def test_the_engine_core_sends_collect_only_when_no_later_plan_was_sent(push_pull):
    """In ZOS order (plan 2 sent, then step 1 collected) plan 2 pushes step 1's results out of the
    workers; step 2, the newest, needs a ``collect``."""
    push, pull = push_pull
    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # its step link only: no worker is started
    executor.steps, executor.num_ranks = push, 1
    executor._submitted, executor._newest_step, executor._buffered = {}, None, {}
    for step_id in (1, 2):
        executor.submit(_plan(step_id))
        executor._buffered[(step_id, 0)] = StepResult(step_id, 0, [])  # as if already answered

    def sent() -> list[tuple[bytes, object]]:
        out = []
        while pull.poll(200):
            kind, payload = pull.recv_multipart()
            body = msgspec.msgpack.decode(payload, type=StepPlan if kind == MessageType.STEP.value else WorkerControl)
            out.append((kind, body.step_id if kind == MessageType.STEP.value else (body.command, body.nonce)))
        return out

    assert sent() == [(MessageType.STEP.value, 1), (MessageType.STEP.value, 2)]
    executor.collect(1)
    assert sent() == []
    executor.collect(2)
    assert sent() == [(MessageType.CONTROL.value, ("collect", 2))]
