"""docs/configuration.md, generated from the command's own parsers and the metrics table, so the
reference never drifts from ``--help`` (tests/test_cli.py checks it):

    python -m deploy.config_doc --write   # regenerate docs/configuration.md
    python -m deploy.config_doc --check   # exit 1 if the file is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine_core.cli_options import default_text, help_without_default

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

INTRO = """\
# Configuration reference

Every flag of every `mini-deepinfer` command, with its default. Generated from the command's own
parsers by `python -m deploy.config_doc --write` (a test fails when this file and `--help` differ).
The engine flags (`serve`, `generate`/`run-batch`) are declared once, as the fields of
`engine_core.config.EngineConfig`; the server's as those of `frontend.server_config.ServerConfig`.

Flag names follow vLLM's where the meaning is the same (`--data-parallel-size/-dp`,
`--max-model-len`, `--max-num-seqs`, `--max-num-batched-tokens`, `--gpu-memory-utilization`,
`--seed`, `--enforce-eager`, `--served-model-name`, `--disable-log-requests`,
`--disable-log-stats`, `--generation-config`, `--load-format`, `--hf-overrides`, ...).
`--log-level` is accepted before the subcommand and after it, and reaches every process
(frontend, engine core, workers).
A configuration error (a bad model path, `--max-model-len` above the model's limit, incompatible
flags) is one line on stderr and exit code 2.
"""

LOGS = """\
## Logs

Every process writes one format, uvicorn's lines included:
`MM-DD HH:MM:SS.mmm LEVEL [process pid=N] logger: message`, where the process is `frontend`,
`engine-core` or `worker-dpN` (its data-parallel rank). `serve` logs:

* a startup summary once it listens: version, model and served names, devices, parallel layout,
  weight and KV-cache dtypes, kernel backend, KV capacity (tokens and state slots per rank), the
  maximum concurrency at `max_model_len`, and the URL;
* every `--log-stats-interval` seconds while busy (and once when it goes idle), vLLM's stats line:
  prompt and generation throughput, running and waiting requests, KV-cache usage, state slots in
  use, preemptions (off with `--disable-log-stats`);
* one line per finished (or aborted) engine request: its id, prompt and output tokens, TTFT and
  total time (off with `--disable-log-requests`);
* a progress bar while the weights load, on a terminal only (first rank).
"""

METRICS_INTRO = """\
## Metrics

`GET /metrics` (Prometheus text format). Every metric is exported as `PREFIX:name`, the prefix
set by `--metrics-prefix` (default `minideepinfer`), where `name` is vLLM's own name whenever vLLM
has the metric. Those vLLM defines are exported a second time under their `vllm:` names (same
samples), so dashboards and alerts written for vLLM work unchanged; `--no-vllm-metrics-alias`
drops the copies. Every series carries vLLM's labels `model_name` (the first served model name)
and `engine` (always `0`: one engine core schedules all DP ranks); `request_success` adds
`finished_reason`. Counters carry Prometheus' `_total` suffix (`vllm:prompt_tokens_total`); gauges are
summed over DP ranks; the `*_per_rank` families give each rank's value with a `dp_rank` label.
`deploy/grafana-dashboard.json` is a Grafana
dashboard on these names.

| name (after `PREFIX:`) | type | vLLM name(s) | meaning |
|---|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}` (positional)"
    return ", ".join(f"`{name}`" for name in action.option_strings)


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return "|".join(str(c) for c in action.choices)
    name = action.metavar or action.dest.upper()
    return f"{name} [{name} ...]" if action.nargs == "+" else name


def command_section(name: str, parser: argparse.ArgumentParser, aliases: tuple[str, ...]) -> str:
    also = f" (alias: {', '.join(f'`{a}`' for a in aliases)})" if aliases else ""
    lines = [f"## `mini-deepinfer {name}`{also}", "", parser.description or "", "",
             "| flag | value | default | description |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        default = default_text(action)
        shown = "(required)" if default == "required" else ("" if default is None else f"`{default}`")
        lines.append(f"| {_flags(action)} | {_cell(_value(action))} | {_cell(shown)} | {_cell(help_without_default(action.help))} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    from frontend.metrics import METRICS

    from .cli import COMMANDS, build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sections = [INTRO, command_section("(before the subcommand)", parser, ())]
    sections[-1] = sections[-1].replace("## `mini-deepinfer (before the subcommand)`", "## `mini-deepinfer`")
    for name, (aliases, _) in COMMANDS.items():
        sections.append(command_section(name, subparsers.choices[name], aliases))
    sections.append(LOGS)
    rows = [f"| `{m.name}` | {m.kind} | {', '.join(f'`vllm:{v}`' for v in m.vllm_names) or '-'} | {_cell(m.help)} |"
            for m in METRICS]
    sections.append(METRICS_INTRO + "\n".join(rows) + "\n")
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.config_doc", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {DOC_PATH} is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
    elif args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is out of date: run python -m deploy.config_doc --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
