"""The quantized kernels at DeepSeek-V4.1-Flash's shapes, against the reference, plain torch and the hardware.

Run (from the repository root, on a CUDA machine)::

    .venv/bin/python benchmarks/kernels.py                          # M = 1,8,64,256,4096,16384
    .venv/bin/python benchmarks/kernels.py --quick                  # M = 1,64,4096, shorter timings
    .venv/bin/python benchmarks/kernels.py --m 1,64 --json out.json
    .venv/bin/python benchmarks/kernels.py --tune                   # + tile-config sweep
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/kernels.py --device cpu --tiny   # logic check only

What one layer of V4.1-Flash multiplies (hidden 5120, 64 heads x 512, q_lora 1280, 8 output
groups x 1024, indexer 32 heads x 128, 384 routed experts top-6 with intermediate 2304):

* FP8 linears (e4m3, UE8M0 scale per 32x32 tile; activation FP8-quantized per 32):
  ``wq_a [1280, 5120]``, ``wq_b [32768, 1280]``, ``wkv [512, 5120]``, ``wo_b [5120, 8192]``,
  ``indexer.wq_b [4096, 1280]``, shared expert ``w1``/``w3 [2304, 5120]``, ``w2 [5120, 2304]``;
  and the grouped ``wo_a`` (8 groups x ``[1024, 4096]``, bf16 activation, not quantized);
* the FP4 routed experts (packed e2m1, UE8M0 scale per row per 32): ``w1``/``w3 [384, 2304, 5120]``,
  ``w2 [384, 5120, 2304]``, every token routed to 6 distinct uniformly random experts; held in the
  layout the Triton backend loads them in (``--expert-rows``: the checkpoint's).

The shapes, the random weights and the torch baselines are in ``benchmarks/kernel_inputs.py``, the
result rows and tables in ``benchmarks/kernel_report.py``.

For every (kernel, M) the script reports the time of

* ``triton``: the Triton backend (``TritonKernels``), what the engine runs on CUDA;
* ``reference``: ``ReferenceKernels(batch_invariant=False)``, the arithmetic proven equal to
  DeepSeek's reference ("-" where it would take too long or too much memory);
* ``torch``: what a reader would write: ``QuantizedWeight.dequantized()`` to bf16, then ``F.linear``
  (for the experts, a loop over the experts the routing hits); the dequantization is timed too;

and the hardware limit of the call: the bytes it must move (weights and scales it touches, for the
experts only those the routing hits; activations in and out) over the HBM bandwidth, and its FLOPs
over the bf16 tensor-core peak, both measured in the same run (a 4 GiB device-to-device copy,
bytes read plus written; an 8192^3 bf16 ``torch.matmul``). The limit is the larger of the two;
``% of limit`` = limit / measured time. The kernels expand weights to bf16 and multiply on the
tensor cores in bf16, so the bf16 peak is the one used; the FP8 peak (``torch._scaled_mm``) is
printed for context only.

Timing: median of per-call CUDA-event times, after warm-up. Each call rotates among several input
sets and among enough distinct copies of its weight (>= 256 MB and >= 4x the L2 cache together)
that no call finds its weight in L2. Before each chunk of timed calls the stream is held by a short
device-side sleep long enough for the host to queue the whole chunk, so launch gaps are not counted:
the times are device times, for all three backends (calls that read a value back to the host, the
expert loops of the reference and of plain torch, are timed as they run, host included). At decode
sizes (M <= 256) the Triton calls are timed as CUDA-graph replays of 16 calls (rotating inputs and
weights), per call: launching a few-microsecond kernel from Python takes longer than the kernel,
and no head start hides that. The FP8 linears of a whole layer are also captured in one CUDA graph
(several layer instances, distinct weight copies) and replayed, the projections of one input paired
as the model runs them (``kernel_inputs.LAYER_PAIRS``: ``wq_a`` with ``wkv``, ``wq_b`` with the
indexer's, the shared ``w1`` with ``w3``): the time a decode step spends in them, against the layer's
memory limit.

Correctness: every Triton result is compared with the reference's at the same shape (max abs
difference over max |reference|); where the reference is skipped, with the reference on a subset
of the rows (a row's result does not depend on the other rows: in the batch-invariant mode
bit for bit, in the decode form within the tolerance). The
script stops with exit status 1 if any difference exceeds 1e-2 or any output is not finite.

``--tune`` sweeps, at the given M values, the configs of the FP8 linears' one-token form (M = 1 outside
``--batch-invariant``, ``triton_gemv``: 16-32 weight rows x 128-512 K columns per step, 2-8 warps, 4 or 8
programs per SM before split-K stops, the weight in registers; and 256-512 columns with a ring of 3-4
tiles in shared memory, 1 or 2 programs per SM; outputs compared with the default config's within the
tolerance), of their decode form (M <= 256, ``wo_a`` M <= 64: 64-128 weight rows, 3-6 stages, 2-8
programs per SM before split-K stops, with or without the one-wave cap; ``wo_a``: 64-128 weight rows x
128-256 K columns per step, 3-4 stages; outputs compared with the default config's within the tolerance,
since another split sums in another order), of their prefill form (above: 64-256 tokens x 64-256 weight
rows, 4 or 8 warps, 3-4 stages within shared memory; outputs compared bit for bit: every config sums K in
the same steps) and the experts' configs (M <= 256: 16-32 tokens x 64-128 weight rows, 4 or 8 warps, 2-4
stages; above: 64-128 tokens x 128 weight rows, 8 warps, 2-4 stages; outputs compared bit for bit: the
experts' kernels are batch invariant), by overriding ``model.kernels.tile_configs`` tables for the
duration of each measurement, and prints the best config per (kernel, M) and the best single config per M
(``benchmarks/kernel_tune.py``).

``--tensor-core-experts X`` lets the routed experts of at most X pairs per expert on average take
``triton_mma_experts`` (default ``tile_configs.MMA_EXPERTS_MAX_PAIRS``); ``--kernels moe`` with 0 and 8
compares the two at the decode sizes (uniform routing: 0.016 / 0.125 / 1 / 4 pairs per expert at
M = 1 / 8 / 64 / 256).
``--unsorted-pairs N``: steps of at most N pairs skip those kernels' pair sort (default
``tile_configs.MMA_EXPERTS_UNSORTED_PAIRS``; 0 sorts every step).
``--gemv-configs w32/k128/warps4/s1/pps4,w32/k512/warps4/s3/pps1,...`` times the layer graph of each M
that takes ``triton_gemv`` (up to ``triton_gemv.MAX_TOKENS``, two) again with each of these configs (in
the sweep's form: rows, columns a step, warps, stages: 1 the weight in registers, more a ring of tiles in
shared memory, programs per SM), in the same run as the default. ``--tune-layer-gemv`` picks a config per
launch of the layer graph of each M that takes ``triton_gemv`` or the decode form
(``benchmarks/layer_gemv_tune.py``). The command line is ``benchmarks/kernel_args.py``.

``--batch-invariant`` measures the Triton backend's batch-invariant mode (every product in its
prefill form) instead of the default (the matrix-vector form at one or two tokens, the split-K decode form
up to 256).

Progress goes to stderr; the markdown tables are printed last on stdout; ``--json PATH`` writes
every number. ``--device cpu`` (with ``--tiny``) sets TRITON_INTERPRET=1 itself when it is unset.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.device_limits import STARTED, MB, Ceilings, Timer, Timing, log, measure_ceilings  # noqa: E402,F401
from benchmarks.kernel_args import parse_args  # noqa: E402
from benchmarks.kernel_tune import cfg_text, override_tables, run_tune, tune_markdown  # noqa: E402
from benchmarks.layer_gemv_tune import run_layer_gemv_tune  # noqa: E402
from benchmarks.kernel_checks import (CorrectnessError, check, check_rows, input_sets, limit_of,  # noqa: E402
                                      linear_bytes, rel_err, us)
from benchmarks.kernel_inputs import (FLASH, TINY, LinearSpec, Shapes, fp4_stack, layer_calls,  # noqa: E402
                                      linear_specs, random_routing, torch_grouped, torch_linear, torch_moe,
                                      weight_copies)
from benchmarks.kernel_report import GB, Row, env_info, markdown, progress_line  # noqa: E402

DECODE_MAX_M = 256
GRAPH_CALLS = 16  # Triton calls per CUDA graph when timing decode sizes

# Set by _import_kernels() once the device (and so TRITON_INTERPRET) is known.
triton = None
tile_configs = None
QuantizedWeight = ExpertWeights = WeightFormat = TileConfig = None
ReferenceKernels = TritonKernels = None
GAINS: dict[str, float] = {}
DECODE_FORM_MAX_M = 0
matrix_vector_kernel = triton_gemv = None


def capture_on_this_stream(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of ``fn()`` captured on the current stream, and what the capture returned. The
    whole benchmark runs on one stream (``main``), as the engine does: a process that captures on a
    side stream replays every graph slower (``workers/worker_stream.py``)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        result = fn()
    return graph, result


def _import_kernels() -> None:
    global triton, tile_configs, QuantizedWeight, ExpertWeights, WeightFormat, TileConfig
    global ReferenceKernels, TritonKernels, GAINS, DECODE_FORM_MAX_M, matrix_vector_kernel, triton_gemv
    import triton as _triton

    from model import checkpoint_maker
    from model.config import WeightFormat as _WeightFormat
    from model.kernels import tile_configs as _tile_configs
    from model.kernels.reference import ReferenceKernels as _ReferenceKernels
    from model.kernels import triton_gemv as _triton_gemv
    from model.kernels.triton_backend import TritonKernels as _TritonKernels
    from model.kernels.triton_backend import matrix_vector_kernel as _matrix_vector_kernel
    from model.kernels.weights import ExpertWeights as _ExpertWeights
    from model.kernels.weights import QuantizedWeight as _QuantizedWeight

    triton, tile_configs = _triton, _tile_configs
    DECODE_FORM_MAX_M = _tile_configs.decode_form_max_tokens(fp8=True)
    QuantizedWeight, ExpertWeights, WeightFormat = _QuantizedWeight, _ExpertWeights, _WeightFormat
    TileConfig = _tile_configs.TileConfig
    ReferenceKernels, TritonKernels = _ReferenceKernels, _TritonKernels
    matrix_vector_kernel, triton_gemv = _matrix_vector_kernel, _triton_gemv
    GAINS = dict(checkpoint_maker.GAINS)


# ----------------------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, args, device: torch.device, shapes: Shapes, ceil: Ceilings, timer: Timer):
        self.args, self.device, self.s, self.ceil, self.timer = args, device, shapes, ceil, timer
        self.gen = torch.Generator(device=device).manual_seed(args.seed)
        self.tk = TritonKernels(batch_invariant=args.batch_invariant, pdl=args.pdl)
        self.tk_decode_max = 0 if args.batch_invariant else DECODE_FORM_MAX_M
        self.rk = ReferenceKernels(batch_invariant=False)
        self.specs = linear_specs(shapes)
        self.rotate_bytes = max(4 * ceil.l2_bytes, (256 * MB) if not args.tiny else (2 * MB))
        self.weights: dict[str, list] = {}
        self.experts = None
        self.rows: list[Row] = []
        self.layer: list[dict] = []
        self.tune: list[dict] = []
        cuda = device.type == "cuda"
        self.launch_s = 8e-6 if cuda else 30e-6
        tiny = args.tiny
        q = 0.5 if args.quick else 1.0
        # (tiny: one timed call after the warm-up; the interpreter's seconds a call are not what is measured)
        self.budget_fast = (0.005 if tiny else 0.25 * q, 1 if tiny else 10, 3 if tiny else 2000)
        self.budget_slow = (0.005 if tiny else 0.3 * q, 1 if tiny else 2, 3 if tiny else 500)

    # ------------------------------------------------------------ setup
    def make_weights(self) -> None:
        total = 0
        for spec in self.specs:
            copies = weight_copies(spec, self.rotate_bytes, 128, self.device, self.gen)
            self.weights[spec.name] = copies
            total += sum(w.nbytes for w in copies)
            log(f"weights {spec.name} {spec.shape_text}: {len(copies)} copies of {copies[0].nbytes / MB:.1f} MB")
        s = self.s
        w1 = fp4_stack(s.experts, s.inter, s.dim, GAINS.get("w1", 1.0), self.device, self.gen)
        w3 = fp4_stack(s.experts, s.inter, s.dim, GAINS.get("w3", 1.0), self.device, self.gen)
        w2 = fp4_stack(s.experts, s.dim, s.inter, GAINS.get("w2", 1.0), self.device, self.gen)
        self.experts = ExpertWeights(w1=w1, w3=w3, w2=w2, first_expert=0, swiglu_limit=s.swiglu_limit)
        self.row_experts = self.experts  # what the plain torch baseline reads (it dequantizes rows)
        if not self.args.expert_rows:  # the layout the engine loads them in (TritonKernels.prepare_experts)
            self.row_experts = ExpertWeights(*(QuantizedWeight(w.values.clone(), w.scales.clone(), w.fmt)
                                               for w in (w1, w3, w2)), first_expert=0, swiglu_limit=s.swiglu_limit)
            self.experts = self.tk.prepare_experts(self.experts)
        log(f"experts in the {'fragment' if self.experts.w1.fragments else 'checkpoint row'} layout")
        total += self.experts.nbytes
        self.timer.sync()
        log(f"experts: {s.experts} x FP4 ({self.experts.nbytes / GB:.2f} GB); all weights {total / GB:.2f} GB")

    def expert_bytes(self) -> int:
        return sum(w.values[0].nbytes + w.scales[0].nbytes for w in (self.experts.w1, self.experts.w3, self.experts.w2))

    # ------------------------------------------------------------ estimates (reference / torch)
    def mem_cap(self) -> float:
        if self.device.type != "cuda":
            return 2 * GB
        free, _ = torch.cuda.mem_get_info(self.device)
        return min(0.5 * free, 48 * GB)

    def reference_linear_cost(self, spec: LinearSpec, m: int) -> tuple[float, float]:
        """(seconds, bytes) the reference's block-scaled linear would need: K/32 fp32 partial products
        held together, then summed with their scales."""
        n, k, blocks = spec.groups * spec.n, spec.k, spec.k // 32
        if spec.groups > 1:  # dequantized bf16 weight and one einsum
            mem = n * k * 12 + m * spec.groups * (spec.n + spec.k) * 2
            secs = n * k * 20 / self.ceil.bandwidth + 2.0 * m * n * k / self.ceil.bf16_flops + 20 * self.launch_s
            return secs, mem
        partials = blocks * m * n * 4
        mem = partials + 2 * m * n * 4 + n * k * 8 + m * k * 8
        secs = (4 * partials + n * k * 12) / self.ceil.bandwidth + 2.0 * m * n * k / (self.ceil.bf16_flops / 16) \
            + 4 * blocks * self.launch_s
        return secs, mem

    def reference_moe_cost(self, hit: float, pairs: int) -> float:
        s = self.s
        per_expert = (4 * 2 * (s.dim // 32) + 4 * (s.inter // 32) + 40) * self.launch_s \
            + 3 * s.inter * s.dim * 40 / self.ceil.bandwidth
        return hit * per_expert + 6.0 * pairs * s.inter * s.dim / (self.ceil.bf16_flops / 16)

    def torch_moe_cost(self, hit: float, pairs: int) -> float:
        s = self.s
        return hit * (30 * self.launch_s + 3 * s.inter * s.dim * 40 / self.ceil.bandwidth) \
            + 6.0 * pairs * s.inter * s.dim / self.ceil.bf16_flops

    # ------------------------------------------------------------ FP8 linears
    def run_linear(self, spec: LinearSpec, m: int) -> Row:
        args, dev = self.args, self.device
        ws = self.weights[spec.name]
        decode = m <= DECODE_MAX_M
        nx = input_sets(m, spec.groups * spec.k * 2, decode)
        shape = (m, spec.groups, spec.k) if spec.groups > 1 else (m, spec.k)
        xs = [torch.randn(shape, device=dev, generator=self.gen).to(torch.bfloat16) for _ in range(nx)]
        grouped = spec.groups > 1
        tri = self.tk.grouped_dequantized_linear if grouped else self.tk.quantized_linear
        ref = self.rk.grouped_dequantized_linear if grouped else self.rk.quantized_linear
        plain = torch_grouped if grouped else torch_linear
        nw = len(ws)

        nbytes, flops = linear_bytes(spec, m, ws[0])
        mem_s, flop_s, limit_s, bound = limit_of(nbytes, flops, self.ceil)
        row = Row(spec.name, spec.shape_text, m, nbytes, flops, mem_s, flop_s, limit_s, bound)

        # correctness (and the first call of each backend)
        out = tri(xs[0], ws[0])
        ref_s, ref_mem = self.reference_linear_cost(spec, m)
        skip = None
        if args.no_reference:
            skip = "--no-reference"
        elif args.ref_max_m is not None and m > args.ref_max_m:
            skip = f"M > --ref-max-m {args.ref_max_m}"
        elif ref_mem > self.mem_cap():
            skip = f"needs ~{ref_mem / GB:.0f} GB"
        elif ref_s > args.ref_limit_s:
            skip = f"~{ref_s:.1f} s per call"
        if skip is None:
            expected = ref(xs[0], ws[0])
            row.rel_err = rel_err(out, expected)
        else:
            rows = check_rows(m, args.check_rows, dev)
            expected = ref(xs[0][rows], ws[0])
            row.rel_err, row.err_rows = rel_err(out[rows], expected), int(rows.numel())
        del out, expected
        check(spec.name, m, row.rel_err, "all rows" if row.err_rows is None else f"{row.err_rows} rows")

        fast, slow = self.budget_fast, self.budget_slow
        self._record_triton(row, self.measure_triton(lambda i: tri(xs[i % nx], ws[i % nw]), fast, decode))
        if skip is None:  # the check above was its first call
            row.reference_s = self.timer.measure(lambda i: ref(xs[i % nx], ws[i % nw]), *slow, warm=False).median_s
        else:
            row.reference_skipped = skip
        row.torch_s = self.timer.measure(lambda i: plain(xs[i % nx], ws[i % nw]), *slow).median_s
        del xs
        self._cleanup(big=not decode)
        return row

    # ------------------------------------------------------------ FP4 experts
    def routing_sets(self, m: int, count: int):
        sets = []
        for _ in range(count):
            x = torch.randn(m, self.s.dim, device=self.device, generator=self.gen).to(torch.bfloat16)
            sets.append((x, *random_routing(m, self.s, self.device, self.gen)))
        return sets

    def run_moe(self, m: int) -> Row:
        args, s, dev, experts = self.args, self.s, self.device, self.experts
        decode = m <= DECODE_MAX_M
        sets = self.routing_sets(m, 8 if decode else 2)
        n = len(sets)
        pairs = m * s.top_k
        hit = statistics.mean(int(torch.unique(st[2]).numel()) for st in sets)
        nbytes = hit * self.expert_bytes() + m * s.dim * 2 + pairs * s.dim * 2 + pairs * (8 + 8 + 4)
        flops = 2.0 * pairs * (2 * s.inter * s.dim + s.dim * s.inter)
        mem_s, flop_s, limit_s, bound = limit_of(nbytes, flops, self.ceil)
        label = f"{s.experts}x FP4 top-{s.top_k}"
        row = Row("moe.experts", label, m, nbytes, flops, mem_s, flop_s, limit_s, bound,
                  extra={"experts_hit": hit, "pairs": pairs})

        def tri(st):
            return self.tk.expert_outputs(st[0], st[1], st[2], st[3], experts)

        def ref(st):
            return self.rk.expert_outputs(st[0], st[1], st[2], st[3], experts)

        def plain(st):
            return torch_moe(st[0], st[1], st[2], st[3], self.row_experts, s.swiglu_limit)

        out = tri(sets[0])
        ref_s = self.reference_moe_cost(hit, pairs)
        skip = None
        if args.no_reference:
            skip = "--no-reference"
        elif m > args.moe_ref_max_m:
            skip = f"M > {args.moe_ref_max_m}"
        elif ref_s > args.ref_limit_s:
            skip = f"~{ref_s:.1f} s per call"
        if skip is None:
            expected = ref(sets[0])
            row.rel_err = rel_err(out, expected)
        else:  # the pairs of a few tokens, spread over the batch
            x, pair_token, pair_expert, pair_weight = sets[0]
            tokens = check_rows(m, args.check_tokens, dev)
            sel = (tokens[:, None] * s.top_k + torch.arange(s.top_k, device=dev)).reshape(-1)
            sub_token = torch.arange(tokens.numel() * s.top_k, device=dev) // s.top_k
            expected = self.rk.expert_outputs(x[tokens], sub_token, pair_expert[sel], pair_weight[sel], experts)
            row.rel_err, row.err_rows = rel_err(out[sel], expected), int(sel.numel())
        del out, expected
        check("moe.experts", m, row.rel_err, "all pairs" if row.err_rows is None else f"{row.err_rows} pairs")

        fast, slow = self.budget_fast, self.budget_slow
        self._record_triton(row, self.measure_triton(lambda i: tri(sets[i % n]), fast, decode))
        if skip is None:  # the check above was its first call
            row.reference_s = self.timer.measure(lambda i: ref(sets[i % n]), *slow, warm=False, syncs=True).median_s
        else:
            row.reference_skipped = skip
        torch_s = self.torch_moe_cost(hit, pairs)
        if torch_s > args.ref_limit_s:
            row.torch_skipped = f"~{torch_s:.1f} s per call"
        else:
            row.torch_s = self.timer.measure(lambda i: plain(sets[i % n]), *slow, syncs=True).median_s
        del sets
        self._cleanup(big=not decode)
        return row

    # ------------------------------------------------------------ one layer's FP8 linears, one graph
    def run_layer_graph(self, m: int, kernels, inputs_in_l2: bool = False, fp8_ready: bool = True) -> dict:
        """The layer's FP8 projections in one CUDA graph, per layer. Each input is made before the graph, and
        the layer instances' weights push it out of L2 before it is read. ``inputs_in_l2``: each input is
        written just before its projection (a copy from a source of its own), as in the engine, where the
        kernel before a projection writes its input; the time of a graph of those copies alone is taken off.
        ``fp8_ready``: the inputs are FP8-ready rows, as the model gives them (``layer_calls``)."""
        dev, instances = self.device, self.args.graph_layers
        calls = []  # (names, input, call) per projection or pair of one input, per layer instance
        for layer in range(instances):
            calls += layer_calls(self.specs, lambda name: self.weights[name][layer % len(self.weights[name])],
                                 kernels, m, self.gen, dev, fp8_ready=fp8_ready)
        names = [name for group, _, _ in calls for name in group]
        sources = [x.clone() for _, x, _ in calls] if inputs_in_l2 else []

        def copies():
            for (_, x, _), source in zip(calls, sources):
                x.copy_(source)

        def run_all():
            outs = []
            for i, (_, x, call) in enumerate(calls):
                if inputs_in_l2:
                    x.copy_(sources[i])
                outs += call()
            return outs

        eager = run_all()  # also compiles and allocates outside the capture
        graph, captured = capture_on_this_stream(run_all)
        graph.replay()
        torch.cuda.synchronize()
        for out, ref, name in zip(captured, eager, names, strict=True):
            if not torch.equal(out, ref):
                raise CorrectnessError(f"{name} at M={m}: CUDA graph replay differs from the eager call")
        t = self.timer.measure(lambda i: graph.replay(), *self.budget_fast)
        graph_s = t.median_s
        if inputs_in_l2:
            copy_graph, _ = capture_on_this_stream(copies)
            graph_s -= self.timer.measure(lambda i: copy_graph.replay(), *self.budget_fast).median_s
            del copy_graph
        per_layer = graph_s / instances
        mem_s = flop_s = limit_s = 0.0
        for spec in self.specs:
            nbytes, flops = linear_bytes(spec, m, self.weights[spec.name][0])
            a, b, c, _ = limit_of(nbytes, flops, self.ceil)
            mem_s, flop_s, limit_s = mem_s + a, flop_s + b, limit_s + c
        summed = sum(r.triton_s for r in self.rows if r.m == m and r.kernel in {s.name for s in self.specs})
        bytes_total = sum(linear_bytes(s, m, self.weights[s.name][0])[0] for s in self.specs)
        del graph, captured, eager, calls, sources
        self._cleanup(big=False)
        return {"m": m, "graph_s": per_layer, "sum_s": summed, "mem_limit_s": mem_s, "flop_limit_s": flop_s,
                "limit_s": limit_s, "bytes": bytes_total, "instances": instances,
                "pct_mem_limit": mem_s / per_layer, "pct_limit": limit_s / per_layer,
                "sum_pct_mem_limit": mem_s / summed if summed else None}

    def measure_triton(self, call, budget, decode: bool) -> Timing:
        """Device time of ``call(i)``. At decode sizes on CUDA, ``GRAPH_CALLS`` calls (rotating
        inputs and weights) are captured in one CUDA graph and replayed, and the time is per call:
        a few-microsecond kernel costs more host time to launch from Python than device time, which
        no head start hides; in the engine, decode steps replay graphs too (or will)."""
        if not (decode and self.device.type == "cuda"):  # (on CPU the interpreter has nothing to warm up)
            return self.timer.measure(call, *budget, warm=self.device.type == "cuda")
        def calls():
            for i in range(GRAPH_CALLS):
                call(i)

        calls()  # compile and allocate outside the capture
        graph, _ = capture_on_this_stream(calls)
        t = self.timer.measure(lambda i: graph.replay(), *budget)
        del graph
        return replace(t, median_s=t.median_s / GRAPH_CALLS, min_s=t.min_s / GRAPH_CALLS)

    @staticmethod
    def _record_triton(row: Row, t: Timing) -> None:
        row.triton_s = t.median_s
        row.extra.update(triton_min_s=t.min_s, triton_reps=t.reps)
        if t.launch_gaps:
            row.extra["triton_launch_gaps"] = True
            log(f"  note: {row.kernel} M={row.m}: the host could not stay ahead; launch gaps are in the time")

    def _cleanup(self, big: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            if big:
                torch.cuda.empty_cache()

    # ------------------------------------------------------------ tile-config sweep

# ----------------------------------------------------------------------------------- report
# ----------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv, description=__doc__.split("\n")[0])
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported
    _import_kernels()
    if args.tensor_core_experts is not None:
        tile_configs.MMA_EXPERTS_MAX_PAIRS = args.tensor_core_experts
    if args.unsorted_pairs is not None:
        tile_configs.MMA_EXPERTS_UNSORTED_PAIRS = args.unsorted_pairs
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))  # one stream for everything, graphs included
    shapes = TINY if args.tiny else FLASH
    shapes_name = "tiny" if args.tiny else "DeepSeek-V4.1-Flash"
    log(f"{shapes_name} shapes on {device}; M = {args.ms}")

    timer = Timer(device)
    env = env_info(device)
    ceil = measure_ceilings(device, timer, args.tiny, 0.005 if args.tiny else 0.5)
    bench = Bench(args, device, shapes, ceil, timer)
    if args.kernels:
        wanted = [w.strip() for w in args.kernels.split(",") if w.strip()]
        bench.specs = [s for s in bench.specs if any(w in s.name for w in wanted)]
        do_moe = any(w in "moe.experts" for w in wanted)
    else:
        do_moe = True
    bench.make_weights()

    error = None
    try:
        if not args.tune_only:
            for m in args.ms:
                for spec in bench.specs:
                    row = bench.run_linear(spec, m)
                    bench.rows.append(row)
                    log(progress_line(row))
                if do_moe:
                    row = bench.run_moe(m)
                    bench.rows.append(row)
                    log(progress_line(row) + f"  experts hit {row.extra['experts_hit']:.0f}")
                if (device.type == "cuda" and not args.no_graph and m <= DECODE_MAX_M
                        and len(bench.specs) == len(linear_specs(shapes))):
                    entry = bench.run_layer_graph(m, bench.tk)
                    if args.pdl:  # the same graph launched the usual way, for comparison in the same run
                        usual = TritonKernels(batch_invariant=args.batch_invariant)
                        entry["graph_without_pdl_s"] = bench.run_layer_graph(m, usual)["graph_s"]
                    if args.inputs_in_l2:
                        entry["graph_inputs_in_l2_s"] = bench.run_layer_graph(m, bench.tk, inputs_in_l2=True)["graph_s"]
                    if args.plain_inputs:
                        entry["graph_plain_inputs_s"] = bench.run_layer_graph(m, bench.tk, fp8_ready=False)["graph_s"]
                    bench.layer.append(entry)
                    log(f"layer FP8 linears M={m}: graph {us(entry['graph_s'])} us, sum {us(entry['sum_s'])} us, "
                        f"memory limit {us(entry['mem_limit_s'])} us -> {entry['pct_mem_limit']:.0%}"
                        + (f"; plain inputs {us(entry['graph_plain_inputs_s'])} us" if args.plain_inputs else "")
                        + (f"; without PDL {us(entry['graph_without_pdl_s'])} us" if args.pdl else "")
                        + (f"; inputs in L2 {us(entry['graph_inputs_in_l2_s'])} us" if args.inputs_in_l2 else ""))
                    # (the matrix-vector kernel's sizes and the decode form's)
                    if args.tune_layer_gemv and m <= tile_configs.decode_form_max_tokens(fp8=True):
                        entry["gemv_launches"] = run_layer_gemv_tune(bench, m)
                    if matrix_vector_kernel(m) is triton_gemv:
                        # the products' configs on triton_gemv (one or two tokens), each in the same graph
                        entry["gemv_configs"] = {}
                        for fields in args.gemv_configs:
                            with override_tables(gemv=tile_configs.DecodeConfig(**fields)):
                                graph_s = bench.run_layer_graph(m, bench.tk)["graph_s"]
                            entry["gemv_configs"][cfg_text(fields)] = graph_s
                            log(f"layer FP8 linears M={m} with triton_gemv {cfg_text(fields)}: graph "
                                f"{us(graph_s)} us -> {entry['mem_limit_s'] / graph_s:.0%}")
        if args.tune:
            run_tune(bench, args.ms)
    except CorrectnessError as exc:
        error = str(exc)
    finally:
        if args.json:
            doc = {"env": env, "shapes": asdict(shapes), "ceilings": asdict(ceil), "args": vars(args),
                   "results": [dict(asdict(r), pct_limit=r.pct_limit) for r in bench.rows],
                   "layer": bench.layer, "tune": bench.tune, "error": error,
                   "elapsed_s": time.perf_counter() - STARTED}
            Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
            log(f"wrote {args.json}")

    if bench.tune:
        print(tune_markdown(bench))
        print()
    if bench.rows or bench.layer:
        print(markdown(env, ceil, bench, shapes_name))
    if error:
        print(error, file=sys.stderr)
        print(error)
        return 1
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
