"""Engine-level accounting with the real tiny model on CPU: every KV block and state slot is free
again after requests finish or are aborted (waiting, mid-prefill, mid-decode, with a step in
flight), aborts are idempotent and do not disturb the other requests, and invalid requests are
refused without leaving anything behind."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.executor import InProcessExecutor
from engine_core.protocol import AddRequest, SamplingParams
from frontend.llm import LLM

ENGINE = dict(block_size=16, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)


def make_engine(checkpoint, **overrides) -> EngineCore:
    cfg = EngineConfig(model=str(checkpoint), **{**ENGINE, **overrides})
    return EngineCore(cfg, InProcessExecutor(cfg))


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 53 + j * 29) % 1000 for j in range(n)]


REQUESTS = {
    "greedy": (prompt(1, 10), SamplingParams(temperature=0.0, max_tokens=10)),
    "sampled": (prompt(2, 45), SamplingParams(temperature=0.9, top_k=30, seed=5, max_tokens=12)),
    "long": (prompt(3, 100), SamplingParams(temperature=0.8, seed=6, max_tokens=8)),
    "penalised": (prompt(4, 20), SamplingParams(temperature=0.7, seed=8, repetition_penalty=1.2,
                                                 presence_penalty=0.3, max_tokens=14)),
}


class Collector:
    def __init__(self, core: EngineCore):
        self.core = core
        self.outputs = defaultdict(list)

    def add(self, request_id: str) -> None:
        ids, params = REQUESTS[request_id]
        self.core.add_request(AddRequest(request_id, list(ids), params))

    def step(self) -> None:
        for out in self.core.step():
            self.outputs[out.request_id].append(out)

    def run(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not self.core.has_work:
                return
            self.step()
        raise AssertionError(f"engine still busy after {max_steps} steps: {self.core.stats()}")

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs[request_id] for t in out.new_token_ids]

    def finishes(self, request_id: str) -> list[str]:
        return [out.finish_reason for out in self.outputs[request_id] if out.finish_reason]


def assert_engine_idle_and_free(core: EngineCore) -> None:
    stats = core.stats()
    assert not core.has_work
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0, stats
    for rank in core.scheduler.ranks:
        assert not any(rank.blocks._refcount) and not any(rank.slots._refcount)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Every request run to completion, all together, nothing aborted."""
    core = make_engine(tiny_checkpoint)
    c = Collector(core)
    for rid in REQUESTS:
        c.add(rid)
    c.run()
    assert_engine_idle_and_free(core)
    for rid, (_, params) in REQUESTS.items():
        assert c.finishes(rid) in (["length"], ["stop"])
        assert 0 < len(c.tokens(rid)) <= params.max_tokens
    return {rid: c.tokens(rid) for rid in REQUESTS}


def test_everything_free_after_requests_finish(tiny_checkpoint, reference):
    """The reference ran with ZOS (and was checked free); the same without ZOS."""
    core = make_engine(tiny_checkpoint, zos=False)
    c = Collector(core)
    for rid in REQUESTS:
        c.add(rid)
    c.step()
    assert core.stats().kv_blocks_used > 0 and core.stats().state_slots_used > 0
    c.run()
    assert {rid: c.tokens(rid) for rid in REQUESTS} == reference
    assert all(out.finish_reason is None for rid in REQUESTS for out in c.outputs[rid][:-1])
    assert_engine_idle_and_free(core)


@pytest.mark.parametrize("zos", [True, False])
def test_abort_mid_prefill_frees_blocks_and_slot(tiny_checkpoint, reference, zos):
    core = make_engine(tiny_checkpoint, zos=zos)
    c = Collector(core)
    c.add("long")  # 100 tokens in chunks of 32
    c.step()
    c.step()
    seq = core.scheduler.by_request["long"]
    assert 0 < seq.num_cached_tokens < 100 and seq.is_prefilling
    assert core.stats().kv_blocks_used == len(seq.block_table) > 0 and core.stats().state_slots_used == 1
    (out,) = core.abort(["long"])
    assert out.request_id == "long" and out.finish_reason == "abort" and out.new_token_ids == []
    assert core.stats().kv_blocks_used == 0 and core.stats().state_slots_used == 0  # at once
    assert core.abort(["long"]) == []  # idempotent
    c.run()
    assert c.tokens("long") == [] and c.finishes("long") == []
    assert_engine_idle_and_free(core)


