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
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_benchmark_and_tile_sweep_run_on_the_tiny_shapes(tmp_path):
    out = tmp_path / "kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.triton_interpreter",  # (the interpreter, a third faster)
                           "benchmarks/kernels.py", "--device", "cpu", "--tiny", "--quick", "--m", "1,65",
                           "--tune", "--no-reference", "--kernels", "wkv,moe", "--json", str(out),
                           "--pdl"],  # (no such launch in the interpreter: the flag's way through the script)
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["error"] is None and doc["args"]["pdl"]
    assert {r["kernel"] for r in doc["results"]} == {"attn.wkv", "moe.experts"}
    assert all(r["rel_err"] is not None and r["rel_err"] <= 1e-2 for r in doc["results"])
    tuned = {(e["kernel"], e["m"], e["table"]): e for e in doc["tune"]}
    # the FP8 linear's one-token form at M = 1, its decode form at 65 rows (up to 256). The experts at
    # M = 1 (0.25 pairs per expert) both ways, at 65 (16 per expert: past the tensor-core kernels' blocks of
    # 8) on triton_moe only
    assert set(tuned) == {("attn.wkv", 1, "gemv"), ("attn.wkv", 65, "fp8_decode"),
                          ("moe.experts", 1, "moe"), ("moe.experts", 1, "mma_experts"), ("moe.experts", 65, "moe")}
    assert all("s" in c for e in tuned.values() for c in e["configs"])  # every candidate ran
    for key in (("attn.wkv", 1, "gemv"), ("attn.wkv", 65, "fp8_decode"),  # another summation order
                ("moe.experts", 1, "mma_experts")):
        assert all(c["rel_err_to_default"] <= 1e-2 for c in tuned[key]["configs"]), key
    for key in (("moe.experts", 65, "moe"),):  # batch invariant, as the backend's form
        assert all(c["bitwise_equal_to_default"] for c in tuned[key]["configs"]), key
    # at M = 1 the backend takes triton_mma_experts: triton_moe's configs sum in another order
    assert all(c["rel_err_to_default"] <= 1e-2 for c in tuned["moe.experts", 1, "moe"]["configs"])
    assert "Best single config per M" in done.stdout


def test_layer_graph_calls_the_projections_of_one_input_together():
    """The layer's CUDA graph runs the FP8 projections as the model does: each pair of one input
    (``LAYER_PAIRS``) in one call, every projection exactly once, the pairs' outputs those of the
    projections alone (the reference arithmetic: bit for bit)."""
    from benchmarks.kernel_inputs import LAYER_PAIRS, TINY, layer_calls, linear_specs
    from model.config import WeightFormat
    from model.kernels.reference import ReferenceKernels
    from tests.test_triton_kernels import random_weight

    specs = linear_specs(TINY)
    gen = torch.Generator().manual_seed(0)
    weights = {s.name: random_weight(WeightFormat.FP8, s.groups * s.n, s.k, gen) for s in specs}
    kernels = ReferenceKernels(batch_invariant=False)
    calls = layer_calls(specs, weights.__getitem__, kernels, 2, torch.Generator().manual_seed(1), torch.device("cpu"))
    groups = [names for names, _, _ in calls]
    assert set(LAYER_PAIRS) <= set(groups)
    assert sorted(name for names in groups for name in names) == sorted(s.name for s in specs)
    alone = layer_calls([s for s in specs if s.name != "attn.wkv"], weights.__getitem__, kernels, 2,
                        torch.Generator().manual_seed(1), torch.device("cpu"))
    assert ("attn.wq_a",) in [names for names, _, _ in alone]  # its partner absent: called alone
    by_name = {s.name: s for s in specs}
    for names, x, call in calls:
        outs = call()
        assert len(outs) == len(names)
        for name, out in zip(names, outs):
            spec = by_name[name]
            assert out.shape[0] == 2 and out.shape[-1] == spec.n
        if len(names) == 2:
            for name, out in zip(names, outs):
                assert torch.equal(out, kernels.quantized_linear(x, weights[name]))


# in-process ``--device cpu`` runs need the interpreter, which ``conftest.py`` turns on only where there is no GPU
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="in-process --device cpu needs the interpreter")


