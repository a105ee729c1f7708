"""``benchmarks/kernels.py`` runs end to end at the tiny shapes in Triton's interpreter: every
kernel checked against the reference, the tile sweep of ``benchmarks/kernel_tune.py`` included
(timings are meaningless there; this guards the script's logic, which otherwise runs only on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_benchmark_and_tile_sweep_run_on_the_tiny_shapes(tmp_path):
    out = tmp_path / "kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "benchmarks/kernels.py", "--device", "cpu", "--tiny", "--quick", "--m", "1,65",
                           "--tune", "--no-reference", "--kernels", "wkv,moe", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["error"] is None
    assert {r["kernel"] for r in doc["results"]} == {"attn.wkv", "moe.experts"}
    assert all(r["rel_err"] is not None and r["rel_err"] <= 1e-2 for r in doc["results"])
    tuned = {(e["kernel"], e["m"]): e for e in doc["tune"]}
    assert set(tuned) == {(kernel, m) for kernel in ("attn.wkv", "moe.experts") for m in (1, 65)}
    assert all("s" in c for e in tuned.values() for c in e["configs"])  # every candidate ran
    # the FP8 linear's one-token form at M = 1, its prefill form above the decode form's 64 rows
    assert tuned["attn.wkv", 1]["table"] == "gemv" and tuned["attn.wkv", 65]["table"] == "bf16"
    for key in (("attn.wkv", 65), ("moe.experts", 1), ("moe.experts", 65)):  # batch invariant: the same bits
        assert all(c["bitwise_equal_to_default"] for c in tuned[key]["configs"]), key
    assert "Best single config per M" in done.stdout
