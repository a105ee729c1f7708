"""What the kernel benchmark checks and compares against: relative errors against the reference,
the hardware limit of a call, how many input sets a call rotates over, and its time format.
(Shared by ``benchmarks/kernels.py`` and its tile sweep, ``benchmarks/kernel_tune.py``.)"""

from __future__ import annotations

import math

import torch

from benchmarks.device_limits import MB, Ceilings

MAX_REL_ERR = 1e-2


class CorrectnessError(RuntimeError):
    pass


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape:
        raise CorrectnessError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    scale = ref.abs().max().item()
    return (out - ref).abs().max().item() / max(scale, 1e-30)


def check(name: str, m: int, err: float, what: str) -> None:
    if not (err <= MAX_REL_ERR):
        banner = "!" * 78
        raise CorrectnessError(f"\n{banner}\nWRONG RESULT: {name} at M={m}: max |triton - reference| / max |reference| "
                               f"= {err:.3e} ({what}) > {MAX_REL_ERR:g}\n{banner}")


def check_rows(m: int, count: int, device) -> torch.Tensor:
    """Evenly spread row indices, first and last included."""
    return torch.linspace(0, m - 1, steps=min(m, count), device=device).round().long().unique()


# ----------------------------------------------------------------------------------- results


def limit_of(nbytes: float, flops: float, ceil: Ceilings) -> tuple[float, float, float, str]:
    mem_s, flop_s = nbytes / ceil.bandwidth, flops / ceil.bf16_flops
    return mem_s, flop_s, max(mem_s, flop_s), ("memory" if mem_s >= flop_s else "compute")


def linear_bytes(spec, m: int, w) -> tuple[float, float]:
    x_bytes = m * spec.groups * spec.k * 2
    out_bytes = m * spec.groups * spec.n * 2
    return w.nbytes + x_bytes + out_bytes, 2.0 * m * spec.groups * spec.n * spec.k


def input_sets(m: int, per_row_bytes: int, decode: bool) -> int:
    if not decode:
        return 2
    return max(2, min(8, math.ceil(64 * MB / max(1, m * per_row_bytes))))


def us(seconds: float | None) -> str:
    """Seconds as microseconds for the tables ("-" when not measured)."""
    if seconds is None:
        return "-"
    v = seconds * 1e6
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"
