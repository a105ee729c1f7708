"""Pictures of ``benchmarks/serve.py`` results (and of ``vllm bench serve`` ones: same JSON keys).

    python -m benchmarks.plot_serve distributions RUN.json [RUN.json ...] -o dist.png
    python -m benchmarks.plot_serve timeline RUN.json -o timeline.png
    python -m benchmarks.plot_serve sweep RUNS/*.json -o sweep.png

* ``distributions``: TTFT, TPOT and ITL (and end-to-end latency) of every completed request, one
  histogram per run on log-spaced bins, with each run's median (solid) and p99 (dashed); needs
  results saved with ``--save-detailed``.
* ``timeline``: one line per request, in send order: the wait for a ``--max-concurrency`` slot
  (grey), send to first token (TTFT, orange), first to last token (decode, blue); failed
  requests in red. Needs ``--save-detailed``.
* ``sweep``: output throughput against median (and p99, dashed) TTFT, TPOT and end-to-end latency,
  one line per concurrency along the request rates (or per rate along the concurrencies, when the
  sweep varies concurrency more than rate); each point is labelled with the value that varies.

Needs matplotlib (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

DETAILED = ("ttfts", "itls", "latencies", "output_lens", "start_times", "errors")


def load_result(path: str | Path) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a readable JSON result ({e})") from e
    if not isinstance(result, dict) or "request_throughput" not in result:
        raise SystemExit(f"{path}: not a serving benchmark result (no request_throughput)")
    result["_path"] = str(path)
    return result


def require_detailed(result: dict) -> None:
    missing = [k for k in DETAILED if k not in result]
    if missing:
        raise SystemExit(f"{result['_path']}: no per-request data ({', '.join(missing)}); "
                         "run benchmarks/serve.py with --save-detailed")


def run_label(result: dict) -> str:
    rate = result.get("request_rate")
    conc = result.get("max_concurrency")
    parts = [result.get("label") or result.get("endpoint") or result.get("backend") or "run",
             f"rate {rate}" if rate not in (None, "inf") else "rate inf",
             f"concurrency {conc}" if conc else "no concurrency cap"]
    return ", ".join(str(p) for p in parts)


def completed(result: dict) -> list[int]:
    """Indices of the successful requests (vLLM's rule: an empty error)."""
    return [i for i, e in enumerate(result["errors"]) if not e]


def per_request_ms(result: dict) -> dict[str, np.ndarray]:
    """TTFT, TPOT, pooled ITL and E2E latency of the completed requests, in ms."""
    ok = completed(result)
    ttft = np.array([result["ttfts"][i] for i in ok]) * 1000
    e2e = np.array([result["latencies"][i] for i in ok]) * 1000
    n_out = np.array([result["output_lens"][i] for i in ok])
    multi = n_out > 1
    tpot = (e2e[multi] - ttft[multi]) / (n_out[multi] - 1)
    itl = np.array([g for i in ok for g in result["itls"][i]]) * 1000
    return {"TTFT": ttft, "TPOT": tpot, "ITL": itl, "E2E latency": e2e}


def _plain_log_ticks(axis) -> None:
    """Plain numbers on a log axis (10, 20, 50, 100 rather than 2x10^1), minor labels at 2 and 5 only."""
    from matplotlib.ticker import FuncFormatter

    def major(v, _):
        return f"{v:g}"

    def minor(v, _):
        lead = v / 10 ** math.floor(math.log10(v)) if v > 0 else 0
        return f"{v:g}" if round(lead) in (2, 5) and abs(lead - round(lead)) < 1e-6 else ""

    axis.set_major_formatter(FuncFormatter(major))
    axis.set_minor_formatter(FuncFormatter(minor))


def _log_bins(values: list[np.ndarray], n: int = 40) -> np.ndarray:
    positive = np.concatenate([v[v > 0] for v in values if len(v)] or [np.array([1.0])])
    lo, hi = positive.min(), positive.max()
    if hi <= lo:
        lo, hi = lo / 1.5, hi * 1.5
    return np.geomspace(lo, hi * 1.0001, n + 1)


# ----------------------------------------------------------------------------- figures
def plot_distributions(results: list[dict], title: str | None, plt):
    for r in results:
        require_detailed(r)
    data = [per_request_ms(r) for r in results]
    names = list(data[0])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes, names):
        bins = _log_bins([d[name] for d in data])
        for k, (r, d) in enumerate(zip(results, data)):
            values, color = d[name], colors[k % len(colors)]
            if not len(values):
                continue
            ax.hist(values, bins=bins, histtype="step", linewidth=1.5, color=color,
                    label=f"{run_label(r)} (n={len(values)})")
            ax.axvline(np.median(values), color=color, linewidth=1)
            ax.axvline(np.percentile(values, 99), color=color, linewidth=1, linestyle="--")
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests" if name != "ITL" else "token gaps")
        ax.set_title(name)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title or "Latency distributions (solid: median, dashed: p99)")
    return fig


