"""``benchmarks/kernels.py --tune-layer-gemv``: one config per launch of the one-token layer graph.

A V4.1-Flash layer's nine FP8 projections reach ``triton_gemv`` in six launches (``wq_a`` with ``wkv``,
``wq_b`` with the indexer's, the shared ``w1`` with ``w3``, ``wo_a``, ``wo_b``, ``w2``), from 9 to 47 MB
of weight each, and the small ones cost ~4-5 µs beyond their bytes: how many programs and how deep a
ring keep enough of a launch in flight may depend on its size. Here each launch is timed alone (16
calls in one CUDA graph, rotating weight copies) under every candidate, its outputs compared with the
default's; then the whole layer graph is timed with each launch's best (``tile_configs._GEMV_BY_SHAPE``,
keyed by the launch's output rows and K) next to the graph as it runs now, in the same run. The picks
are printed as the table's entries. (On one H100 the default was the best for every launch, within
0.2 µs: docs/benchmarks.md.)
"""

from __future__ import annotations

from benchmarks.device_limits import log
from benchmarks.kernel_checks import MAX_REL_ERR, CorrectnessError, rel_err, us
from benchmarks.kernel_inputs import layer_calls
from benchmarks.kernel_tune import cfg_text, override_tables

ROTATIONS = 16  # input and weight sets a launch rotates over (one per call of a timed graph)


def candidates():
    """Rings only (the registers' loop lost to them at every size measured): 32 rows and 4 warps or 16
    and 2; 256- or 512-column steps; rings deep enough for 2-7 steps in flight; 1-4 programs per SM."""
    from model.kernels.tile_configs import DecodeConfig

    rings = {256: (3, 4, 6, 8), 512: (3, 4, 5)}
    return [DecodeConfig(rows, step, rows // 8, ring, pps) for rows in (32, 16) for step, depths in rings.items()
            for ring in depths for pps in (1, 2, 4)]


def launch_key(specs, names) -> tuple[int, int]:
    """``(rows, K)`` of the launch that computes the projections ``names`` (``tile_configs.gemv_config``)."""
    by_name = {spec.name: spec for spec in specs}
    return sum(by_name[n].groups * by_name[n].n for n in names), by_name[names[0]].k


def run_layer_gemv_tune(bench) -> dict:
    """Each one-token launch's best config, then the layer graph with all of them; the entry is returned
    (``graph_s`` as it runs now, ``tuned_graph_s`` with the picks, ``launches``: every timing)."""
    budget = (bench.budget_fast[0] * 0.4, bench.budget_fast[1], bench.budget_fast[2])
    sets = [layer_calls(bench.specs, lambda name, j=j: bench.weights[name][j % len(bench.weights[name])], bench.tk,
                        1, bench.gen, bench.device) for j in range(ROTATIONS)]
    entry = {"launches": [], "picks": {}}
    for index, (names, _, _) in enumerate(sets[0]):
        key = launch_key(bench.specs, names)

        def call(i, index=index):
            return sets[i % ROTATIONS][index][2]()

        base = call(0)
        base_s = bench.measure_triton(call, budget, True).median_s
        timings, best = [], (base_s, None)
        for cfg in candidates():
            if key[1] % cfg.block_k:
                continue  # the kernel would halve the step: another candidate's launch
            with override_tables(gemv=cfg):
                try:
                    out = call(0)
                    t = bench.measure_triton(call, budget, True).median_s
                except Exception as exc:  # e.g. out of shared memory
                    timings.append({"config": cfg_text(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
                    continue
            err = max(rel_err(o, b) for o, b in zip(out, base, strict=True))
            if not err <= MAX_REL_ERR:  # another split: another summation order, within the tolerance
                raise CorrectnessError(f"{'+'.join(names)} with triton_gemv {cfg_text(cfg)}: differs from the "
                                       f"default config by {err:.2e}")
            timings.append({"config": cfg_text(cfg), "s": t, "rel_err_to_default": err})
            if t < best[0]:
                best = (t, cfg)
        entry["launches"].append({"names": list(names), "key": list(key), "default_s": base_s, "best_s": best[0],
                                  "best": cfg_text(best[1]) if best[1] else "default", "configs": timings})
        if best[1] is not None:
            entry["picks"][key] = best[1]
        log(f"tune layer launch {'+'.join(names):28s} {key}: default {us(base_s)} us -> best {us(best[0])} us "
            f"{cfg_text(best[1]) if best[1] else '(the default)'}")
    del sets
    entry["graph_s"] = bench.run_layer_graph(1, bench.tk)["graph_s"]
    with override_tables(gemv_by_shape=entry["picks"]):
        entry["tuned_graph_s"] = bench.run_layer_graph(1, bench.tk)["graph_s"]
    entry["again_graph_s"] = bench.run_layer_graph(1, bench.tk)["graph_s"]  # the default again: the run's noise
    log(f"layer FP8 linears M=1: graph {us(entry['graph_s'])} / {us(entry['again_graph_s'])} us as it runs now, "
        f"{us(entry['tuned_graph_s'])} us with each launch's best")
    log("tile_configs._GEMV_BY_SHAPE = {" + ", ".join(
        f"{key}: DecodeConfig({c.block_w}, {c.block_k}, {c.num_warps}, {c.num_stages}, {c.programs_per_sm})"
        for key, c in entry["picks"].items()) + "}")
    entry["picks"] = {f"{rows}x{k}": cfg_text(c) for (rows, k), c in entry["picks"].items()}  # (JSON keys)
    return entry
