"""``benchmarks/kernels.py --tune-layer-gemv``: one config per launch of the layer graph of a few tokens.

A V4.1-Flash layer's nine FP8 projections reach the matrix-vector kernel (``triton_gemv``, one or two
tokens) or the decode form (``triton_decode_mm``, up to 256 tokens) in six launches (``wq_a`` with
``wkv``, ``wq_b`` with the indexer's, the shared ``w1`` with ``w3``, ``wo_a``, ``wo_b``, ``w2``), from 9
to 47 MB of weight each, and the small ones cost several µs beyond their bytes: how many programs and
how long a step keep enough of a launch in flight may depend on its size. Here, at each M asked for,
each launch is timed alone (16 calls in one CUDA graph, rotating weight copies) under every candidate
of the kernel that takes M, its outputs compared with the default's; then the whole layer graph is
timed with each launch's best (the launches' own tables, ``tile_configs._GEMV_BY_SHAPE`` /
``_FP8_DECODE_BY_SHAPE`` / ``_DECODE_MM_BY_SHAPE`` (the grouped ``wo_a``), keyed by the launch's output
rows and K, one row of bound M) next to the graph as it runs now, in the same run. The picks are printed
as the tables' entries. (On one H100 the one-token default was the best for every launch, within 0.2 µs:
docs/benchmarks-log.md.)
"""

from __future__ import annotations

from benchmarks.device_limits import log
from benchmarks.kernel_checks import MAX_REL_ERR, CorrectnessError, rel_err, us
from benchmarks.kernel_inputs import layer_calls
from benchmarks.kernel_tune import cfg_text, override_tables

ROTATIONS = 16  # input and weight sets a launch rotates over (one per call of a timed graph)
# the grouped wo_a's outputs are FP8-ready rows (their FP8 round trip, for wo_b): where another split moves a sum by
# one bf16 ulp, its e4m3 value may move by a step, up to 2**-3 of the group's largest
FP8_READY_REL_ERR = 2.0 ** -3


