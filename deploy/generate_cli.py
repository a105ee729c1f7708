"""``mini-deepinfer generate --input FILE.jsonl --output FILE.jsonl``: offline batch generation.

One request per input line: ``prompt`` (text) or ``prompt_token_ids``, and optionally
``max_tokens``, ``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``stop_token_ids``, ``ignore_eos``, penalties, ``logprobs``. One result per output line, in input
order: ``index``, ``token_ids``, ``text``, ``finish_reason``.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine_core.config import add_engine_arguments, engine_config_from_args
from engine_core.protocol import SamplingParams

FIELD_TYPES = {"max_tokens": int, "min_tokens": int, "top_k": int, "seed": int, "logprobs": int,
               "temperature": (int, float), "top_p": (int, float), "min_p": (int, float),
               "presence_penalty": (int, float), "frequency_penalty": (int, float),
               "repetition_penalty": (int, float), "ignore_eos": bool, "stop_token_ids": list}
TYPE_NAMES = {int: "an integer", (int, float): "a number", bool: "true or false", list: "a list of integers"}
REQUEST_FIELDS = tuple(FIELD_TYPES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL file, one request per line")
    parser.add_argument("--output", required=True, help="JSONL file to write, one result per line")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_arguments(parser)


def parse_request(line: str, number: int) -> tuple[str | list[int], SamplingParams]:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"line {number}: expected a JSON object")
    if "prompt_token_ids" in raw:
        prompt = raw["prompt_token_ids"]
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"line {number}: prompt_token_ids must be a list of integers")
    elif isinstance(raw.get("prompt"), str):
        prompt = raw["prompt"]
    else:
        raise ValueError(f"line {number}: needs 'prompt' (text) or 'prompt_token_ids'")
    values = {k: raw[k] for k in REQUEST_FIELDS if k in raw and raw[k] is not None}
    for name, value in values.items():
        kind = FIELD_TYPES[name]
        ok = (all(isinstance(t, int) and not isinstance(t, bool) for t in value) if kind is list and
              isinstance(value, list) else kind is not list and isinstance(value, kind) and
              not (kind is not bool and isinstance(value, bool)))
        if not ok:
            raise ValueError(f"line {number}: {name} must be {TYPE_NAMES[kind]}, got {value!r}")
    if "stop_token_ids" in values:
        values["stop_token_ids"] = tuple(values["stop_token_ids"])
    try:
        return prompt, SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"line {number}: {exc}") from exc


def main(args: argparse.Namespace) -> int:
    from frontend.llm import LLM, PromptError

    requests, lines = [], []
    with open(args.input) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                requests.append(parse_request(line, number))
                lines.append(number)
    config = engine_config_from_args(args)
    values = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(config.model, **values)
    try:
        results = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=not args.no_progress)
    except PromptError as exc:
        raise ValueError(f"line {lines[exc.index]}: {exc.reason}") from exc
    with open(args.output, "w") as out:
        for index, result in enumerate(results):
            record = {"index": index, "token_ids": result.token_ids, "text": result.text,
                      "finish_reason": result.finish_reason}
            if result.logprobs is not None:
                record["logprobs"] = [lp.logprob for lp in result.logprobs]
            out.write(json.dumps(record) + "\n")
    print(f"wrote {len(results)} results to {args.output}", file=sys.stderr)
    return 0
