"""``mini-deepinfer serve``: the OpenAI-compatible HTTP server (frontend) with its engine core and workers."""

from __future__ import annotations

import argparse

from engine_core.config import add_engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' (or set MINI_DEEPINFER_API_KEY, kept out of ps)")
    parser.add_argument("--metrics-require-key", action="store_true", help="/metrics requires the API key too")
    parser.add_argument("--allowed-origins", default=None,
                        help="comma-separated CORS origins (default: no CORS; '*' allows any, without credentials)")
    parser.add_argument("--max-request-bytes", type=int, default=8 << 20,
                        help="largest request body; larger ones get 413 (default 8 MiB)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds requests in flight may finish after SIGTERM/SIGINT before they are stopped")
    add_engine_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from frontend.server import run_server

    return run_server(args)
