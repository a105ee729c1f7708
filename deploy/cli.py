"""The ``mini-deepinfer`` command: serve, generate (alias run-batch), parity, make-checkpoint.

Every subcommand takes ``--log-level`` (also accepted before the subcommand) and states every
default in ``--help``; docs/configuration.md is generated from these parsers
(``python -m deploy.config_doc``). A configuration error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from engine_core.cli_options import ArgumentParser, HelpFormatter
from engine_core.log_setup import LEVELS
from frontend.startup_summary import package_version

PROG = "mini-deepinfer"
DEFAULT_LOG_LEVEL = "INFO"
LOG_LEVEL_HELP = f"logging threshold of every process: {', '.join(LEVELS)}"


def _make_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    from model.presets import preset_names

    parser.add_argument("out", metavar="OUT", help="directory to create")
    parser.add_argument("--preset", default="tiny", help=f"model size, one of: {', '.join(preset_names())}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--config-only", action="store_true",
                        help="write config, tokenizer and Engram token map but no weights "
                             "(a model directory for --load-format dummy)")


def _make_checkpoint(args: argparse.Namespace) -> int:
    from model.checkpoint_maker import make_checkpoint

    path = make_checkpoint(args.out, preset=args.preset, seed=args.seed, overwrite=args.overwrite,
                           config_only=args.config_only)
    if args.config_only:
        print(f"wrote a {args.preset} DeepSeek-V4.1 config without weights (for --load-format dummy) to {path}")
    else:
        print(f"wrote a {args.preset} DeepSeek-V4.1 checkpoint (seed {args.seed}) to {path}")
    return 0


def _add_log_level(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    # the subcommand's flag only overrides the top-level one when given (SUPPRESS: no default)
    action = parser.add_argument("--log-level", type=str.upper, choices=LEVELS, metavar="LEVEL",
                                 default=DEFAULT_LOG_LEVEL if top_level else argparse.SUPPRESS,
                                 help=LOG_LEVEL_HELP)
    action.default_text = DEFAULT_LOG_LEVEL


# name -> (aliases, one-line description); _command_functions gives its flags and its entry point
COMMANDS = {
    "serve": ((), "OpenAI-compatible HTTP server (frontend, engine core and workers)"),
    "generate": (("run-batch",), "offline generation from a JSONL file of requests"),
    "parity": ((), "compare the model with DeepSeek's reference outputs"),
    "make-checkpoint": ((), "write a seeded random V4.1 checkpoint (or only its config)"),
}


def _command_functions(name: str):
    if name == "serve":
        from . import serve_cli

        return serve_cli.add_arguments, serve_cli.main
    if name == "generate":
        from . import generate_cli

        return generate_cli.add_arguments, generate_cli.main
    if name == "parity":
        from model import parity

        return parity.add_arguments, parity.main
    return _make_checkpoint_arguments, _make_checkpoint


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="DeepSeek-V4.1 inference service", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}",
                        help="print the version and exit")
    _add_log_level(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="the command to run")
    for name, (aliases, description) in COMMANDS.items():
        add, run = _command_functions(name)
        command = sub.add_parser(name, aliases=list(aliases), help=description, description=description,
                                 formatter_class=HelpFormatter)
        add(command)
        _add_log_level(command, top_level=False)
        command.set_defaults(run=run, command_name=name)
    return parser


def _process_name(args: argparse.Namespace) -> str:
    """The label of this process's log lines: the command, "frontend" for serve, "node-R" for a headless node."""
    if args.command_name != "serve":
        return args.command_name
    return f"node-{args.node_rank}" if getattr(args, "headless", False) else "frontend"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine_core.log_setup import configure_logging

    configure_logging(args.log_level, _process_name(args))
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileExistsError, FileNotFoundError) as exc:  # configuration and input errors
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
