"""``mini-deepinfer serve [MODEL]``: the OpenAI-compatible HTTP server (frontend) with its engine core
and workers; with ``--headless`` (the other nodes of a multi-node deployment) only this node's
workers (engine_core/headless.py)."""

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
    from engine_core.cluster import read_cluster_key
    from engine_core.config import engine_config_from_args
    from frontend.server_config import server_config_from_args

    server = server_config_from_args(args)  # both resolved and checked before any process starts
    engine = engine_config_from_args(args)
    if engine.nnodes > 1:
        read_cluster_key(engine.cluster_key_file)  # a missing or short key: a config error here, not in a process
    if engine.headless:
        from engine_core.headless import run_headless

        return run_headless(engine, log_level=args.log_level)
    from frontend.server import run_server

    return run_server(server, engine, log_level=args.log_level)