def candidates():
    """``triton_gemv``'s: rings only (the registers' loop lost to them at every size measured): 32 rows and
    4 warps or 16 and 2; 256- or 512-column steps; rings deep enough for 2-7 steps in flight; 1-4 programs
    per SM."""
    from model.kernels.tile_configs import DecodeConfig

    rings = {256: (3, 4, 6, 8), 512: (3, 4, 5)}
    return [DecodeConfig(rows, step, rows // 8, ring, pps) for rows in (32, 16) for step, depths in rings.items()
            for ring in depths for pps in (1, 2, 4)]


def decode_candidates(m: int):
    """The decode form's (``triton_decode_mm``) at ``m`` tokens. Up to 64: 64 or 128 weight rows at 4 warps
    (4 measured best), 128- or 256-column steps, 3 or 4 stages, K split until 2, 4 or 8 programs per SM within
    one wave, or a second wave allowed at 4 per SM (the grouped ``wo_a``'s table row); and at most one program
    per SM with 4 or 6 stages, which leaves K whole where a launch has about an SM's worth of row tiles (then no
    launch adds split sums; on one H100 each such launch took 1.4-2.4x its split default at 16 and 64 tokens,
    docs/benchmarks-log.md). From 65 (one token tile of up to 256): 64 rows at 4 warps or 128 at 8 (the fp32 sums of
    128 rows x 256 tokens need 8 warps' registers), 64- or 128-column steps (what fits in shared memory at 256
    tokens), 3 or 4 stages, 1 or 2 programs per SM in one wave."""
    from model.kernels.tile_configs import DecodeConfig

    if m > 64:
        return [DecodeConfig(rows, step, rows // 16, stages, pps, one_wave=True) for rows in (64, 128)
                for step in (64, 128) for stages in (3, 4) for pps in (1, 2)]
    return [DecodeConfig(rows, step, 4, stages, pps, one_wave=True) for rows in (64, 128) for step in (128, 256)
            for stages in (3, 4) for pps in (2, 4, 8)] + \
        [DecodeConfig(rows, step, 4, 3, 4) for rows in (64, 128) for step in (128, 256)] + \
        [DecodeConfig(rows, step, 4, stages, 1, one_wave=True) for rows, step in ((64, 128), (64, 256), (128, 128))
         for stages in (4, 6)]


def launch_family(m: int, grouped: bool) -> tuple[str, str] | None:
    """``(table, launch table's attribute)`` of the kernel that takes a launch at ``m`` tokens (``grouped``: of
    a grouped weight, ``wo_a``): ``override_tables``' name for its table, ``tile_configs``' for the launches'
    own rows; None: the prefill form (no launch table)."""
    from model.kernels import tile_configs
    from model.kernels.triton_backend import matrix_vector_kernel

    if matrix_vector_kernel(m) is not None:
        return "gemv", "_GEMV_BY_SHAPE"
    # the decode form: the grouped wo_a through decode_mm's table, the others through the FP8 one
    if m > tile_configs.decode_form_max_tokens(fp8=not grouped):
        return None
    return ("decode", "_DECODE_MM_BY_SHAPE") if grouped else ("fp8_decode", "_FP8_DECODE_BY_SHAPE")


FAMILIES = {  # table -> (the config of a launch: tile_configs' function, the candidates at M tokens)
    "gemv": ("gemv_config", lambda m: candidates()),
    "fp8_decode": ("fp8_decode_config", decode_candidates), "decode": ("decode_mm_config", decode_candidates),
}


def launch_key(specs, names) -> tuple[int, int]:
    """``(rows, K)`` of the launch that computes the projections ``names`` (as ``tile_configs.gemv_config``
    and the other launches' configs take it)."""
    by_name = {spec.name: spec for spec in specs}
    return sum(by_name[n].groups * by_name[n].n for n in names), by_name[names[0]].k


def with_row(rows, m: int, cfg):
    """A launch's table ``rows`` with ``cfg`` as its row of bound ``m`` (replacing one of the same bound),
    in order of bound, so that the rows of fewer tokens still take those tokens."""
    return tuple(sorted({**dict(rows), m: cfg}.items()))


def run_layer_gemv_tune(bench, m: int) -> dict:
    """Each launch's best config at ``m`` tokens, then the layer graph with all of them; the entry is
    returned (``graph_s`` as it runs now, ``tuned_graph_s`` with the picks, ``launches``: every timing)."""
    from model.kernels import tile_configs

    budget = (bench.budget_fast[0] * 0.4, bench.budget_fast[1], bench.budget_fast[2])
    sets = [layer_calls(bench.specs, lambda name, j=j: bench.weights[name][j % len(bench.weights[name])], bench.tk,
                        m, bench.gen, bench.device) for j in range(ROTATIONS)]
    entry = {"m": m, "launches": [], "picks": {}}
    groups = {spec.name: spec.groups for spec in bench.specs}
    picks: dict[str, dict] = {}  # launch table's attribute -> {(rows, K): config}
    table_of: dict[str, str] = {}  # launch table's attribute -> override_tables' name
    for index, (names, _, _) in enumerate(sets[0]):
        key = launch_key(bench.specs, names)
        family = launch_family(m, groups[names[0]] > 1)
        if family is None:
            continue  # the prefill form: its configs are the table by M (``--tune``)
        table, attr = family
        config_of, candidates_of = FAMILIES[table]

        def call(i, index=index):
            return sets[i % ROTATIONS][index][2]()

        base = call(0)
        base_s = bench.measure_triton(call, budget, True).median_s
        timings, best = [], (base_s, None)
        default = getattr(tile_configs, config_of)(m, *key)
        for cfg in candidates_of(m):
            if key[1] % cfg.block_k or cfg == default:
                continue  # the kernel would shorten the step (another candidate's launch), or the base itself
            with override_tables(**{table: cfg}):
                try:
                    out = call(0)
                    t = bench.measure_triton(call, budget, True).median_s
                except Exception as exc:  # e.g. out of shared memory
                    timings.append({"config": cfg_text(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
                    continue
            err = max(rel_err(o, b) for o, b in zip(out, base, strict=True))
            if not err <= (FP8_READY_REL_ERR if groups[names[0]] > 1 else MAX_REL_ERR):  # another summation order
                raise CorrectnessError(f"{'+'.join(names)} with {table} {cfg_text(cfg)} at M={m}: differs from the "
                                       f"default config by {err:.2e}")
            timings.append({"config": cfg_text(cfg), "s": t, "rel_err_to_default": err})
            if t < best[0]:
                best = (t, cfg)
        entry["launches"].append({"names": list(names), "kernel": table, "key": list(key), "default_s": base_s,
                                  "best_s": best[0], "best": cfg_text(best[1]) if best[1] else "default",
                                  "configs": timings})
        if best[1] is not None:
            picks.setdefault(attr, {})[key] = best[1]
            table_of[attr] = table
        log(f"tune layer launch M={m} {'+'.join(names):28s} {key} ({table}): default {us(base_s)} us -> best "
            f"{us(best[0])} us {cfg_text(best[1]) if best[1] else '(the default)'}")
    del sets
    tuned = {f"{table_of[attr]}_by_shape": {**getattr(tile_configs, attr),
                                            **{key: with_row(getattr(tile_configs, attr).get(key, ()), m, cfg)
                                               for key, cfg in chosen.items()}}
             for attr, chosen in picks.items()}
    entry["graph_s"] = bench.run_layer_graph(m, bench.tk)["graph_s"]
    with override_tables(**tuned):
        entry["tuned_graph_s"] = bench.run_layer_graph(m, bench.tk)["graph_s"]
    entry["again_graph_s"] = bench.run_layer_graph(m, bench.tk)["graph_s"]  # the default again: the run's noise
    log(f"layer FP8 linears M={m}: graph {us(entry['graph_s'])} / {us(entry['again_graph_s'])} us as it runs now, "
        f"{us(entry['tuned_graph_s'])} us with each launch's best")
    for attr, chosen in picks.items():
        log(f"tile_configs.{attr} rows of M <= {m}: {{" + ", ".join(
            f"{key}: (({m}, DecodeConfig({c.block_w}, {c.block_k}, {c.num_warps}, {c.num_stages}, {c.programs_per_sm}"
            f"{', one_wave=True' if c.one_wave else ''})),)" for key, c in chosen.items()) + "}")
        entry["picks"][attr] = {f"{rows}x{k}": cfg_text(c) for (rows, k), c in chosen.items()}  # (JSON keys)
    return entry
