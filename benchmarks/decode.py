"""Decode throughput of the offline engine, next to the limit of the hardware it runs on.

    python benchmarks/decode.py --preset v41-flash-L8 --kernels triton,triton-eager --batch 1,64,256
    python benchmarks/decode.py --dp 2 --kernels triton --batch 32,128,256   # two GPUs, batch per GPU

Runs the offline engine (``frontend.llm.LLM``: in-process, or one worker process per GPU with
``--dp N``) with ``--load-format dummy`` weights (random, in their storage formats, made on the
device) on a config-only model directory written from a preset (or ``--model DIR``). For every
kernel backend and batch size: ``batch`` (per rank) token-id prompts of
``--context`` tokens, greedy, ``ignore_eos``. Once every sequence is decoding, ``--steps`` engine
steps are timed together (host clock between two device synchronisations; the engine keeps one
step queued ahead, as when serving) and their mean is the step time, so prefill and warm-up stay
outside it; every batch is run once before, untimed and as long (compilation, allocator, first graph
launches).
The time the host spends waiting for the steps' results is printed next to the step time
(``timed_collects``): a step the host waits for is bound by the device, one it does not wait for by
the host's own work. With CUDA graphs, the median device time of one graph replay (the forward and
the head; ``ReplayTimer``) is printed too: the step time less that is the sampler, the copies and any
time the device waited. The share of the step outside the replays (from their mean) is thus an upper
bound, from CUDA events alone, on the GPU's idle time between decode steps.

The limit of a step is what the device must at least do: read every weight the step touches once
(the dense weights, the head and the expected number of distinct routed experts hit by
``batch * top_k`` uniformly routed pairs, in their checkpoint formats; the dummy routers' zero biases
spread a batch that way, ``model/dummy_weights.py``) plus the KV entries it
attends to, at the bandwidth measured here; and the step's matrix FLOPs at the bf16 tensor-core
rate measured here (both by ``benchmarks/device_limits.py``, as for ``benchmarks/kernels.py``).
``limit = max(bytes / bandwidth, flops / peak)``, per GPU: with ``--dp N`` each GPU holds 1/N of
the experts, hit by the tokens of every rank. Prefill is reported as prompt tokens over the time
from submission until every sequence has produced its first decode token (so it includes one or two
decode steps: meaningful for long prompts), next to the tensor-core limit of a prompt token
(``prefill_flops_per_token``: the weights' products plus the attention's, averaged over the
prompt's positions, at the measured bf16 rate). With ``--profile-batch B`` a few steps at batch B are
traced (torch.profiler) and the GPU's idle share between and within them is printed.

``--max-model-len`` (default: the context plus the steps and a few tokens) is also the longest
context the decode graphs are captured for (powers of two up to it), so it decides which bucket a
step replays: with the default, an 8K context runs in an 8,216-token bucket.

The whole benchmark runs on one CUDA stream, which the in-process engine adopts: a process that has
run kernels on a second stream replays every graph slower (``workers/worker_stream.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.device_limits import Timer, measure_ceilings  # noqa: E402
from engine_core.protocol import SamplingParams  # noqa: E402
from frontend.llm import LLM  # noqa: E402
from model.cache_formats import COMPRESSED_KV, INDEX_KEYS, WINDOW_KV  # noqa: E402
from model.config import V41Config  # noqa: E402
from model.kernels import tile_configs  # noqa: E402
from model.loader import checkpoint_bytes, held_weight_bytes  # noqa: E402
from model.weight_spec import checkpoint_tensors  # noqa: E402

_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


def step_cost(cfg: V41Config, batch: int, context: int, dp: int = 1) -> tuple[float, float]:
    """(bytes, FLOPs) one GPU must at least move/do in a decode step of ``batch`` sequences per rank at
    ``context`` tokens; with ``dp`` ranks each holds 1/dp of the experts, hit by every rank's tokens."""
    dense_bytes = expert_bytes = 0
    dense_params = 0
    for name, spec in checkpoint_tensors(cfg).items():
        size = math.prod(spec.shape) * _BYTES[spec.dtype]
        if ".ffn.experts." in name:
            expert_bytes += size
        elif "engram.embed" in name or name == "embed.weight":
            continue  # only gathered rows are read
        else:
            dense_bytes += size
            if spec.dtype != "F8_E8M0" and len(spec.shape) == 2:
                dense_params += math.prod(spec.shape) * (2 if spec.dtype == "I8" else 1)
    experts, top_k = cfg.num_routed_experts, cfg.num_experts_per_token
    hit = experts * (1 - (1 - top_k / experts) ** (batch * dp))  # expected distinct experts per layer
    touched_expert_bytes = expert_bytes * hit / experts / dp
    # KV read per sequence, in the cache's storage formats: the window ring of every layer, the
    # selected compressed entries of every compressed layer, and the index keys an indexer scores
    window_row, entry_row = WINDOW_KV.row_bytes(cfg.head_dim), COMPRESSED_KV.row_bytes(cfg.head_dim)
    key_row = INDEX_KEYS.row_bytes(cfg.index_head_dim)
    kv = 0
    for role in cfg.roles:
        kv += min(context, cfg.sliding_window) * window_row
        if role.compress_ratio:
            entries = context // role.compress_ratio
            kv += min(entries, cfg.index_topk) * entry_row
            if role.runs_indexer:
                kv += entries * key_row
    engram_rows = len(cfg.engram_layer_ids) * cfg.num_hash_columns * cfg.engram_head_dim * batch
    total_bytes = dense_bytes + touched_expert_bytes + kv * batch + engram_rows
    inter, d = cfg.moe_intermediate_size, cfg.hidden_size
    flops = 2 * batch * (dense_params + cfg.num_layers * top_k * 3 * inter * d)
    return total_bytes, flops


