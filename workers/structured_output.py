"""Structured output (constrained decoding) with xgrammar: grammar compilation and per-sequence matchers.

Where things live, and why:

* **Compilation** happens in the engine core, at admission, in a small thread pool
  (``GrammarCache.submit``): the request waits in the core (out of the scheduler) until its grammar
  is compiled, no step ever waits for a compile, and an invalid spec ends that request with an
  error output. Compiled grammars are cached by ``(kind, spec)``, so ``n`` > 1 and repeated schemas
  compile once. A worker process keeps its own cache (one ``GrammarCache`` per process and model):
  at admission the core broadcasts the spec (``WorkerControl("grammar")``) and the workers compile
  it in their own pools while the request waits for the core's compile, so a step finds it ready;
  the in-process executor shares the core's cache, so its lookups always hit.
* **Matchers** live in the worker that samples the sequence (``StructuredState``, owned by the model
  runner), because the worker is where the logits are and where the sampled tokens first become
  known: the bitmask is filled and applied next to the logits, and no mask crosses a process
  boundary (16 KB per row per step for a 129k vocabulary). With several DP ranks each rank keeps
  the matchers of the sequences it samples.
* **Zero-overhead scheduling**: a matcher is advanced by position, idempotently. A sampled token is
  accepted at ``collect`` when that comes first; but a worker on a GPU launches step N+1 before it
  collects step N (``workers/step_pipeline.py``), and so does the in-process executor. Then
  ``execute`` takes the previous tokens of the *constrained* rows from step N's copy to the host,
  after a wait for that copy's event alone: step N+1's forward, already queued, keeps the device
  busy while the host advances the matchers and fills the mask. (A read of the device tensor would
  wait for everything queued before it, that forward included, and leave the device idle while the
  host works.) ``collect`` then finds those tokens accepted.
* **No other wait**: on a GPU the mask is filled in pinned memory and uploaded asynchronously, with
  the rows it applies to, so the step's sampling is queued behind the forward without the host
  waiting for it.
* **Preemption**: a recomputed sequence comes back with a new epoch; its sampling prefill chunk
  carries its known output tokens (``SequenceStep.structured_output_ids``) and the matcher is
  rebuilt from them (a token the old epoch sampled but the scheduler dropped is simply not
  replayed). Finished sequences are released through ``StepPlan.released_seq_ids``.
* **Termination**: EOS (the model's ``eos_token_id``) is the grammar's stop token, so the mask
  allows it only where the grammar may end; once the grammar can accept nothing but EOS, EOS is all
  that is left. A terminated matcher (an EOS already accepted, its step still in flight) masks to
  EOS only. ``max_tokens`` mid-object still finishes with "length".
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import torch

from engine_core.protocol import StructuredOutput
from model.device_upload import upload

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgr():
    """xgrammar, imported on first use: processes whose requests never ask for structured output
    neither pay its import (it pulls in transformers) nor need it installed."""
    import xgrammar

    return xgrammar

log = logging.getLogger(__name__)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
COMPILE_THREADS = 2


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled (the request's fault)."""


