"""What ``benchmarks/kernels.py`` reports: one result row per (kernel, M), the progress line, the
run's environment and the markdown tables."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

import torch

from benchmarks.device_limits import Ceilings
from benchmarks.kernel_checks import us

GB = 1e9


@dataclass
class Row:
    kernel: str
    shape: str
    m: int
    bytes: float
    flops: float
    mem_s: float
    flop_s: float
    limit_s: float
    bound: str
    triton_s: float | None = None
    reference_s: float | None = None
    torch_s: float | None = None
    rel_err: float | None = None
    err_rows: int | None = None  # rows compared when the reference ran on a subset
    reference_skipped: str | None = None
    torch_skipped: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def pct_limit(self) -> float | None:
        return None if not self.triton_s else self.limit_s / self.triton_s


def progress_line(r: Row) -> str:
    return (f"{r.kernel:22s} M={r.m:<6d} triton {us(r.triton_s):>9s} us  ref {us(r.reference_s):>9s}  "
            f"torch {us(r.torch_s):>9s}  limit {us(r.limit_s):>8s} ({r.bound})  {r.pct_limit:.0%}  err {r.rel_err:.1e}")


def env_info(device: torch.device) -> dict:
    import triton  # after benchmarks/kernels.py has chosen the interpreter or the GPU

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "device": str(device), "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    gpu_memory_gb=round(props.total_memory / GB, 1), sms=props.multi_processor_count)
    else:
        info["gpu"] = f"none (CPU: {platform.processor() or platform.machine()})"
    return info


def markdown(env: dict, ceil: Ceilings, bench, shapes_name: str) -> str:
    """The tables of a run (``bench``: a ``benchmarks.kernels.Bench`` that has run)."""
    lines = [f"## Quantized kernels, {shapes_name} shapes",
             "",
             f"* device: {env['gpu']}; torch {env['torch']}, triton {env['triton']}"
             + (" (TRITON_INTERPRET=1: timings meaningless)" if env["interpreted"] else ""),
             f"* measured HBM bandwidth: {ceil.bandwidth / 1e12:.2f} TB/s (device copy of "
             f"{ceil.copy_bytes / (1 << 30):.2f} GiB, read + write)",
             f"* measured bf16 tensor-core peak: {ceil.bf16_flops / 1e12:.0f} TFLOP/s (torch.matmul "
             f"{ceil.matmul_n}^3), **used for the limit**; fp8 peak (torch._scaled_mm, context): "
             + (f"{ceil.fp8_flops / 1e12:.0f} TFLOP/s" if ceil.fp8_flops else "not measured"),
             "* limit = max(bytes / bandwidth, FLOPs / bf16 peak); % of limit = limit / triton time; "
             "times in µs (median); err = max |triton - reference| / max |reference| "
             "(`(n rows)`: reference run on n spread rows only)",
             "",
             "| kernel | weight | M | triton | reference | torch (dequant + F.linear) | limit | bound "
             "| % of limit | TB/s | TFLOP/s | triton vs torch | err |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in bench.rows:
        err = "-" if r.rel_err is None else f"{r.rel_err:.1e}" + (f" ({r.err_rows} rows)" if r.err_rows else "")
        speed = f"{r.torch_s / r.triton_s:.1f}x" if r.torch_s and r.triton_s else "-"
        lines.append(f"| {r.kernel} | {r.shape} | {r.m} | {us(r.triton_s)} | {us(r.reference_s)} | {us(r.torch_s)} "
                     f"| {us(r.limit_s)} | {r.bound} | {r.pct_limit:.0%} | {r.bytes / r.triton_s / 1e12:.2f} "
                     f"| {r.flops / r.triton_s / 1e12:.1f} | {speed} | {err} |")
    if bench.layer:
        lines += [""] + layer_graph_lines(bench.specs, bench.layer)
    return "\n".join(lines)


def layer_graph_lines(specs, layer: list[dict]) -> list[str]:
    """The table of a layer's FP8 linears in one graph (``layer``: ``Bench.run_layer_graph``'s entries, one
    per M, with ``graph_without_pdl_s`` under ``--pdl``, ``graph_inputs_in_l2_s`` under ``--inputs-in-l2`` and
    ``graph_plain_inputs_s`` under ``--plain-inputs``)."""
    lines = [f"FP8 linears of one layer taken together ({len(specs)} projections: "
             + ", ".join(s.name for s in specs) + "); graph = all of them captured in one CUDA graph "
             f"({layer[0]['instances']} layer instances with distinct weights) and replayed, per layer. "
             "Target: >= 70% of the memory limit.",
             ""]
    pdl = any("graph_without_pdl_s" in e for e in layer)  # --pdl: the graph both ways
    warm = any("graph_inputs_in_l2_s" in e for e in layer)  # --inputs-in-l2
    plain = any("graph_plain_inputs_s" in e for e in layer)  # --plain-inputs
    lines += ["| M | sum of kernels | CUDA graph " + ("| graph, plain inputs " if plain else "")
              + ("| graph without PDL " if pdl else "")
              + ("| graph, inputs in L2 | its % of memory limit " if warm else "")
              + "| memory limit | limit | graph % of memory limit | graph % of limit | sum % of memory limit |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if plain else "") + ("---:|" if pdl else "")
              + ("---:|---:|" if warm else "")]
    for e in layer:
        sum_pct = "-" if e["sum_pct_mem_limit"] is None else f"{e['sum_pct_mem_limit']:.0%}"
        without = (f"| {us(e.get('graph_plain_inputs_s'))} " if plain else "") + \
            (f"| {us(e.get('graph_without_pdl_s'))} " if pdl else "")
        in_l2 = e.get("graph_inputs_in_l2_s")
        in_l2 = f"| {us(in_l2)} | {e['mem_limit_s'] / in_l2:.0%} " if in_l2 else "| - | - " if warm else ""
        lines.append(f"| {e['m']} | {us(e['sum_s'])} | {us(e['graph_s'])} {without}{in_l2}| {us(e['mem_limit_s'])} "
                     f"| {us(e['limit_s'])} | **{e['pct_mem_limit']:.0%}** | {e['pct_limit']:.0%} | {sum_pct} |")
    return lines