def prefill_flops_per_token(cfg: V41Config, context: int) -> float:
    """Matrix FLOPs per prompt token of a ``context``-token prefill, averaged over its positions: the
    weights' products (as a one-token decode step, the head for the last token only) plus the attention's: window and selected
    compressed entries (QK and PV over every head) and the indexer's scores over the visible entries."""
    positions = torch.arange(1, context + 1, dtype=torch.float64)  # tokens visible to each query
    heads, head_dim = cfg.num_heads, cfg.head_dim
    attention = 0.0
    for role in cfg.roles:
        attention += 4 * heads * head_dim * positions.clamp(max=cfg.sliding_window).mean().item()
        if role.compress_ratio:
            entries = torch.div(positions, role.compress_ratio, rounding_mode="floor")
            attention += 4 * heads * head_dim * entries.clamp(max=cfg.index_topk).mean().item()
            if role.runs_indexer:
                attention += 2 * cfg.index_num_heads * cfg.index_head_dim * entries.mean().item()
    head = 2 * cfg.vocab_size * cfg.hidden_size * (1 - 1 / context)  # logits of the last prompt token only
    return step_cost(cfg, 1, context)[1] - head + attention


@contextlib.contextmanager
def timed_collects(engine):
    """Seconds the host spends in the in-process runner's ``collect`` (the wait for a step's results,
    then their conversion): a list whose one element grows while the context is open. The rest of a
    step's time is the host's own work; a step that waits is bound by the device. With ``--dp N``
    (the ranks run in processes of their own) nothing is timed: the element stays None."""
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        yield [None]
        return
    waited = [0.0]
    collect = runner.collect

    def timed(pending):
        start = time.perf_counter()
        try:
            return collect(pending)
        finally:
            waited[0] += time.perf_counter() - start

    runner.collect = timed
    try:
        yield waited
    finally:
        del runner.collect  # the class's method again


