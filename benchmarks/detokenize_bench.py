"""Frontend CPU per output token spent on detokenization: ``tokenizers``' ``DecodeStream`` against
the Python window path (two ``decode`` calls per step, the algorithm used before), alone and
through ``OutputStream.process`` (detokenization, stop strings, logprob bookkeeping: the
per-token work of a streamed choice).

Run (from the repository root)::

    .venv/bin/python benchmarks/detokenize_bench.py
    .venv/bin/python benchmarks/detokenize_bench.py --model /path/to/checkpoint --tokens 20000 --repeats 5

Text: the tokenizer's own training corpus (``model/data/corpus.txt``, prose and code, some
multi-byte characters) tokenized once and streamed as output, one token per step (``--chunk 1``,
as with a consumer that keeps up) or several. Each figure is the best of ``--repeats`` runs of
CPU time (``time.process_time``) divided by tokens, in microseconds; one thread, nothing else
running. State the CPU when quoting numbers.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_core.protocol import RequestOutput  # noqa: E402
from frontend.detokenizer import IncrementalDetokenizer  # noqa: E402
from frontend.output_stream import OutputStream  # noqa: E402
from frontend.tokenizer import Tokenizer  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "model" / "data" / "corpus.txt"


def output_tokens(tokenizer: Tokenizer, count: int) -> list[int]:
    ids = tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False)
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def detokenizer_only(tokenizer: Tokenizer, prompt: list[int], ids: list[int], chunk: int, fast: bool) -> float:
    detok = IncrementalDetokenizer(tokenizer, prompt, True, use_decode_stream=fast)
    started = time.process_time()
    for i in range(0, len(ids), chunk):
        detok.add(ids[i:i + chunk])
    detok.flush()
    return time.process_time() - started


def through_output_stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int], chunk: int, fast: bool) -> float:
    stream = OutputStream(tokenizer, prompt, ["\n\n\n\n"], accumulate=False)
    stream.detokenizer = IncrementalDetokenizer(tokenizer, prompt, True, use_decode_stream=fast)
    deltas = [RequestOutput("r", ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas[-1] = RequestOutput("r", deltas[-1].new_token_ids, "length")
    started = time.process_time()
    for delta in deltas:
        stream.process(delta)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--tokens", type=int, default=20000, help="output tokens per run")
    parser.add_argument("--chunk", type=int, nargs="+", default=[1, 4], help="tokens per engine delta")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.model is None:
        from model.checkpoint_maker import default_model_dir

        args.model = default_model_dir()
    tokenizer = Tokenizer(args.model)
    import tokenizers

    ids = output_tokens(tokenizer, args.tokens)
    prompt = tokenizer.encode("Write something long:")
    print(f"tokenizers {tokenizers.__version__}, vocab {tokenizer.vocab_size}, {len(ids)} output tokens, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{'measure':<28}{'chunk':>6}{'python window':>16}{'DecodeStream':>15}{'speed-up':>10}")
    for name, run in (("detokenizer.add", detokenizer_only), ("OutputStream.process", through_output_stream)):
        for chunk in args.chunk:
            us = {}
            for fast in (False, True):
                best = min(run(tokenizer, prompt, ids, chunk, fast) for _ in range(args.repeats))
                us[fast] = best / len(ids) * 1e6
            print(f"{name:<28}{chunk:>6}{us[False]:>13.2f} us{us[True]:>12.2f} us{us[False] / us[True]:>9.2f}x")


if __name__ == "__main__":
    main()
