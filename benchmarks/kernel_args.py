"""The command line of ``benchmarks/kernels.py`` (its docstring says what each option measures)."""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_tune import decode_config_fields


def parse_args(argv=None, description: str = ""):
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default=None, help="comma-separated token counts (default 1,8,64,256,4096,16384)")
    p.add_argument("--quick", action="store_true", help="M = 1,64,4096 and half the timing budget")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (needs --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (for the CPU under TRITON_INTERPRET=1)")
    p.add_argument("--json", default=None, help="write every number to this file")
    p.add_argument("--tune", action="store_true", help="also sweep tile configs at the M values")
    p.add_argument("--tune-only", action="store_true", help="only the tile-config sweep")
    p.add_argument("--kernels", default=None, help="comma-separated subset of kernel names (substring match)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference timings (checks still run)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph layer measurement")
    p.add_argument("--ref-limit-s", type=float, default=2.0,
                   help="skip the reference / torch timing where one call is estimated to take longer (2.0)")
    p.add_argument("--ref-max-m", type=int, default=None, help="skip the FP8 reference timing above this M")
    p.add_argument("--moe-ref-max-m", type=int, default=2048, help="skip the expert reference above this M (2048)")
    p.add_argument("--check-rows", type=int, default=64, help="rows checked where the reference is skipped (64)")
    p.add_argument("--check-tokens", type=int, default=4, help="tokens checked where the expert reference is skipped")
    p.add_argument("--graph-layers", type=int, default=4, help="layer instances captured in the CUDA graph (4)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the Triton backend's batch-invariant mode (no split-K decode form)")
    p.add_argument("--expert-rows", action="store_true",
                   help="keep the FP4 experts in the checkpoint's row layout (the kernels' other path)")
    p.add_argument("--tensor-core-experts", type=float, default=None,
                   help="routed experts with at most this many pairs per expert on average take the tensor-core "
                        "kernels fed from registers (triton_mma_experts; 0: none; default: "
                        "tile_configs.MMA_EXPERTS_MAX_PAIRS)")
    p.add_argument("--unsorted-pairs", type=int, default=None,
                   help="steps of at most this many pairs skip triton_mma_experts' pair sort (0: every step "
                        "sorts; default: tile_configs.MMA_EXPERTS_UNSORTED_PAIRS)")
    p.add_argument("--inputs-in-l2", action="store_true",
                   help="the layer graph also with each input written just before its projection, as the kernel "
                        "before it writes it in the engine (the copies' own time taken off)")
    p.add_argument("--plain-inputs", action="store_true",
                   help="the layer graph also with plain inputs, each product rounding its own activation through "
                        "FP8 in a launch of its own (the model gives them FP8-ready rows: model/kernels/backend.py)")
    p.add_argument("--pdl", action="store_true",
                   help="the Triton kernels with programmatic dependent launch (--enable-pdl); the layer graph "
                        "is then also timed without it")
    p.add_argument("--gemv-configs", default=None,
                   help="also time the layer graph of each M that takes triton_gemv with each of these configs, "
                        "comma-separated, in the tile sweep's form (e.g. w32/k128/warps4/s1/pps4: 32 rows x "
                        "128 columns a step, 4 warps, the weight in registers (s1) or through a ring of that "
                        "many tiles in shared memory (s3, s4, ...), split-K until 4 programs per SM)")
    p.add_argument("--tune-layer-gemv", action="store_true",
                   help="at each M that takes triton_gemv or the decode form (triton_decode_mm) also time each "
                        "launch of the layer graph under that kernel's candidate configs, then the graph with each "
                        "launch's best (benchmarks/layer_gemv_tune.py)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.gemv_configs = [gemv_config_fields(text) for text in (args.gemv_configs or "").split(",") if text]
    except ValueError as exc:
        p.error(str(exc))
    if args.m is None:
        if args.tiny:
            args.m = "1,64" if args.quick else "1,8,64,300"
        else:
            args.m = "1,64,4096" if args.quick else "1,8,64,256,4096,16384"
    args.ms = [int(v) for v in args.m.split(",") if v.strip()]
    if any(m < 1 for m in args.ms):
        p.error("--m values must be >= 1")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cpu") and not args.tiny:
        p.error("the real shapes on the CPU would take hours: use --tiny (with TRITON_INTERPRET=1)")
    if args.tune_only:
        args.tune = True
    return args


def gemv_config_fields(text: str) -> dict:
    """A ``triton_gemv`` config in the tile sweep's form (``w32/k512/warps4/s3/pps1``) -> its fields."""
    fields = decode_config_fields(text)
    if 32 % fields["block_w"] or fields["block_k"] % 32:
        raise ValueError(f"triton_gemv's rows divide 32 and its columns are whole 32-column blocks, got {text!r}")
    return fields
