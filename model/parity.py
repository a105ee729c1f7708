"""``mini-deepinfer parity --golden DIR``: compare the model with DeepSeek's official reference.

A golden directory (format: its README) holds a tiny checkpoint in the official layout, the
reference's logits for prefill and decode cases, and component vectors. For every case this runs
the model the way the reference was run and reports, over the rows the golden set flags as free of
top-k ties, the top-1 agreement, the fraction of rows within 1e-3 (max abs over the vocabulary),
and the max abs error. Rows with ties are reported, not judged.

* prefill cases: one full prefill (all-position logits vs ``fullseq_logits``) and a fresh prefill
  of every prefix (last-position logits vs ``prefix_logits``);
* decode cases: prefill of the prompt, then teacher-forced single-token steps fed the golden
  ``step_input_ids`` at ``step_start_pos``, with the official index-key hand-off switched on.

A case passes when its judged rows reach top-1 >= 98% and >= 90% of them are within 1e-3.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .batch import ForwardBatch
from .cache import V41Cache
from .loader import load_model
from .transformer import ModelOptions, V41Model

ROW_TOLERANCE = 1e-3
MIN_TOP1 = 0.98
MIN_WITHIN = 0.90


@dataclass
class RowStats:
    """Agreement of computed logits rows with golden rows, over the judged rows."""

    rows: int
    judged: int
    top1_agree: int
    within_tol: int
    max_abs: float  # over judged rows
    max_abs_all: float  # over every row, ties included

    @property
    def top1_rate(self) -> float:
        return self.top1_agree / self.judged if self.judged else 1.0

    @property
    def within_rate(self) -> float:
        return self.within_tol / self.judged if self.judged else 1.0

    @property
    def passed(self) -> bool:
        return self.top1_rate >= MIN_TOP1 and self.within_rate >= MIN_WITHIN

    def __add__(self, other: "RowStats") -> "RowStats":
        return RowStats(self.rows + other.rows, self.judged + other.judged, self.top1_agree + other.top1_agree,
                        self.within_tol + other.within_tol, max(self.max_abs, other.max_abs),
                        max(self.max_abs_all, other.max_abs_all))


def compare_rows(computed: torch.Tensor, expected: torch.Tensor, judged: torch.Tensor) -> RowStats:
    computed, expected = computed.float().reshape(-1, expected.shape[-1]), expected.float().reshape(-1, expected.shape[-1])
    judged = judged.reshape(-1).bool()
    err = (computed - expected).abs().amax(dim=-1)
    top1 = computed.argmax(-1) == expected.argmax(-1)
    return RowStats(rows=int(err.numel()), judged=int(judged.sum()), top1_agree=int((top1 & judged).sum()),
                    within_tol=int(((err <= ROW_TOLERANCE) & judged).sum()),
                    max_abs=float(err[judged].max()) if bool(judged.any()) else 0.0,
                    max_abs_all=float(err.max()) if err.numel() else 0.0)


@dataclass
class ParityReport:
    passed: bool
    total: RowStats  # every judged row of every case together

    def __bool__(self) -> bool:
        return self.passed


class SequenceRunner:
    """Runs one sequence through the model the way the reference is called: prefill, then steps."""

    def __init__(self, model: V41Model, max_len: int, block_size: int = 128):
        self.model = model
        blocks = (max_len + block_size - 1) // block_size
        self.cache = V41Cache.allocate(model.cfg, num_blocks=blocks + 1, num_slots=1, block_size=block_size,
                                       device=model.device)
        self.block_table = list(range(1, blocks + 1))
        self.length = 0
        self.previous_start = -1

    def run(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        start = self.length
        batch = ForwardBatch.build([token_ids], [start], [0], [self.block_table], [self.previous_start],
                                   device=self.model.device)
        hidden = self.model.forward(batch, self.cache)
        self.previous_start, self.length = start, start + len(token_ids)
        return self.model.logits(hidden if all_logits else hidden[-1:]).cpu()


class GoldenSet:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = json.loads((self.path / "cases.json").read_text())
        self.tensors = load_file(str(self.path / "cases.safetensors"))
        self.checkpoint = self.path / "checkpoint"

    def tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def run_prefill_case(model: V41Model, golden: GoldenSet, case: dict, dump: dict) -> dict[str, RowStats]:
    t = case["tensors"]
    ids = golden.tensor(t["input_ids"]).tolist()
    max_len = len(ids)
    full = SequenceRunner(model, max_len).run(ids, all_logits=True)
    prefix = torch.stack([SequenceRunner(model, max_len).run(ids[: i + 1])[0] for i in range(len(ids))])
    name = case["name"]
    dump[f"prefill.{name}.fullseq_logits"] = full
    dump[f"prefill.{name}.prefix_logits"] = prefix
    dump[f"prefill.{name}.last_logits"] = prefix[-1].clone()
    tie_free_rows = golden.tensor(t["prefix_tie_free"]).bool()
    full_judged = torch.full((len(ids),), bool(case.get("full_prefill_tie_free", False)))
    return {
        "prefix": compare_rows(prefix, golden.tensor(t["prefix_logits"]), tie_free_rows),
        "fullseq": compare_rows(full, golden.tensor(t["fullseq_logits"]), full_judged),
    }


def run_decode_case(model: V41Model, golden: GoldenSet, case: dict, dump: dict) -> dict[str, RowStats]:
    t = case["tensors"]
    prompt = golden.tensor(t["prompt_ids"]).tolist()
    inputs = golden.tensor(t["step_input_ids"]).tolist()
    starts = golden.tensor(t["step_start_pos"]).tolist()
    runner = SequenceRunner(model, len(prompt) + len(inputs))
    prefill_logits = runner.run(prompt)
    steps = []
    for token, start in zip(inputs, starts):
        if start != runner.length:
            raise ValueError(f"decode case {case['name']}: step at {start} but {runner.length} tokens cached")
        steps.append(runner.run([token])[0])
    steps = torch.stack(steps)
    name = case["name"]
    dump[f"decode.{name}.step_logits"] = steps
    dump[f"decode.{name}.prefill_logits"] = prefill_logits[0]
    prefill_judged = torch.tensor([bool(case.get("prefill_tie_free", False))])
    return {
        "prefill": compare_rows(prefill_logits, golden.tensor(t["prefill_logits"])[None], prefill_judged),
        "steps": compare_rows(steps, golden.tensor(t["step_logits"]), golden.tensor(t["step_tie_free"]).bool()),
    }


def _row(label: str, stats: RowStats) -> str:
    verdict = "ok" if stats.passed else "FAIL"
    if stats.judged == 0:
        verdict = "not judged"
    return (f"{label:<22} {stats.judged:>3}/{stats.rows:<4} {stats.top1_rate:>7.1%} {stats.within_rate:>9.1%} "
            f"{stats.max_abs:>10.3g} {stats.max_abs_all:>10.3g}  {verdict}")


def run_parity(golden_dir: str | Path, batch_invariant: bool = False, dump_path: str | None = None,
               components: bool = True, out=sys.stdout, device: str = "cpu") -> "ParityReport":
    """Run every case of a golden set; print one row per case; true when everything passed."""
    from .parity_components import check_components

    golden = GoldenSet(golden_dir)
    torch.set_num_threads(1)  # the reference was run single-threaded
    reference_layout = not batch_invariant
    default_model = load_model(golden.checkpoint, ModelOptions(batch_invariant, reference_layout=reference_layout),
                               device)
    official_model = load_model(golden.checkpoint, ModelOptions(batch_invariant, official_index_handoff=True,
                                                                reference_layout=reference_layout), device)
    mode = ("batch-invariant GEMMs" if batch_invariant else "reference GEMMs") + f" on {device}"
    print(f"parity against {golden.path} ({mode}); tolerance {ROW_TOLERANCE:g} per row, "
          f"pass: top-1 >= {MIN_TOP1:.0%} and >= {MIN_WITHIN:.0%} rows within tolerance (tie-free rows)", file=out)
    print(f"{'case':<22} {'judged':>8} {'top-1':>7} {'<=1e-3':>9} {'max abs':>10} {'max(all)':>10}", file=out)
    dump: dict[str, torch.Tensor] = {}
    ok = True
    total = RowStats(0, 0, 0, 0, 0.0, 0.0)
    for case in golden.index["prefill"]:
        for kind, stats in run_prefill_case(default_model, golden, case, dump).items():
            print(_row(f"prefill.{case['name']}.{kind}", stats), file=out)
            ok &= stats.passed
            total = total + stats
    for case in golden.index["decode"]:
        for kind, stats in run_decode_case(official_model, golden, case, dump).items():
            print(_row(f"decode.{case['name']}.{kind}", stats), file=out)
            ok &= stats.passed
            total = total + stats
    if components and device != "cpu":
        print("components: checked on CPU only (they pin down the reference's CPU arithmetic)", file=out)
    elif components:
        for result in check_components(default_model, golden):
            print(f"{'comp.' + result.name:<40} {result.detail:<44} {'ok' if result.passed else 'FAIL'}", file=out)
            ok &= result.passed
    if dump_path:
        save_file({k: v.contiguous() for k, v in dump.items()}, dump_path)
        print(f"wrote {len(dump)} logits tensors to {dump_path}", file=out)
    print(_row("all rows", total), file=out)
    print("PASS" if ok else "FAIL", file=out)
    return ParityReport(ok, total)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--golden", required=True, help="golden set directory (cases.json, cases.safetensors, checkpoint/)")
    parser.add_argument("--dump", help="write the computed logits to this safetensors file, under the golden keys")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="compute every GEMM row on its own (the engine's CPU mode) instead of as the reference does")
    parser.add_argument("--skip-components", action="store_true", help="only the end-to-end cases")
    parser.add_argument("--device", default="cpu", help="cpu (the reference's arithmetic) or cuda")


def main(args: argparse.Namespace) -> int:
    ok = run_parity(args.golden, batch_invariant=args.batch_invariant, dump_path=args.dump,
                    components=not args.skip_components, device=args.device)
    return 0 if ok else 1