def tokenizer_info(model_dir: str | Path, vocab_size: int, eos_token_id: int | None) -> xgr.TokenizerInfo:
    """xgrammar's view of the checkpoint's byte-level BPE tokenizer, padded to the model's vocab.

    Added (special) tokens are given as empty strings, which xgrammar treats as special: never part
    of a grammar's text. Ids without a token (padding up to ``vocab_size``) are never allowed.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise GrammarError(f"structured output needs the checkpoint's tokenizer, and {model_dir} has no tokenizer.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise GrammarError(f"structured output supports byte-level BPE tokenizers, not {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    size = max([vocab_size, *(i + 1 for i in vocab.values())])
    encoded = [""] * size
    for token, i in vocab.items():
        encoded[i] = token
    for added in data.get("added_tokens", []):
        if added.get("special", True):
            encoded[added["id"]] = ""
    stops = [eos_token_id] if eos_token_id is not None else []
    return _xgr().TokenizerInfo(encoded, _xgr().VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=stops)


def _compile(compiler: xgr.GrammarCompiler, so: StructuredOutput) -> xgr.CompiledGrammar:
    kind, spec = so.kind, so.spec
    try:
        if kind == "json_schema":
            json.loads(spec)  # a clearer message than the compiler's for non-JSON text
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice needs a non-empty JSON list of strings")
            # JSON string escapes are also EBNF string-literal escapes
            body = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return compiler.compile_grammar(f"root ::= {body}")
        if kind == "grammar":
            return compiler.compile_grammar(spec)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's message
        raise GrammarError(f"invalid {kind}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from exc
    raise GrammarError(f"unknown structured output kind {kind!r} (expected one of {', '.join(KINDS)})")


class GrammarCache:
    """Compiles grammars in a thread pool; one compile per ``(kind, spec)``, failures included."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.info = info
        self.compiler = _xgr().GrammarCompiler(info, max_threads=COMPILE_THREADS)
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar")
        self._futures: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def submit(self, so: StructuredOutput) -> Future:
        key = (so.kind, so.spec)
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._pool.submit(_compile, self.compiler, so)
            return future

    def get(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar (waits for a compile in progress; raises GrammarError)."""
        return self.submit(so).result()


_caches: dict[tuple[str, int, int | None], GrammarCache] = {}
_caches_lock = threading.Lock()


def grammar_cache(model_dir: str, vocab_size: int, eos_token_id: int | None) -> GrammarCache:
    """The process-wide cache of one model (built on first use: reading the vocabulary takes a moment)."""
    key = (str(model_dir), vocab_size, eos_token_id)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = GrammarCache(tokenizer_info(model_dir, vocab_size, eos_token_id))
        return cache


@dataclass
class _Matcher:
    matcher: xgr.GrammarMatcher
    epoch: int
    next_position: int  # the position of the next token it will accept


class StructuredState:
    """The matchers of the constrained sequences one worker samples, and their token bitmasks."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_id: int | None):
        self.model_dir, self.vocab_size, self.eos_token_id = model_dir, vocab_size, eos_token_id
        self._cache: GrammarCache | None = None
        self.matchers: dict[int, _Matcher] = {}

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = grammar_cache(self.model_dir, self.vocab_size, self.eos_token_id)
        return self._cache

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)

    def needs_device_input(self, step) -> bool:
        """The step's input token is on the device (the previous step sampled it, and the plan does not
        carry it) and its matcher has not accepted it yet."""
        if step.prev_row < 0:
            return False
        state = self.matchers.get(step.seq_id)
        return state is not None and state.epoch == step.epoch and state.next_position == step.start

    def prepare(self, step, sample_position: int, previous_token) -> _Matcher:
        """The matcher of ``step``'s sequence, advanced to ``sample_position``.

        A new sequence or a new epoch (recomputation) is built from ``step.structured_output_ids``;
        otherwise the input token of this step is accepted if the matcher has not seen it yet
        (``previous_token()`` gives it when it is on the device: from the previous step's results).
        """
        state = self.matchers.get(step.seq_id)
        if state is None or state.epoch != step.epoch:
            matcher = _xgr().GrammarMatcher(self.cache.get(step.params.structured))
            for token in step.structured_output_ids:
                if not matcher.accept_token(token):
                    log.warning("sequence %d: replayed token %d rejected by its grammar", step.seq_id, token)
                    break
            state = _Matcher(matcher, step.epoch, step.num_prompt_tokens + len(step.structured_output_ids))
            self.matchers[step.seq_id] = state
        if state.next_position == sample_position - 1:
            token = step.token_ids[-1] if step.prev_row < 0 else previous_token()
            self._accept(step.seq_id, state, token)
        if state.next_position != sample_position:
            raise RuntimeError(f"sequence {step.seq_id}: matcher at position {state.next_position}, "
                               f"sampling position {sample_position}")
        return state

    def accept_sampled(self, seq_id: int, epoch: int, position: int, token: int) -> None:
        """A sampled token reached the host (collect): accept it unless already accepted."""
        state = self.matchers.get(seq_id)
        if state is not None and state.epoch == epoch and state.next_position == position:
            self._accept(seq_id, state, token)

    def _accept(self, seq_id: int, state: _Matcher, token: int) -> None:
        state.next_position += 1
        if state.matcher.is_terminated():
            return  # after EOS: the scheduler finishes the sequence with it
        if not state.matcher.accept_token(token):
            log.warning("sequence %d: token %d is outside its grammar", seq_id, token)

    def fill_bitmask(self, states: list[_Matcher], rows: list[int], num_rows: int, pinned: bool = False) -> torch.Tensor:
        """[num_rows, ceil(V/32)] int32 bitmask: rows listed are filled, the others allow everything.
        ``pinned``: in pinned memory (for a GPU: its upload then makes the host wait for nothing)."""
        xgr = _xgr()
        bitmask = torch.full(xgr.get_bitmask_shape(num_rows, self.vocab_size), -1, dtype=xgr.bitmask_dtype,
                             pin_memory=pinned)  # -1: every token allowed, as allocate_token_bitmask fills it
        for state, row in zip(states, rows):
            if state.matcher.is_terminated():
                bitmask[row].zero_()
                if self.eos_token_id is not None:
                    bitmask[row, self.eos_token_id // 32] = _bit(self.eos_token_id % 32)
            else:
                state.matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed value."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Disallowed tokens of the listed rows get -inf, all rows in one call; other rows are untouched.
    On a GPU: without a host wait when ``bitmask`` is pinned (the rows are uploaded from pinned memory
    too; xgrammar would copy a list of them from pageable memory, which waits for the device)."""
    indices = upload(rows, torch.int32, logits.device) if logits.device.type == "cuda" else rows
    _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab_size,
                                       indices=indices)
