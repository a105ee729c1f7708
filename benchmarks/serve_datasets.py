"""Workloads for ``benchmarks/serve.py``: the ``random`` and ``sharegpt`` datasets of ``vllm bench serve``.

* ``random``: input and output lengths uniform in ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` around
  ``--random-input-len`` / ``--random-output-len`` with ``r = --random-range-ratio`` (vLLM's rule);
  prompts are random token ids from ``--token-id-range``. On ``/v1/completions`` they are sent as
  token ids, so every server sees exactly the same input and no tokenizer is needed; a chat message
  must be text, so on ``/v1/chat/completions`` they are decoded to text first (the server then
  counts its own prompt tokens: the chat template adds some, and re-encoding decoded random ids
  may merge a few).
* ``sharegpt``: a ShareGPT-format JSON file (a list of ``{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}``); the first turn is the prompt and the
  length of the second, in tokens, is the output length (``--sharegpt-output-len`` overrides it).
  Conversations are shuffled with the seed, and filtered as vLLM does: prompts under 4 tokens or
  over 1024, outputs under 4 (unless overridden), prompt + output over 2048 are skipped. With fewer
  usable conversations than ``--num-prompts``, random ones are repeated (``--no-oversample``: not).

Token counts need a tokenizer: a local ``tokenizer.json`` (``--tokenizer FILE_OR_DIR``), or else the
server's own ``/tokenize`` and ``/detokenize`` endpoints (mini-deepinfer and vLLM both serve them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np

# vLLM's ShareGPT filter (benchmarks/datasets: is_valid_sequence).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int  # tokens as the client counted them; the server's usage count wins when it sends one
    expected_output_len: int  # sent as max_tokens / max_completion_tokens


# ----------------------------------------------------------------------------- tokenizers
class BenchTokenizer(Protocol):
    name: str

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class LocalTokenizer:
    """A Hugging Face ``tokenizer.json`` (the file, or a checkpoint directory holding it)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(file))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=False)


class ServerTokenizer:
    """The served model's tokenizer, through the server's ``/tokenize`` and ``/detokenize``."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]):
        self.name = f"{base_url}/tokenize"
        self._model = model
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=60.0, trust_env=False)

    def _post(self, path: str, body: dict) -> dict:
        try:
            resp = self._client.post(path, json={"model": self._model, **body})
        except httpx.HTTPError as e:
            raise RuntimeError(f"{self._client.base_url}{path} failed: {e!r}; pass --tokenizer") from e
        if resp.status_code != 200:
            raise RuntimeError(f"{self._client.base_url}{path} answered {resp.status_code} "
                               f"({resp.text[:200]}); pass --tokenizer")
        return resp.json()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]

    def decode(self, token_ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": token_ids})["prompt"]


# ----------------------------------------------------------------------------- random
def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's inclusive sampling range around ``mean``; never below 1 token."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"lengths must be >= 1, got {mean}")
    return max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))


def sample_random(rng: np.random.Generator, num_prompts: int, input_len: int, output_len: int,
                  range_ratio: float, token_id_range: tuple[int, int]) -> list[SampleRequest]:
    """``num_prompts`` token-id prompts with lengths drawn around the given means."""
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    low, high = token_id_range
    return [SampleRequest([int(t) for t in rng.integers(low, high, size=int(n_in))], int(n_in), int(n_out))
            for n_in, n_out in zip(in_lens, out_lens)]


def as_text(requests: list[SampleRequest], tokenizer: BenchTokenizer) -> list[SampleRequest]:
    """Token-id prompts decoded to text (chat messages carry text only); other prompts unchanged."""
    return [SampleRequest(tokenizer.decode(r.prompt), r.prompt_len, r.expected_output_len)
            if isinstance(r.prompt, list) else r for r in requests]


# ----------------------------------------------------------------------------- ShareGPT
def load_sharegpt(path: str | Path, num_prompts: int, tokenizer: BenchTokenizer, rng: np.random.Generator,
                  output_len: int | None = None, oversample: bool = True, shuffle: bool = True
                  ) -> list[SampleRequest]:
    """Text prompts from a ShareGPT-format file (see the module docstring for the rules)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: cannot read a JSON file ({e})") from e
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations")
    conversations = [entry["conversations"] for entry in data
                     if isinstance(entry, dict) and isinstance(entry.get("conversations"), list)
                     and len(entry["conversations"]) >= 2]
    order = rng.permutation(len(conversations)) if shuffle else range(len(conversations))
    samples: list[SampleRequest] = []
    for i in order:
        if len(samples) >= num_prompts:
            break
        prompt, completion = (turn.get("value") if isinstance(turn, dict) else None
                              for turn in conversations[i][:2])
        if not isinstance(prompt, str) or not isinstance(completion, str):
            continue
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len if output_len is not None else len(tokenizer.encode(completion, add_special_tokens=False))
        too_short = prompt_len < SHAREGPT_MIN_LEN or (output_len is None and out_len < SHAREGPT_MIN_LEN)
        too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN
        if not (too_short or too_long):
            samples.append(SampleRequest(prompt, prompt_len, out_len))
    if not samples:
        raise ValueError(f"--dataset-path {path}: no usable conversation (each needs two turns with "
                         f"{SHAREGPT_MIN_LEN}-{SHAREGPT_MAX_PROMPT_LEN} prompt tokens)")
    if oversample and len(samples) < num_prompts:
        extra = rng.integers(0, len(samples), size=num_prompts - len(samples))
        samples += [samples[int(j)] for j in extra]
    return samples
