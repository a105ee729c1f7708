"""The tile-config sweep of ``benchmarks/kernels.py --tune``: every candidate config of the one-token
and decode forms of the FP8 linears and of the experts' kernels, timed at the decode sizes on the real shapes,
by overriding ``model.kernels.tile_configs``'s tables for the duration of each measurement (see
the docstring of ``benchmarks/kernels.py``)."""

from __future__ import annotations

import contextlib
import re
import statistics
from dataclasses import asdict

import torch

from benchmarks.device_limits import log
from benchmarks.kernel_checks import MAX_REL_ERR, CorrectnessError, input_sets, limit_of, linear_bytes, rel_err, us


def _tables():
    # imported when first called: benchmarks/kernels.py sets TRITON_INTERPRET before that where needed
    from model.kernels import tile_configs

    return tile_configs


DECODE_MAX_M = 256  # above: the experts' prefill configs


def run_tune(bench, ms: list[int]) -> None:
    """Sweep the tile configs at the sizes ``ms``; appends one entry per (kernel, M) to ``bench.tune``."""
    # FP8 linears at M <= 256 (wo_a: 64): the decode form's configs (triton_decode_mm; the split changes the
    # summation order, so outputs are compared within tolerance); above, the prefill form's
    # (triton_bf16_mm, compared bit for bit). Experts: the weight rows stay on the tensor cores'
    # 64-row side (batch invariance) (outputs compared bit for bit).
    tables = _tables()
    from model.kernels import triton_gemv, triton_mma_experts  # (imported late, as in _tables)
    from model.kernels.triton_backend import matrix_vector_kernel
    decode_cfgs = [tables.DecodeConfig(bw, bk, bw // 16, st, pps) for bw in (64, 128) for bk in (128, 256)
                   for st in (3, 4) for pps in (2, 4, 8)]
    # the FP8 linears (decode_mm's kernel, both scales folded into its bf16 operands): 4 warps measured best
    fp8_cfgs = [tables.DecodeConfig(bw, bk, 4, st, pps, one_wave=one_wave) for bw in (64, 128) for bk in (64, 128, 256)
                for st in (2, 3, 4) for pps in (2, 4) for one_wave in (True, False)]
    # one or two tokens' FP8 products on the CUDA cores (triton_gemv, outside the batch-invariant mode): rows per
    # program (dividing 32), K columns per step, warps, programs per SM before split-K stops
    gemv_cfgs = [tables.DecodeConfig(bw, bk, warps, 1, pps) for bw in (16, 32) for bk in (128, 256, 512)
                 for warps in (2, 4, 8) for pps in (4, 8)]
    # ... and with the weight streamed through a ring of 3-4 tiles in shared memory, where long steps and
    # few programs per SM (fewer K splits) measured best
    gemv_cfgs += [tables.DecodeConfig(bw, bk, bw // 8, stages, pps) for bw in (16, 32) for bk in (256, 512)
                  for stages in (3, 4) for pps in (1, 2)]
    moe_cfgs = [tables.TileConfig(bm, bn, warps, st) for bm in (16, 32) for bn in (64, 128) for warps in (4, 8)
                for st in (2, 3, 4)]
    # the experts on the tensor cores fed from registers (triton_mma_experts, blocks of 8 pairs): 1-8 warps,
    # 2-16 programs per SM before split-K stops; swept against whatever the backend uses now wherever a
    # step has at most 8 pairs per expert on average, so the sweep is also the head-to-head that decides
    # MMA_EXPERTS_MAX_PAIRS
    mma_experts_cfgs = [tables.DecodeConfig(32 * warps, 64, warps, 1, pps) for warps in (1, 2, 4, 8)
                        for pps in (2, 4, 8, 16)]
    # prefill: tens to hundreds of tokens per expert, wider token tiles for the tensor cores. 128 weight
    # rows and 8 warps only: at 8K tokens on one H200, 64 or 256 rows and 4 warps were 25-80% slower, and
    # the full grid (24 configs of two kernels, compiled in turn) did not finish in minutes
    moe_prefill_cfgs = [tables.TileConfig(bm, 128, 8, st) for bm in (64, 128) for st in (2, 3, 4)]
    # the FP8 linears' and wo_a's prefill form (triton_bf16_mm, M above the decode form): the tokens on the
    # tensor cores' 64-row side (block_m >= 64; every config sums K in the same 64-column steps, so outputs
    # are compared bit for bit), pipelines that fit in shared memory (num_stages bf16 tiles of 64 columns)
    prefill_cfgs = [tables.TileConfig(bm, bn, warps, st) for bm in (64, 128, 256) for bn in (64, 128, 256)
                    for warps in (4, 8) for st in (3, 4) if st * 64 * 2 * (bm + bn) <= 200 * 1024]
    if bench.args.tiny:  # the logic, not the numbers: two configs of each table (the interpreter takes seconds a call)
        decode_cfgs, moe_cfgs, fp8_cfgs = decode_cfgs[1::5][:2], moe_cfgs[1::5][:2], fp8_cfgs[1::5][:2]
        gemv_cfgs, mma_experts_cfgs = gemv_cfgs[1::5][:2], mma_experts_cfgs[1::5][:2]
        moe_prefill_cfgs, prefill_cfgs = moe_prefill_cfgs[1::5][:2], prefill_cfgs[1::5][:2]
    budget = (bench.budget_fast[0] * 0.4, bench.budget_fast[1], bench.budget_fast[2])
    for m in ms:
        for spec in bench.specs:
            ws = bench.weights[spec.name]
            nx = input_sets(m, spec.groups * spec.k * 2, True)
            shape = (m, spec.groups, spec.k) if spec.groups > 1 else (m, spec.k)
            xs = [torch.randn(shape, device=bench.device, generator=bench.gen).to(torch.bfloat16)
                  for _ in range(nx)]
            fn = bench.tk.grouped_dequantized_linear if spec.groups > 1 else bench.tk.quantized_linear
            nbytes, flops = linear_bytes(spec, m, ws[0])
            limit_s = limit_of(nbytes, flops, bench.ceil)[2]
            if m > bench.tk_decode_max:
                table, cfgs, default = "bf16", prefill_cfgs, tables.bf16_mm_config(m)
            elif matrix_vector_kernel(m) is triton_gemv:  # (the backend's, outside the batch-invariant mode)
                table, cfgs, default = "gemv", gemv_cfgs, tables.gemv_config(m, spec.groups * spec.n, spec.k)
            elif spec.groups > 1:
                table, cfgs, default = "decode", decode_cfgs, tables.decode_mm_config(m)
            else:
                table, cfgs, default = "fp8_decode", fp8_cfgs, tables.fp8_decode_config(m)
            _sweep(bench, spec.name, m, limit_s, default, cfgs, table,
                   lambda i: fn(xs[i % nx], ws[i % len(ws)]), budget)
            del xs
        sets = bench.routing_sets(m, 8)
        hit = statistics.mean(int(torch.unique(st[2]).numel()) for st in sets)
        pairs = m * bench.s.top_k
        nbytes = hit * bench.expert_bytes() + m * bench.s.dim * 2 + pairs * bench.s.dim * 2
        limit_s = limit_of(nbytes, 6.0 * pairs * bench.s.inter * bench.s.dim, bench.ceil)[2]
        default = tables.moe_config(pairs / bench.s.experts)
        takes_mma = triton_mma_experts.takes(bench.experts)
        on_mma = takes_mma and pairs <= tables.MMA_EXPERTS_MAX_PAIRS * bench.s.experts  # the backend's form now
        _sweep(bench, "moe.experts", m, limit_s, default, moe_cfgs if m <= DECODE_MAX_M else moe_prefill_cfgs, "moe",
               lambda i: bench.tk.expert_outputs(*sets[i % len(sets)], bench.experts), budget, exact=not on_mma)
        if takes_mma and pairs <= triton_mma_experts.MAX_PAIRS * bench.s.experts:
            _sweep(bench, "moe.experts", m, limit_s, tables.mma_experts_config(pairs / bench.s.experts),
                   mma_experts_cfgs, "mma_experts",
                   lambda i: bench.tk.expert_outputs(*sets[i % len(sets)], bench.experts), budget)
        del sets
        bench._cleanup(big=False)


def _sweep(bench, name, m, limit_s, default, cfgs, table, call, budget, exact: bool | None = None) -> None:
    """Time ``call`` under each config of ``table`` against the backend as it is (its output the base);
    ``exact``: outputs must equal the base bit for bit (default: for the batch-invariant tables, whose
    configs sum K in the same steps), else within ``MAX_REL_ERR``."""
    if exact is None:
        exact = table in ("moe", "bf16")
    base = call(0)
    base_s = bench.measure_triton(call, budget, True).median_s
    entry = {"kernel": name, "table": table, "m": m, "default": asdict(default), "default_s": base_s, "limit_s": limit_s,
             "configs": []}
    best = (base_s, default)
    for cfg in cfgs:
        with override_tables(**{table: cfg}):
            try:
                out = call(0)
                t = bench.measure_triton(call, budget, True).median_s
            except Exception as exc:  # e.g. out of shared memory
                entry["configs"].append({"config": asdict(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
        if not exact:  # another split or kernel: another summation order
            err = rel_err(out, base)
            entry["configs"].append({"config": asdict(cfg), "s": t, "rel_err_to_default": err})
            if not err <= MAX_REL_ERR:
                raise CorrectnessError(f"{name} M={m} {cfg}: differs from the default config by {err:.2e}")
        else:
            same = bool(torch.equal(out, base))
            entry["configs"].append({"config": asdict(cfg), "s": t, "bitwise_equal_to_default": same})
            if not same:
                log(f"  note: {name} M={m} {cfg} output differs bitwise from the default config's")
        if t < best[0]:
            best = (t, cfg)
    entry["best"], entry["best_s"] = asdict(best[1]), best[0]
    log(f"tune {name:22s} M={m:<5d} default {base_s * 1e6:8.1f} us -> best {best[0] * 1e6:8.1f} us "
        f"{cfg_text(best[1])} ({limit_s / best[0]:.0%} of limit)")
    bench.tune.append(entry)


@contextlib.contextmanager
def override_tables(moe=None, decode=None, fp8_decode=None, bf16=None, gemv=None, mma_experts=None,
                    gemv_by_shape=None, decode_by_shape=None, fp8_decode_by_shape=None):
    """Every M takes ``moe`` / ``decode`` / ``fp8_decode`` / ``bf16`` / ``gemv`` / ``mma_experts`` while
    inside (the tables are read at each call); ``mma_experts`` also turns the experts' tensor-core kernels on
    for every size they take, ``moe`` turns ``triton_mma_experts`` off. ``decode``, ``fp8_decode`` and
    ``gemv`` take every shape too (the launches' own tables are set aside); ``decode_by_shape`` /
    ``fp8_decode_by_shape`` / ``gemv_by_shape`` replace those tables (``tile_configs._DECODE_MM_BY_SHAPE`` /
    ``_FP8_DECODE_BY_SHAPE`` / ``_GEMV_BY_SHAPE``)."""
    tables = _tables()
    names = {"moe": "_MOE_TABLE", "decode": "_DECODE_MM_TABLE", "fp8_decode": "_FP8_DECODE_TABLE",
             "bf16": "_BF16_MM_TABLE", "gemv": "_GEMV_TABLE", "mma_experts": "_MMA_EXPERTS_TABLE"}
    chosen = {"moe": moe, "decode": decode, "fp8_decode": fp8_decode, "bf16": bf16, "gemv": gemv,
              "mma_experts": mma_experts}
    switches = ["MMA_EXPERTS_MAX_PAIRS"]
    launch_tables = {"_GEMV_BY_SHAPE": (gemv, gemv_by_shape), "_DECODE_MM_BY_SHAPE": (decode, decode_by_shape),
                     "_FP8_DECODE_BY_SHAPE": (fp8_decode, fp8_decode_by_shape)}
    saved = {attr: getattr(tables, attr) for attr in [*names.values(), *switches, *launch_tables]}
    try:
        for key, cfg in chosen.items():
            if cfg is not None:
                setattr(tables, names[key], ((1 << 62, cfg),))
        for attr, (every_shape, by_shape) in launch_tables.items():
            if every_shape is not None or by_shape is not None:
                setattr(tables, attr, dict(by_shape or {}))
        if mma_experts is not None:
            tables.MMA_EXPERTS_MAX_PAIRS = float("inf")
        if moe is not None:  # the configs of triton_moe: its kernels, whatever the backend takes by default
            tables.MMA_EXPERTS_MAX_PAIRS = 0.0
        yield
    finally:
        for attr, table in saved.items():
            setattr(tables, attr, table)


def cfg_text(cfg) -> str:
    tables = _tables()
    if isinstance(cfg, dict):
        cfg = (tables.DecodeConfig if "block_w" in cfg else tables.TileConfig)(**cfg)
    if isinstance(cfg, tables.DecodeConfig):
        wave = "/one-wave" if cfg.one_wave else ""
        return f"w{cfg.block_w}/k{cfg.block_k}/warps{cfg.num_warps}/s{cfg.num_stages}/pps{cfg.programs_per_sm}{wave}"
    return f"m{cfg.block_m}/n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"


def decode_config_fields(text: str) -> dict:
    """``cfg_text``'s form of a ``DecodeConfig`` (``w32/k512/warps4/s3/pps1``, ``/one-wave`` optional) ->
    its fields, as ``cfg_text`` takes them back; read before the kernels are imported."""
    found = re.fullmatch(r"w(\d+)/k(\d+)/warps(\d+)/s(\d+)/pps(\d+)(/one-wave)?", text.strip())
    if not found:
        raise ValueError(f"a config is w<rows>/k<columns>/warps<n>/s<stages>/pps<programs per SM>, got {text!r}")
    block_w, block_k, num_warps, num_stages, programs_per_sm = map(int, found.groups()[:5])
    return dict(block_w=block_w, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                programs_per_sm=programs_per_sm, one_wave=found.group(6) is not None)


def tune_markdown(bench) -> str:
    lines = ["## Tile-config sweep", "",
             "| kernel | M | default | default µs | best | best µs | gain | best % of limit |",
             "|---|---:|---|---:|---|---:|---:|---:|"]
    for e in bench.tune:
        lines.append(f"| {e['kernel']} | {e['m']} | {cfg_text(e['default'])} | {us(e['default_s'])} "
                     f"| {cfg_text(e['best'])} | {us(e['best_s'])} | {e['default_s'] / e['best_s']:.2f}x "
                     f"| {e['limit_s'] / e['best_s']:.0%} |")
    # the tables are keyed by M only: the config with the least total time over the GEMMs of each M
    lines += ["", "Best single config per M and table (sum over its GEMMs: the FP8 linears, wo_a, the experts):", ""]
    for table in ("gemv", "fp8_decode", "decode", "bf16", "moe", "mma_experts"):
        for m in sorted({e["m"] for e in bench.tune}):
            entries = [e for e in bench.tune if e["m"] == m and e["table"] == table]
            totals: dict[str, float] = {}
            ok = {}
            for e in entries:
                for c in e["configs"]:
                    key = cfg_text(c["config"])
                    if "s" in c:
                        totals[key] = totals.get(key, 0.0) + c["s"]
                        ok[key] = ok.get(key, 0) + 1
            full = {k: v for k, v in totals.items() if ok[k] == len(entries)}
            if not full:
                continue
            best = min(full, key=full.get)
            default_total = sum(e["default_s"] for e in entries)
            lines.append(f"* {table} M={m}: {best} total {us(full[best])} µs vs default {us(default_total)} µs")
    return "\n".join(lines)