def plot_timeline(result: dict, title: str | None, plt):
    require_detailed(result)
    starts = np.array(result["start_times"])
    queue = np.array(result.get("queue_times") or [0.0] * len(starts))
    order = np.argsort(starts, kind="stable")
    height = max(3.0, min(12.0, 0.06 * len(order) + 1.5))
    fig, ax = plt.subplots(figsize=(10, height), constrained_layout=True)
    for y, i in enumerate(order):
        send = starts[i]
        if queue[i] > 0:
            ax.plot([send - queue[i], send], [y, y], color="0.7", linewidth=2, solid_capstyle="butt")
        if result["errors"][i]:
            ax.plot([send], [y], "x", color="tab:red", markersize=4)
            continue
        first, end = send + result["ttfts"][i], send + result["latencies"][i]
        ax.plot([send, first], [y, y], color="tab:orange", linewidth=2, solid_capstyle="butt")
        ax.plot([first, end], [y, y], color="tab:blue", linewidth=2, solid_capstyle="butt")
    handles = [plt.Line2D([], [], color="0.7", linewidth=3, label="waiting for a concurrency slot"),
               plt.Line2D([], [], color="tab:orange", linewidth=3, label="send -> first token (TTFT)"),
               plt.Line2D([], [], color="tab:blue", linewidth=3, label="first -> last token"),
               plt.Line2D([], [], color="tab:red", marker="x", linestyle="", label="failed")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlabel("seconds since the start of the run")
    ax.set_ylabel("request (in send order)")
    ax.set_ylim(-1, len(order))
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title or f"Per-request timeline: {run_label(result)}")
    return fig


def _rate_value(result: dict) -> float:
    rate = result.get("request_rate", "inf")
    return math.inf if rate in (None, "inf") else float(rate)


def sweep_series(results: list[dict]) -> tuple[str, dict[tuple, list[dict]]]:
    """Group the runs into lines: per concurrency along the rates, or per rate along concurrencies."""
    rates = {_rate_value(r) for r in results}
    concurrencies = {r.get("max_concurrency") for r in results}
    along = "concurrency" if len(concurrencies) > len(rates) else "rate"
    series: dict[tuple, list[dict]] = {}
    for r in results:
        fixed = _rate_value(r) if along == "concurrency" else r.get("max_concurrency")
        series.setdefault((r.get("label") or r.get("endpoint") or "", fixed), []).append(r)
    for runs in series.values():
        runs.sort(key=(lambda r: r.get("max_concurrency") or math.inf) if along == "concurrency" else _rate_value)
    return along, series


def plot_sweep(results: list[dict], title: str | None, plt):
    along, series = sweep_series(results)
    metrics = [(m, name) for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
               if any(f"median_{m}_ms" in r for r in results)]
    if not metrics:
        raise SystemExit("no median_*_ms keys in these results")
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 4.0), constrained_layout=True)
    axes = np.atleast_1d(axes)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, ((label, fixed), runs) in enumerate(sorted(series.items(), key=lambda kv: str(kv[0]))):
        color = colors[k % len(colors)]
        name = (f"rate {fixed:g}/s" if along == "concurrency" else f"concurrency {fixed or 'none'}")
        name = f"{label}, {name}" if label and len(series) > 1 else name
        x = [r["output_throughput"] for r in runs]
        for ax, (m, _) in zip(axes, metrics):
            med = [r.get(f"median_{m}_ms") for r in runs]
            ax.plot(x, med, "o-", color=color, label=f"{name} (median)")
            p99 = [r.get(f"p99_{m}_ms") for r in runs]
            if all(v is not None for v in p99):
                ax.plot(x, p99, "s--", color=color, alpha=0.6, markersize=4, label=f"{name} (p99)")
            for j, (r, xv, yv) in enumerate(zip(runs, x, med)):
                point = r.get("max_concurrency") if along == "concurrency" else r.get("request_rate")
                # alternate above/below: neighbouring points of a saturated server sit close together
                ax.annotate(f"{point}", (xv, yv), textcoords="offset points", xytext=(4, 5 if j % 2 else -11),
                            fontsize=7)
    for ax, (_, name) in zip(axes, metrics):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
        ax.grid(alpha=0.3, which="both")
        ax.set_title(f"{name} vs throughput")
    axes[0].legend(fontsize=7)
    point_name = "max concurrency" if along == "concurrency" else "request rate (req/s)"
    fig.suptitle(title or f"Throughput against latency (points labelled with the {point_name})")
    return fig


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["distributions", "timeline", "sweep"])
    p.add_argument("results", nargs="+", help="result JSON files of benchmarks/serve.py or vllm bench serve")
    p.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf)")
    p.add_argument("--title", default=None)
    p.add_argument("--dpi", type=int, default=110)
    args = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("matplotlib is needed: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [load_result(f) for f in args.results]
    if args.kind == "timeline" and len(results) != 1:
        p.error("timeline takes one result file")
    if args.kind == "distributions":
        fig = plot_distributions(results, args.title, plt)
    elif args.kind == "timeline":
        fig = plot_timeline(results[0], args.title, plt)
    else:
        fig = plot_sweep(results, args.title, plt)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=args.dpi)
    plt.close(fig)
    print(out)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
