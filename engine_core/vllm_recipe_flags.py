"""vLLM flags that DeepSeek serving recipes pass, which this engine does by design or cannot do.

A vLLM command line for DeepSeek models usually carries ``--trust-remote-code`` and, for expert
parallelism, ``--data-parallel-size N --enable-expert-parallel`` (or ``--tensor-parallel-size N``).
Rather than stop such a line at "unrecognized arguments", the engine accepts what it already does
and refuses what it cannot, naming the flag to use instead:

* ``--trust-remote-code``: accepted; nothing from the model directory is ever run (the V4.1 network
  is this package's own code), so there is nothing to trust.
* ``--enable-expert-parallel``: accepted; the routed experts are always sharded over the
  ``--data-parallel-size`` ranks (each rank runs the attention on its own sequences).
* ``--tensor-parallel-size/-tp N``: 1 only. Tensor parallelism is not implemented; N GPUs serve the
  model as N data-parallel ranks with the experts sharded over them, as in DeepSeek's own deployment.
* ``--kv-cache-dtype auto|fp8|fp8_e4m3``: accepted; the cache always holds the model's own formats
  (the window's rows FP8 e4m3, the compressed entries and index keys FP4), none wider than FP8.

The offline API takes the same names as keyword arguments (``LLM(..., trust_remote_code=True)``).
"""

from __future__ import annotations

import argparse
from typing import Any

RECIPE_FLAGS = ("trust_remote_code", "enable_expert_parallel", "tensor_parallel_size", "kv_cache_dtype")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # what the cache's formats already satisfy


def add_vllm_recipe_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM recipe flags", "accepted so that vLLM command lines for DeepSeek models run unchanged")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted, changes nothing: no code from the model directory is run")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="accepted, changes nothing: the routed experts are always sharded over the "
                            "--data-parallel-size ranks")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="1 only (no tensor parallelism): serve N GPUs as --data-parallel-size N, the experts "
                            "sharded over the ranks")
    group.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                       help=f"{', '.join(KV_CACHE_DTYPES)}, accepted, change nothing: the cache holds the model's "
                            "own formats (window rows FP8 e4m3, compressed entries and index keys FP4)")


def check_vllm_recipe_flags(values: dict[str, Any]) -> None:
    """ValueError for a recipe flag the engine cannot honour (``values``: the flags by field name;
    missing ones count as not given)."""
    tp = values.get("tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"--tensor-parallel-size {tp}: tensor parallelism is not supported; serve {tp} GPUs with "
                         f"--data-parallel-size {tp} (the routed experts are sharded over the ranks)")
    kv_dtype = values.get("kv_cache_dtype", "auto")
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_dtype}: the cache holds the model's own formats (window rows FP8 "
                         f"e4m3, compressed entries and index keys FP4); {', '.join(KV_CACHE_DTYPES)} keep them")