class ReplayTimer:
    """Device time of each decode-graph replay while open: CUDA events recorded around
    ``DecodeGraphs.replay``, so the forward and the head of a step alone, without the sampler, the
    result copies or the host's part. Against the step time it tells whether a slower step spends
    its time inside the graph or around it. Nothing is timed without graphs (CPU, ``--enforce-eager``)
    or with ``--dp N`` (the ranks run in processes of their own)."""

    def __init__(self, engine):
        runner = getattr(engine.executor, "runner", None)
        self.graphs = getattr(runner, "graphs", None)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> "ReplayTimer":
        if self.graphs is not None:
            replay = type(self.graphs).replay

            def timed(bucket, num_rows):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return replay(self.graphs, bucket, num_rows)
                finally:
                    end.record()
                    self.events.append((start, end))

            self.graphs.replay = timed
        return self

    def __exit__(self, *exc) -> None:
        if self.graphs is not None:
            del self.graphs.replay  # the class's method again
        # the events are all it needs now: holding the graphs would keep the engine's model and caches
        # alive after the LLM closes (the next backend's engine then found no memory for its cache)
        self.graphs = None

    def times_us(self) -> list[float]:
        """Microseconds of each replay timed, sorted (read after a device synchronisation)."""
        return sorted(start.elapsed_time(end) * 1e3 for start, end in self.events)

    def median_us(self) -> float | None:
        """Median microseconds of the replays timed, or None."""
        times = self.times_us()
        return times[len(times) // 2] if times else None

    def mean_us(self) -> float | None:
        """Mean microseconds of the replays timed, or None."""
        times = self.times_us()
        return sum(times) / len(times) if times else None


def outside_graphs_pct(step_s: float, mean_replay_us: float | None) -> float | None:
    """Share of a decode step the device spent outside its graph replay (CUDA events): the sampler,
    the copies and the time it waited for the host. It bounds the GPU's idle time between steps from
    above without a profiler's own overhead; None without graphs."""
    if mean_replay_us is None:
        return None
    return max(0.0, 100 * (1 - mean_replay_us * 1e-6 / step_s))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_step_times(llm: LLM, prompts: list[list[int]], steps: int,
                      around_steps=None) -> tuple[float, float, float | None]:
    """(prefill seconds, seconds per decode step over ``steps`` steady-state steps, seconds per step
    the host waited for results: ``timed_collects``, None with ``--dp N``).

    The steps are timed together, between two device synchronisations: as when serving, the engine
    launches step N+1 before it waits for step N, so the host's work for a step overlaps the
    device's work for the one before; a synchronisation after every step would serialize them.
    ``around_steps``: a context manager entered around the timed steps only (a profiler)."""
    from engine_core.protocol import AddRequest

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"bench-{next(llm._ids)}" for _ in prompts]
    produced = dict.fromkeys(ids, 0)
    synchronize()
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(AddRequest(request_id, prompt, params))
    while min(produced.values()) < 2:  # every prompt prefilled and decoding
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    synchronize()
    prefill = time.perf_counter() - start
    with around_steps if around_steps is not None else contextlib.nullcontext(), timed_collects(engine) as waited:
        start = time.perf_counter()
        for _ in range(steps):  # each call launches one step and collects the one before
            for out in engine.step():
                produced[out.request_id] += len(out.new_token_ids)
        synchronize()
        elapsed = time.perf_counter() - start
    while engine.has_work:
        engine.step()
    return prefill, elapsed / steps, None if waited[0] is None else waited[0] / steps


def profile_steps(llm: LLM, prompts: list[list[int]], out_path: str) -> None:
    """Where a decode step's time goes: device kernels by total time, and the host's share."""
    from torch.profiler import ProfilerActivity, profile

    from torch.autograd import DeviceType

    steps = 4
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    decode_step_times(llm, prompts, steps, around_steps=prof)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=200)
    busy, span = device_busy(prof)
    launches = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA) / steps
    summary = (f"device busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms from the first to the last device activity "
               f"of the {steps} profiled steps: GPU idle {100 * (1 - busy / span):.1f}% (union of kernel, copy and "
               f"set intervals from the profiler trace, whose own host overhead it includes); {launches:.0f} device "
               f"activities per step" if span else "no device activity recorded")
    Path(out_path).write_text(table + "\n" + summary + "\n")
    print(table[:6000], flush=True)
    print(summary, flush=True)


def device_busy(prof) -> tuple[float, float]:
    """(microseconds the device was running something, microseconds from its first to its last
    activity) in a profiler trace: the union of the device-side intervals, so overlapping streams
    count once."""
    from torch.autograd import DeviceType

    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not intervals:
        return 0.0, 0.0
    busy, (start, end) = 0.0, intervals[0]
    for a, b in intervals[1:]:
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    return busy, max(b for _, b in intervals) - intervals[0][0]


# the suffixes of --kernels that change ``tile_configs`` for their engine: (attribute, value) pairs
TABLE_SUFFIXES: dict[str, tuple[tuple[str, object], ...]] = {
    "notcx": (("MMA_EXPERTS_MAX_PAIRS", 0.0),),
    "sort": (("MMA_EXPERTS_UNSORTED_PAIRS", 0),),
    "noshape": (("_GEMV_BY_SHAPE", {}), ("_FP8_DECODE_BY_SHAPE", {}), ("_DECODE_MM_BY_SHAPE", {})),
    "noready": (("ROUND_TRIP_IN_PRODUCERS", False),),
    "noside": (("SIDE_STREAM", False),),
    "norope": (("ROPE_IN_CONSUMERS", False),),
    "ringapart": (("RING_WRITE_IN_WINDOW_KV", False),),
}


def tile_table_defaults() -> dict[str, object]:
    """The process's values of every ``tile_configs`` attribute that a suffix changes."""
    return {attr: getattr(tile_configs, attr) for changes in TABLE_SUFFIXES.values() for attr, _ in changes}


