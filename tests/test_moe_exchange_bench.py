"""The multi-GPU expert-exchange benchmark's logic, run with two gloo ranks on CPU."""

from __future__ import annotations

import json

from benchmarks import moe_exchange


def test_two_rank_exchange_benchmark_runs_and_is_bit_exact(tmp_path):
    out = tmp_path / "exchange.json"
    assert moe_exchange.main(["--device", "cpu", "--world-size", "2", "--tokens", "1,16", "--reps", "2",
                              "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bit_exact"] and [r["tokens_per_rank"] for r in result["rows"]] == [1, 16]
    assert all(r["exchange_only_ms"] > 0 for r in result["rows"])
