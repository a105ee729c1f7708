"""The ``mini-deepinfer`` command: serve, generate, parity, make-checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys


def _make_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    from model.presets import preset_names

    parser.add_argument("out", help="directory to create")
    parser.add_argument("--preset", default="tiny", help=f"one of: {', '.join(preset_names())}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
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


def build_parser() -> argparse.ArgumentParser:
    from model import parity

    from . import generate_cli, serve_cli

    parser = argparse.ArgumentParser(prog="mini-deepinfer", description="DeepSeek-V4.1 inference service")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "serve": ("OpenAI-compatible HTTP server", serve_cli.add_arguments, serve_cli.main),
        "generate": ("offline generation from a JSONL file", generate_cli.add_arguments, generate_cli.main),
        "parity": ("compare the model with DeepSeek's reference outputs", parity.add_arguments, parity.main),
        "make-checkpoint": ("write a seeded random V4.1 checkpoint (or only its config)", _make_checkpoint_arguments,
                            _make_checkpoint),
    }
    for name, (help_text, add, run) in commands.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add(command)
        command.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        print(f"mini-deepinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
