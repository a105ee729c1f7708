"""Expert load balancing in a running engine: worker processes over gloo, the offline ``LLM``.

* With redundant experts and a rebalance every few steps, ``--dp 2`` gives the tokens of ``--dp 1``
  while the experts move between the ranks; the engine reports the rebalances, the per-rank
  (token, expert) pairs and the imbalance, and writes the statistics file at shutdown.
* A second engine (``--dp 4``) places its experts from that file at startup, gives the same
  tokens, and adds its own counts to the file.
* One rank (in-process) records the loads for a later multi-rank start; flags that cannot work are
  refused before anything starts; each worker's startup line.
"""

from __future__ import annotations

import json
import re

import pytest

from engine_core.protocol import SamplingParams
from frontend.llm import LLM

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 41, 70)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=13, max_tokens=18, ignore_eos=True)]
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from model.checkpoint_maker import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny"))


def generate(checkpoint: str, **engine_args) -> tuple[list[list[int]], object]:
    with LLM(checkpoint, **LIMITS, **engine_args) as llm:
        tokens = [r.token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        return tokens, llm.engine.stats()


def file_tokens(path) -> list[list[int]]:
    document = json.loads(path.read_text())
    assert document["format"] == "mini-deepinfer-expert-load" and document["num_experts"] == 4
    return document["tokens"]


def test_rebalancing_engine_keeps_the_tokens_and_saves_the_loads(checkpoint, tmp_path):
    reference, _ = generate(checkpoint)
    stats_file = tmp_path / "expert-load.json"
    tokens, stats = generate(checkpoint, dp_size=2, num_redundant_experts=2, eplb_step_interval=4,
                             eplb_stats_file=str(stats_file))
    assert tokens == reference
    assert stats.expert_rebalances >= 1  # experts moved while the requests ran
    assert stats.expert_load_imbalance >= 1.0
    assert len(stats.rank_expert_pairs) == 2 and all(p > 0 for p in stats.rank_expert_pairs)
    saved = file_tokens(stats_file)
    per_layer = {sum(row) for row in saved}
    assert len(per_layer) == 1 and per_layer.pop() > 0  # every layer routes the same tokens, k times each

    again, stats = generate(checkpoint, dp_size=4, num_redundant_experts=4, eplb_stats_file=str(stats_file))
    assert again == reference
    assert stats.expert_rebalances == 0 and all(p > 0 for p in stats.rank_expert_pairs)
    merged = file_tokens(stats_file)
    assert all(m >= s for row_m, row_s in zip(merged, saved) for m, s in zip(row_m, row_s))
    assert sum(map(sum, merged)) > sum(map(sum, saved))


def test_one_rank_records_loads_for_later(checkpoint, tmp_path):
    stats_file = tmp_path / "from-one-rank.json"
    tokens, stats = generate(checkpoint, eplb_stats_file=str(stats_file))
    assert stats.expert_load_imbalance == 1.0 and stats.rank_expert_pairs[0] > 0  # one rank: balanced
    rows = file_tokens(stats_file)
    assert len({sum(row) for row in rows}) == 1 and sum(rows[0]) > 0


def test_flags_that_need_several_ranks_are_refused(checkpoint, tmp_path):
    from engine_core.config import EngineConfigError

    with pytest.raises(ValueError, match="need --data-parallel-size > 1"):
        LLM(checkpoint, num_redundant_experts=2)
    with pytest.raises(EngineConfigError, match="4 routed experts \\+ 1 redundant"):
        LLM(checkpoint, dp_size=2, num_redundant_experts=1)
    bad = tmp_path / "other-model.json"
    bad.write_text(json.dumps({"format": "mini-deepinfer-expert-load", "version": 1, "num_layers": 2,
                               "num_experts": 8, "tokens": [[0] * 8] * 2}))
    with pytest.raises(EngineConfigError, match="recorded for 2 MoE layers of 8 experts"):
        LLM(checkpoint, dp_size=2, eplb_stats_file=str(bad))


def test_rank_summary_line(checkpoint):
    from workers.expert_placement import ExpertPlacement
    from workers.rank_summary import describe_experts, rank_summary

    with LLM(checkpoint, **LIMITS) as llm:
        line = rank_summary(llm.engine.executor.runner)
    assert re.fullmatch(r"rank 0 of 1: all 4 routed experts(; Engram tables [\d.]+ MiB in device memory)?; "
                        r"weights [\d.]+ MiB; caches [\d.]+ MiB \(\d+ KV blocks, 8 state slots\)", line), line
    assert describe_experts(ExpertPlacement.contiguous(6, 4, 2), 1, 4, 2) == \
        "routed experts 2-3 of 4 in every MoE layer (no redundant copy)"
    placed = ExpertPlacement(4, 2, ((0, 1, 3, 2, 3, 0),) * 6)
    assert describe_experts(placed, 1, 4, 2) == \
        "3 expert slots per MoE layer (layer 0: 2, 3, 0) of 6 over 2 ranks: 4 experts + 2 redundant copies"
