"""``mini-deepinfer serve [MODEL]``: the OpenAI-compatible HTTP server (frontend) with its engine core and workers."""

from __future__ import annotations

import argparse

from engine_core.config import add_engine_arguments
from frontend.server_config import add_server_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="checkpoint directory, as --model (default: the embedded tiny model)")
    add_server_arguments(parser)
    add_engine_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from engine_core.config import engine_config_from_args
    from frontend.server import run_server
    from frontend.server_config import server_config_from_args

    server = server_config_from_args(args)  # both resolved and checked before any process starts
    engine = engine_config_from_args(args)
    return run_server(server, engine, log_level=args.log_level)