def set_tile_tables(suffixes: list[str], defaults: dict[str, object]) -> None:
    """One engine's ``tile_configs``: ``defaults`` (``tile_table_defaults``), then its suffixes' changes."""
    settings = dict(defaults)
    for suffix in suffixes:
        settings.update(TABLE_SUFFIXES.get(suffix, ()))
    for attr, value in settings.items():
        setattr(tile_configs, attr, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (config.json + tokenizer); default: written from --preset")
    parser.add_argument("--preset", default="v41-flash-L8")
    parser.add_argument("--kernels", default="triton,triton-eager,reference",
                        help="backends to run; suffixes: -bi turns --batch-invariant on, -eager turns CUDA graphs "
                             "off (--enforce-eager), -nozos zero-overhead scheduling off (--no-zos), -notcx the "
                             "routed experts on triton_moe instead of triton_mma_experts, -sort triton_mma_experts' "
                             "pair sort in every step, -noshape the per-launch configs set aside (each "
                             "kernel's table by M only), -noready every FP8 product of the decode and prefill forms rounding "
                             "its own input instead of its producer (ROUND_TRIP_IN_PRODUCERS off), -noside mHC's "
                             "coefficients, the shared expert, the compressors and Engram's lookups on the caller's "
                             "stream instead of a second one "
                             "(SIDE_STREAM off; list it before any engine that uses the side stream: a process "
                             "that ran kernels on a second stream replays graphs slower), -norope RoPE in launches "
                             "of its own, not in the FP4 round trips' and the attention's combining launch "
                             "(ROPE_IN_CONSUMERS off), -ringapart a decode step's window rows stored in the "
                             "rings by a launch of their own (RING_WRITE_IN_WINDOW_KV off; "
                             "these seven: in-process "
                             "engine only), -pdl programmatic dependent launch on (--enable-pdl) for that "
                             "run")
    parser.add_argument("--batch", default="1,8,32,128,256", help="sequences per DP rank")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel ranks (one GPU each, experts sharded): batch sizes are per rank")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="prefill chunk per step (default: max(2048, min(8 x context, 8192)); the torch "
                             "indexer of a prefill chunk holds chunk x context / ratio keys)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's limit, and the longest context its decode graphs are captured for "
                             "(default: context + steps + 8)")
    parser.add_argument("--reference-max-batch", type=int, default=8,
                        help="largest batch run with the reference kernels (they are slow)")
    parser.add_argument("--reference-steps", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile-batch", type=int, default=0,
                        help="profile a few decode steps of the first backend at this batch (torch.profiler)")
    parser.add_argument("--profile-out", default="decode_profile.txt")
    parser.add_argument("--hf-overrides", metavar="JSON", default=None,
                        help="values that replace config.json's, as the engine's flag: e.g. "
                             "'{\"num_hidden_layers\": 6, \"n_routed_experts\": 16}'")
    args = parser.parse_args()
    device = "cuda"
    if args.model is None:
        from model.checkpoint_maker import make_checkpoint

        args.model = str(make_checkpoint(Path(tempfile.mkdtemp()) / args.preset, preset=args.preset, config_only=True))
    cfg = V41Config.from_pretrained(Path(args.model), json.loads(args.hf_overrides or "{}"))
    # all of this process's device work on one stream, which the in-process engine adopts: a kernel run
    # on a second stream slows every graph replay after it (workers/worker_stream.py)
    torch.cuda.set_stream(torch.cuda.Stream())
    ceilings = measure_ceilings(torch.device(device), Timer(torch.device(device)), tiny=False, budget=0.5)
    bandwidth, peak = ceilings.bandwidth, ceilings.bf16_flops
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s; "
          f"torch {torch.__version__}; model {args.model}", flush=True)
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    default_tables = tile_table_defaults()
    for variant in args.kernels.split(","):
        kernels, *suffixes = variant.split("-")
        batch_invariant, eager, zos = "bi" in suffixes, "eager" in suffixes, "nozos" not in suffixes
        if set(TABLE_SUFFIXES) & set(suffixes) and args.dp != 1:
            parser.error(f"{', '.join('-' + s for s in TABLE_SUFFIXES)} set tile tables of this process: they need "
                         "the in-process engine (--dp 1)")
        set_tile_tables(suffixes, default_tables)
        runnable = [b for b in batches if kernels != "reference" or b <= args.reference_max_batch]
        if not runnable:
            continue
        steps = args.steps if kernels != "reference" else args.reference_steps
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        llm = LLM(args.model, device=device, kernels=kernels, batch_invariant=batch_invariant, load_format="dummy",
                  enforce_eager=eager, zos=zos, enable_pdl="pdl" in suffixes,
                  max_num_seqs=max(runnable),
                  max_num_batched_tokens=args.max_num_batched_tokens or max(2048, min(args.context * 8, 8192)),
                  max_model_len=args.max_model_len or args.context + steps + 8,
                  gpu_memory_utilization=0.85, dp_size=args.dp, hf_overrides=args.hf_overrides)
        load_s = time.perf_counter() - started
        held_gib = expected_gib = None
        if args.dp == 1:  # the in-process engine: its weights can be counted here
            runner = llm.engine.executor.runner
            allocated_gib = (torch.cuda.memory_allocated() - before) / 2**30
            held_gib = held_weight_bytes(runner.model) / 2**30
            expected_gib = checkpoint_bytes(runner.cfg, range(runner.cfg.num_routed_experts)) / 2**30
            del runner
            print(f"# {variant}: engine ready in {load_s:.1f} s; weights held {held_gib:.2f} GiB for "
                  f"{expected_gib:.2f} GiB of checkpoint tensors ({100 * (held_gib / expected_gib - 1):+.1f}%); GPU "
                  f"memory allocated {allocated_gib:.1f} GiB with the caches", flush=True)
        else:
            print(f"# {variant}: {args.dp} ranks ready in {load_s:.1f} s (weights and caches: each rank's log)",
                  flush=True)
        for batch in runnable:
            prompts = [[(s * 7919 + t * 104729) % (cfg.vocab_size - 10) + 5 for t in range(args.context)]
                       for s in range(batch * args.dp)]
            # warm-up: compilation, allocator, the batch's graphs; as many steps as are timed, so that the
            # timed steps meet no position (and no kernel specialisation) the warm-up did not
            decode_step_times(llm, prompts, steps)
            replays = ReplayTimer(llm.engine)
            prefill, step, waited = decode_step_times(llm, prompts, steps, around_steps=replays)
            graph_us = replays.median_us()
            outside = outside_graphs_pct(step, replays.mean_us())
            nbytes, flops = step_cost(cfg, batch, args.context, args.dp)
            limit = max(nbytes / bandwidth, flops / peak)
            prefill_rate = batch * args.dp * args.context / prefill
            prefill_limit = peak / prefill_flops_per_token(cfg, args.context)  # tokens/s on the tensor cores
            row = dict(kernels=variant, batch=batch, dp=args.dp, context=args.context, step_ms=step * 1e3,
                       prefill_tokens_per_s=prefill_rate, prefill_limit_tokens_per_s=prefill_limit,
                       tokens_per_s=batch * args.dp / step, tokens_per_s_per_gpu=batch / step, limit_ms=limit * 1e3, pct_of_limit=100 * limit / step,
                       bytes_per_step_gb=nbytes / 1e9, prefill_s=prefill, weights_gib=held_gib,
                       checkpoint_gib=expected_gib, host_wait_ms=None if waited is None else waited * 1e3, graph_replay_us=graph_us,
                       outside_graphs_pct=outside)
            rows.append(row)
            if batch == args.profile_batch and variant == args.kernels.split(",")[0] and args.dp == 1:
                profile_steps(llm, prompts, args.profile_out)
            wait = "not timed with --dp" if waited is None else f"{waited * 1e3:.2f} ms/step"
            graph = "" if graph_us is None else (f", graph replay {graph_us:.1f} us (median), device outside "
                                                 f"the replays {outside:.1f}% of the step")
            print(f"{variant:10s} batch {batch:4d} x {args.dp}: step {step * 1e3:8.2f} ms, "
                  f"{batch * args.dp / step:8.1f} tok/s ({batch / step:.1f} per GPU), "
                  f"limit {limit * 1e3:6.3f} ms ({100 * limit / step:5.1f}% of it), "
                  f"{nbytes / 1e9:.2f} GB/step, host waited for results {wait}{graph}; prefill "
                  f"{prefill_rate:.0f} tok/s ({100 * prefill_rate / prefill_limit:.1f}% of the tensor-core limit "
                  f"{prefill_limit:.0f}; includes the first decode steps)", flush=True)
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| kernels | batch per rank x ranks | step (ms) | tokens/s | per GPU | limit (ms) | % of limit |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernels']} | {r['batch']} x {r['dp']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s_per_gpu']:.1f} | {r['limit_ms']:.3f} | {r['pct_of_limit']:.1f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, bandwidth=bandwidth, bf16_peak=peak, rows=rows),
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
