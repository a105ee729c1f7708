"""``mini-deepinfer serve``: the OpenAI-compatible HTTP server (frontend) with its engine core and workers."""

from __future__ import annotations

import argparse

from engine_core.config import add_engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    parser.add_argument("--allowed-origins", default="*", help="comma-separated CORS origins")
    add_engine_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from frontend.server import run_server

    return run_server(args)