@CPU_ONLY
def test_tensor_core_experts_puts_the_routed_experts_on_the_tensor_core_kernels(monkeypatch, tmp_path):
    """``--tensor-core-experts X``: the run's routed experts of at most X pairs per expert take
    ``triton_mma_experts`` (every result still checked against the reference); with 0, none does."""
    import benchmarks.kernels as script
    from model.kernels import tile_configs, triton_mma_experts

    calls = []
    real = triton_mma_experts.mma_experts
    monkeypatch.setattr(triton_mma_experts, "mma_experts",
                        lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(tile_configs, "MMA_EXPERTS_MAX_PAIRS", tile_configs.MMA_EXPERTS_MAX_PAIRS)  # restored after
    common = ["--device", "cpu", "--tiny", "--quick", "--kernels", "moe", "--m", "2"]
    assert script.main(common + ["--tensor-core-experts", "0", "--json", str(tmp_path / "off.json")]) == 0
    assert calls == []
    assert script.main(common + ["--tensor-core-experts", "8", "--json", str(tmp_path / "on.json")]) == 0
    assert calls and set(calls) == {4}  # 2 tokens x top-2
    doc = json.loads((tmp_path / "on.json").read_text())
    assert doc["error"] is None and all(r["rel_err"] <= 1e-2 for r in doc["results"])


def test_gemv_configs_are_read_in_the_tile_sweeps_form():
    """``--gemv-configs`` takes a config as the sweep's report prints it (``cfg_text``), and only
    ``triton_gemv``'s shapes (rows dividing 32, whole 32-column blocks)."""
    from benchmarks.kernel_args import gemv_config_fields
    from benchmarks.kernel_tune import cfg_text
    from model.kernels.tile_configs import DecodeConfig

    for cfg in (DecodeConfig(32, 512, 4, 3, 1), DecodeConfig(16, 128, 2, 1, 8, one_wave=True)):
        assert DecodeConfig(**gemv_config_fields(cfg_text(cfg))) == cfg
    for wrong in ("w32/k128/warps4/s4", "w24/k128/warps4/s1/pps4", "w32/k100/warps4/s1/pps4", "32x128w4s1p4"):
        with pytest.raises(ValueError):
            gemv_config_fields(wrong)


def test_the_layer_launches_are_keyed_as_the_kernels_key_them():
    """``--tune-layer-gemv`` keys each launch of the layer graph by its output rows (a pair's rows
    added, a grouped weight's groups x N) and K, as ``triton_gemv`` and the decode form look their configs
    up: a launch's own rows first (the first whose bound holds), then the table by M. Inside
    ``override_tables(gemv=...)`` / ``(fp8_decode=...)`` every shape takes that config, and the launches'
    tables come back after."""
    from benchmarks.kernel_inputs import FLASH, LAYER_PAIRS, linear_specs
    from benchmarks.kernel_tune import override_tables
    from benchmarks.layer_gemv_tune import candidates, decode_candidates, launch_family, launch_key, with_row
    from model.kernels import tile_configs

    specs = linear_specs(FLASH)
    assert launch_key(specs, LAYER_PAIRS[0]) == (1280 + 512, 5120)  # wq_a with wkv
    assert launch_key(specs, ("attn.wo_a (grouped)",)) == (8 * 1024, 4096)
    assert all(cfg.num_stages > 1 and 32 % cfg.block_w == 0 for cfg in candidates())
    entry = tile_configs.DecodeConfig(16, 256, 2, 4, 2)
    forced = tile_configs.DecodeConfig(32, 256, 4, 3, 1)
    five_to_eight = tile_configs.DecodeConfig(64, 128, 2, 1, 2)
    assert launch_family(1, False) == launch_family(2, True) == ("gemv", "_GEMV_BY_SHAPE")
    assert launch_family(3, False) == ("fp8_decode", "_FP8_DECODE_BY_SHAPE")  # from 3 tokens: the decode form
    assert launch_family(16, False) == ("fp8_decode", "_FP8_DECODE_BY_SHAPE")
    assert launch_family(16, True) == ("decode", "_DECODE_MM_BY_SHAPE")  # the grouped wo_a: decode_mm's table
    assert launch_family(128, False) == ("fp8_decode", "_FP8_DECODE_BY_SHAPE")
    assert launch_family(128, True) is None  # wo_a's prefill form above 64 tokens
    assert all(cfg.num_warps == 4 and cfg.block_w in (64, 128) for cfg in decode_candidates(16))
    assert all(cfg.block_w == 16 * cfg.num_warps and cfg.one_wave for cfg in decode_candidates(128))
    # (family, its launch table, its table by M, its lookup, the largest M of the launch's row)
    families = (("gemv", "_GEMV_BY_SHAPE", "_GEMV_TABLE", tile_configs.gemv_config, 1),
                ("fp8_decode", "_FP8_DECODE_BY_SHAPE", "_FP8_DECODE_TABLE", tile_configs.fp8_decode_config, 16))
    saved = {attr: getattr(tile_configs, attr) for _, attr, *_ in families}
    try:
        for family, attr, table, config, m in families:
            by_m = tile_configs._pick(getattr(tile_configs, table), m)
            setattr(tile_configs, attr, {(1792, 5120): ((m, forced),)})
            assert config(m, 1792, 5120) == forced
            assert config(m + 1, 1792, 5120) == tile_configs._pick(getattr(tile_configs, table), m + 1)
            with override_tables(**{family: entry}):  # every shape
                assert config(m, 1792, 5120) == entry
            with override_tables(**{f"{family}_by_shape": {(512, 256): ((m, entry),)}}):  # these rows instead
                assert config(m, 512, 256) == entry
                assert config(m, 1792, 5120) == by_m
            assert getattr(tile_configs, attr) == {(1792, 5120): ((m, forced),)}, family  # put back
        assert with_row(((4, forced), (8, five_to_eight)), 4, entry) == ((4, entry), (8, five_to_eight))
        assert with_row(((8, five_to_eight),), 4, entry) == ((4, entry), (8, five_to_eight))  # before the 8-row
    finally:
        for attr, value in saved.items():
            setattr(tile_configs, attr, value)


def test_layer_table_shows_the_graph_with_inputs_in_l2_where_it_ran():
    """``--inputs-in-l2`` adds the graph's time with each input written just before its projection, and its
    share of the memory limit; a run without it keeps the table's columns as they were."""
    from types import SimpleNamespace

    from benchmarks.kernel_report import layer_graph_lines

    specs = [SimpleNamespace(name="attn.wq_a"), SimpleNamespace(name="attn.wkv")]
    entry = {"m": 1, "sum_s": 80e-6, "graph_s": 64e-6, "mem_limit_s": 40e-6, "limit_s": 40e-6, "instances": 4,
             "pct_mem_limit": 40 / 64, "pct_limit": 40 / 64, "sum_pct_mem_limit": 0.5}
    plain = layer_graph_lines(specs, [entry])
    assert "inputs in L2" not in plain[2] and plain[4].count("|") == plain[2].count("|")
    warm = layer_graph_lines(specs, [{**entry, "graph_inputs_in_l2_s": 50e-6}, {**entry, "m": 2}])
    header, rule, with_it, without_it = warm[2:6]
    assert "| graph, inputs in L2 | its % of memory limit |" in header
    assert header.count("|") == rule.count("|") == with_it.count("|") == without_it.count("|")
    assert "| 50.0 | 80% |" in with_it and "| - | - |" in without_it


def test_layer_table_shows_the_graph_with_plain_inputs_where_it_ran():
    """``--plain-inputs`` adds the graph's time with every product rounding its own input (before FP8-ready
    rows), next to the graph's; with ``--pdl`` too, both columns, every row as wide as the header."""
    from types import SimpleNamespace

    from benchmarks.kernel_report import layer_graph_lines

    specs = [SimpleNamespace(name="attn.wq_a"), SimpleNamespace(name="attn.wkv")]
    entry = {"m": 16, "sum_s": 80e-6, "graph_s": 64e-6, "mem_limit_s": 40e-6, "limit_s": 40e-6, "instances": 4,
             "pct_mem_limit": 40 / 64, "pct_limit": 40 / 64, "sum_pct_mem_limit": 0.5,
             "graph_plain_inputs_s": 70e-6, "graph_without_pdl_s": 66e-6}
    header, rule, row = layer_graph_lines(specs, [entry])[2:5]
    assert "| CUDA graph | graph, plain inputs | graph without PDL |" in header
    assert header.count("|") == rule.count("|") == row.count("|")
    assert "| 64.0 | 70.0 | 66.0 |" in row
