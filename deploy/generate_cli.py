"""``mini-deepinfer generate --input FILE.jsonl --output FILE.jsonl`` (alias ``run-batch``): offline
batch generation.

The input is OpenAI's batch format (``custom_id``, ``method``, ``url`` = ``/v1/completions`` or
``/v1/chat/completions``, ``body``), or the original one: one completion per line, ``prompt``
(text) or ``prompt_token_ids`` plus any /v1/completions field (``max_tokens``, ``temperature``,
``stop``, ``logprobs``, ...). Every request is served by the HTTP server's own request handling
(frontend/batch.py), so every field behaves as it does over HTTP; results are written in input
order in the matching output format. The engine runs in its own processes, as under ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from engine_core.config import add_engine_arguments, engine_config_from_args

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", "-i", required=True,
                        help="JSONL file of requests: OpenAI's batch format, or one prompt per line")
    parser.add_argument("--output", "-o", required=True, help="JSONL file to write, one result per request")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                        help="names a request's `model` may give (default: the model directory's name)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from frontend.batch import openai_output, original_output, read_requests

    with open(args.input, encoding="utf-8") as f:
        requests = read_requests(f.read().splitlines())
    config = engine_config_from_args(args)
    from frontend.engine_client import EngineDeadError

    try:
        results = asyncio.run(_serve(requests, config, args))
    except EngineDeadError as exc:  # the engine failed to start, or died: one line, no output file
        log.error("%s", exc)
        return 1
    if requests and requests[0].custom_id is not None:
        lines = [openai_output(result) for result in results]
        failed = sum(1 for result in results if result.status != 200)
    else:
        lines = [original_output(index, result) for index, result in enumerate(results)]  # raises on a refusal
        failed = 0
    with open(args.output, "w", encoding="utf-8") as out:
        for line in lines:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    print(f"wrote {len(lines)} results to {args.output}" + (f" ({failed} failed)" if failed else ""),
          file=sys.stderr)
    return 0


async def _serve(requests, config, args: argparse.Namespace):
    """Start the engine, run every request through the server's app, stop the engine."""
    from frontend.batch import run_requests
    from frontend.generation_config import load_sampling_defaults
    from frontend.server import build_app
    from frontend.tokenizer import Tokenizer, TokenizerError
    from frontend.zmq_engine_client import ZmqEngineClient

    if not requests:
        return []
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per in-process request
    try:
        tokenizer: Tokenizer | None = Tokenizer(config.model)
    except TokenizerError as exc:
        log.warning("no tokenizer (%s): only token-id prompts will work", exc)
        tokenizer = None
    names = tuple(args.served_model_name or (Path(config.model).resolve().name,))
    engine = ZmqEngineClient(config, log_level=getattr(args, "log_level", "INFO"))
    running = config.max_num_seqs * config.dp_size
    app = build_app(engine, tokenizer, names[0], None, [], config.max_queued_requests, max_running_seqs=running,
                    max_seqs_per_request=config.max_seqs_per_request)
    serving = app.state.serving
    serving.served_model_names = names
    serving.sampling_defaults = load_sampling_defaults(config.model, getattr(config, "generation_config", "auto"))
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)
    try:
        await engine.start()
        return await run_requests(app, requests, running, progress.update if progress is not None else lambda: None)
    finally:
        if progress is not None:
            progress.close()
        await engine.shutdown()
