"""Structured-output overhead on CPU: grammar compile time and the per-step cost of the masks.

    python -m benchmarks.structured_bench [--model DIR] [--steps 50]

* compile: a typical tool-call JSON schema against the checkpoint's tokenizer (cold, then a cache hit);
* per step, at batch 1, 32 and 256: the sampler alone on random logits [B, V] (unconstrained), and
  the constrained path of the model runner (advance each row's matcher by its previous token, fill
  the bitmask, apply it to all rows at once, sample). The grammar part is timed on its own, and so
  is each of its three pieces: it is the added cost, to set against the step time of the model at
  hand (the sampler's time moves with the mask: fewer live tokens, cheaper softmax/noise on CPU).
  Which piece costs what matters on a GPU: there the mask is applied by xgrammar's device kernel,
  so the host's share of a step is the advance and the fill.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine_core.protocol import SamplingParams, StructuredOutput
from workers.sampler import RowSpec, SamplingBatch, sample
from workers.structured_output import GrammarCache, apply_bitmask, tokenizer_info

TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search_web", "send_email"]},
        "arguments": {"type": "object", "properties": {
            "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "query": {"type": "string", "maxLength": 200}, "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
            "to": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "urgent": {"type": "boolean"}},
            "required": ["location"], "additionalProperties": False},
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}


def _default_model() -> str:
    from model.checkpoint_maker import default_model_dir

    return str(default_model_dir())


def bench_compile(model: str, vocab_size: int, eos: int | None) -> dict:
    import xgrammar  # noqa: F401  (imported first: its import, which pulls in transformers, is not timed)

    t0 = time.perf_counter()
    info = tokenizer_info(model, vocab_size, eos)
    t1 = time.perf_counter()
    cache = GrammarCache(info)
    so = StructuredOutput("json_schema", json.dumps(TOOL_CALL_SCHEMA))
    t2 = time.perf_counter()
    cache.get(so)
    t3 = time.perf_counter()
    cache.get(so)
    t4 = time.perf_counter()
    return {"tokenizer_info_ms": (t1 - t0) * 1e3, "compile_ms": (t3 - t2) * 1e3, "cached_ms": (t4 - t3) * 1e3,
            "cache": cache}


def bench_step(cache: GrammarCache, vocab_size: int, batch: int, steps: int) -> dict:
    import xgrammar as xgr

    so = StructuredOutput("json_schema", json.dumps(TOOL_CALL_SCHEMA))
    compiled = cache.get(so)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    logits_steps = [torch.randn(batch, vocab_size, generator=gen) for _ in range(steps)]

    def sampling_batch(step: int) -> SamplingBatch:
        return SamplingBatch.build([RowSpec(params, r, 100 + step) for r in range(batch)], vocab_size, "cpu")

    sample(logits_steps[0].clone(), sampling_batch(0))  # warm-up
    t0 = time.perf_counter()
    for step in range(steps):
        sample(logits_steps[step].clone(), sampling_batch(step))
    plain = (time.perf_counter() - t0) / steps

    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    rows = list(range(batch))
    previous = None
    advance = fill = apply = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        logits = logits_steps[step].clone()
        g0 = time.perf_counter()
        if previous is not None:
            for m, token in zip(matchers, previous):
                if not m.accept_token(token) or m.is_terminated():
                    m.reset()  # a finished object: start the next one
        g1 = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
        for r, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, r)
        g2 = time.perf_counter()
        apply_bitmask(logits, bitmask, rows, vocab_size)
        g3 = time.perf_counter()
        advance, fill, apply = advance + g1 - g0, fill + g2 - g1, apply + g3 - g2
        previous = sample(logits, sampling_batch(step)).token_ids.tolist()
    constrained = (time.perf_counter() - t0) / steps
    grammar = (advance + fill + apply) / steps
    return {"batch": batch, "unconstrained_ms": plain * 1e3, "constrained_ms": constrained * 1e3,
            "grammar_ms": grammar * 1e3, "grammar_per_row_us": grammar / batch * 1e6,
            "advance_per_row_us": advance / steps / batch * 1e6, "fill_per_row_us": fill / steps / batch * 1e6,
            "apply_per_row_us": apply / steps / batch * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", default="1,32,256")
    args = parser.parse_args()
    model = args.model or _default_model()
    from model.config import V41Config

    config = V41Config.from_pretrained(model)
    vocab_size, eos = config.vocab_size, config.eos_token_id
    torch.set_num_threads(1)
    result = bench_compile(model, vocab_size, eos)
    cache = result.pop("cache")
    print(f"model {model} (vocab {vocab_size}), 1 torch thread")
    print("tokenizer info {tokenizer_info_ms:.1f} ms; tool-call schema compile {compile_ms:.1f} ms, "
          "cache hit {cached_ms:.3f} ms".format(**result))
    for batch in (int(b) for b in args.batches.split(",")):
        r = bench_step(cache, vocab_size, batch, args.steps)
        print("batch {batch:4d}: sampler {unconstrained_ms:8.3f} ms/step, with grammar {constrained_ms:8.3f} ms/step, "
              "of which matchers + bitmask {grammar_ms:7.3f} ms ({grammar_per_row_us:.1f} us/row: advance "
              "{advance_per_row_us:.1f}, fill {fill_per_row_us:.1f}, apply {apply_per_row_us:.1f})".format(**r))


if __name__ == "__main__":
    main()