@pytest.mark.parametrize("zos", [True, False])
def test_abort_mid_decode_does_not_disturb_the_others(tiny_checkpoint, reference, zos):
    core = make_engine(tiny_checkpoint, zos=zos)
    c = Collector(core)
    for rid in ("greedy", "sampled", "penalised"):
        c.add(rid)
    seq = core.scheduler.by_request["sampled"]

    def in_flight() -> bool:
        flight = core._in_flight
        return flight is not None and any(s.seq_id == seq.seq_id for s in flight.plan.ranks[0].sequences)

    while len(c.tokens("sampled")) < 3 or (zos and not in_flight()):
        c.step()
    assert seq.num_cached_tokens > seq.num_prompt_tokens and seq.num_inflight_tokens == (1 if zos else 0)
    got = c.tokens("sampled")
    (out,) = core.abort(["sampled", "no-such-request"])
    assert out.finish_reason == "abort"
    c.add("long")  # arrives after the abort, may reuse the freed blocks and slot
    c.run()
    assert c.tokens("sampled") == got == reference["sampled"][:len(got)]  # nothing after the abort
    for rid in ("greedy", "penalised", "long"):
        assert c.tokens(rid) == reference[rid], rid
    assert core.abort(["sampled", "greedy"]) == []  # finished and aborted: nothing to do
    assert_engine_idle_and_free(core)


def test_abort_everything_at_every_stage_with_a_step_in_flight(tiny_checkpoint):
    core = make_engine(tiny_checkpoint, max_num_seqs=2)
    c = Collector(core)
    for rid in REQUESTS:
        c.add(rid)
    for _ in range(4):
        c.step()
    stats = core.stats()
    assert stats.waiting > 0 and stats.running == 2  # some waiting, some running
    assert core._in_flight is not None
    outs = core.abort(list(REQUESTS))
    assert sorted(o.request_id for o in outs) == sorted(REQUESTS)
    assert core.stats().kv_blocks_used == 0 and core.stats().state_slots_used == 0
    assert core.has_work  # the step in flight is still to be collected
    before = {rid: c.tokens(rid) for rid in REQUESTS}
    c.run()
    assert {rid: c.tokens(rid) for rid in REQUESTS} == before
    assert_engine_idle_and_free(core)


# ----------------------------------------------------------------------------- invalid requests
@pytest.mark.parametrize("ids,message", [
    ([], "empty"),
    ([5, 1024, 6], "outside the vocabulary"),
    ([5, -1], "outside the vocabulary"),
    ([7] * 256, "does not fit"),  # max_model_len 256
])
def test_invalid_requests_are_refused_without_leaving_anything(tiny_checkpoint, ids, message):
    core = make_engine(tiny_checkpoint)
    with pytest.raises(ValueError, match=message):
        core.add_request(AddRequest("bad", ids, SamplingParams(max_tokens=4)))
    assert_engine_idle_and_free(core)
    assert core.step() == []
    # the id is free for a valid request
    core.add_request(AddRequest("bad", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))
    c = Collector(core)
    c.run()
    assert len(c.tokens("bad")) == 2
    assert_engine_idle_and_free(core)


def test_duplicate_live_request_id_is_refused(tiny_checkpoint):
    core = make_engine(tiny_checkpoint)
    core.add_request(AddRequest("dup", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    with pytest.raises(ValueError, match="already"):
        core.add_request(AddRequest("dup", [8, 9], SamplingParams(max_tokens=3)))
    c = Collector(core)
    c.run()
    assert len(c.tokens("dup")) == 3 and c.outputs["dup"][0].num_prompt_tokens == 3
    assert_engine_idle_and_free(core)


def test_llm_generate_refusing_one_prompt_leaves_nothing_behind(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), **ENGINE)
    with pytest.raises(ValueError, match="does not fit"):
        llm.generate([[5, 6, 7], [7] * 300], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_work and llm.engine.stats().waiting == 0
    (result,) = llm.generate([[8, 9]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(result.token_ids) == 3


def test_request_outgrowing_the_kv_cache_finishes(tiny_checkpoint):
    core = make_engine(tiny_checkpoint, num_blocks=3)  # 2 blocks: 32 tokens of KV; max_model_len 256
    c = Collector(core)
    core.add_request(AddRequest("big", prompt(9, 20), SamplingParams(temperature=0.0, max_tokens=30,
                                                                      ignore_eos=True)))
    c.run(max_steps=40)
    assert c.finishes("big") == ["length"] and 12 <= len(c.tokens("big")) <= 13
    assert_engine_idle_and_free(core)
