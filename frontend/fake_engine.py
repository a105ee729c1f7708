"""``FakeEngineClient``: an engine without a model, for testing and benchmarking the frontend alone.

It behaves like the real engine core as the HTTP layer sees it: requests wait (up to
``max_num_seqs`` run at once), the first token comes ``ttft_s`` after a request is scheduled and
one more every ``per_token_s``; all running requests advance together in one step loop, as in a
batched engine, and outputs a slow consumer has not read yet are merged into one delta.

Tokens are pseudo-random but deterministic: a function of (request seed, position) only. The
seed is the request's ``seed`` mixed with its prompt, the prompt alone for greedy requests
(temperature 0), and the request id when no seed is given. ``max_tokens``, ``min_tokens``,
``stop_token_ids``, eos, ``ignore_eos``, ``logprobs`` (the sampled token is always the top-1 entry)
and ``prompt_logprobs`` are honoured. Aborts are counted and remembered, and ``stats()`` reports
the gauges a real scheduler would (one KV block per ``block_size`` tokens of each running request,
one state slot per running request), so tests can check that they return to zero.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_core.protocol import ITERATION_TOKEN_BUCKETS, RequestOutput, SamplingParams, SchedulerStats, TokenLogprob

from .engine_client import EngineClientBase, EngineDeadError, EngineInfo, QueueFullError
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .server import BackgroundServer

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64: a cheap, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _fake_logprob(h: int) -> float:
    return -0.05 - ((h >> 16) % 1000) / 400.0


@dataclass(eq=False)
class _FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    queue: asyncio.Queue
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    first_scheduled_time: float = 0.0
    next_token_at: float = 0.0


class FakeEngineClient(EngineClientBase):
    def __init__(self, *, vocab_size: int = 1024, max_model_len: int = 4096, eos_token_id: int | None = 1,
                 avoid_token_ids: frozenset[int] = frozenset(), ttft_s: float = 0.0, per_token_s: float = 0.0,
                 max_num_seqs: int = 256, max_waiting: int | None = None, block_size: int = 128,
                 num_blocks: int = 8192, eos_probability: float = 0.0):
        self.info = EngineInfo(max_model_len, vocab_size, eos_token_id)
        self.avoid_token_ids = avoid_token_ids  # never sampled (special tokens: bos, role markers, ...)
        self.ttft_s, self.per_token_s = ttft_s, per_token_s
        self.max_num_seqs, self.max_waiting = max_num_seqs, max_waiting
        self.block_size, self.num_blocks = block_size, num_blocks
        self.eos_probability = eos_probability
        self._live: dict[str, _FakeRequest] = {}
        self._waiting: deque[_FakeRequest] = deque()
        self._running: list[_FakeRequest] = []
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_reason: str | None = None
        # what tests look at
        self.num_requests = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.aborted_ids: list[str] = []
        self.received: dict[str, tuple[list[int], SamplingParams]] = {}  # request id -> what arrived
        # steps by tokens (a request's first step counts its prompt, later ones one token), as a real engine reports
        self.step_token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.step_tokens_sum = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._step_loop(), name="fake-engine-steps")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
        self._fail_all(EngineDeadError("the engine was shut down"))

    def kill(self, reason: str = "killed by the test") -> None:
        """Simulate an engine crash: every live request fails, health turns false."""
        self._dead_reason = reason
        self._fail_all(EngineDeadError(reason))

    def kill_threadsafe(self, reason: str = "killed by the test") -> None:
        """``kill`` from another thread (a test driving a server that runs in a background thread)."""
        self._loop.call_soon_threadsafe(self.kill, reason)

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    def _fail_all(self, error: Exception) -> None:
        for request in self._live.values():
            request.queue.put_nowait(error)
        self._live.clear()
        self._waiting.clear()
        self._running.clear()

    # ------------------------------------------------------------------ EngineClientBase
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        request = self._admit(request_id, prompt_token_ids, params)
        finished = False
        try:
            while True:
                item = await request.queue.get()
                if isinstance(item, Exception):
                    finished = True  # nothing left to abort
                    raise item
                item = self._merge_queued(request.queue, item)
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    def _admit(self, request_id: str, prompt: list[int], params: SamplingParams) -> _FakeRequest:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._loop_task is None:
            raise RuntimeError("FakeEngineClient.start() was not awaited")
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("empty prompt")
        if any(not 0 <= t < self.info.vocab_size for t in prompt):
            raise ValueError("prompt token id out of range")
        if len(prompt) + params.max_tokens > self.info.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.info.max_model_len})")
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting")
        prompt_hash = hash(tuple(prompt))
        if params.is_greedy:
            seed = prompt_hash
        elif params.seed is not None:
            seed = _mix(params.seed ^ prompt_hash)
        else:
            seed = zlib.crc32(request_id.encode())
        stop_ids = set(params.stop_token_ids)
        if self.info.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.info.eos_token_id)
        request = _FakeRequest(request_id, list(prompt), params, seed & _MASK64, asyncio.Queue(), frozenset(stop_ids))
        self.num_requests += 1
        self.received[request_id] = (request.prompt_ids, params)
        self._live[request_id] = request
        self._waiting.append(request)
        self._wake.set()
        return request

    @staticmethod
    def _merge_queued(queue: asyncio.Queue, first: RequestOutput) -> RequestOutput:
        """Fold outputs the consumer has not read yet into one delta (stop at an error)."""
        merged = first
        while not queue.empty() and not isinstance(queue._queue[0], Exception):  # type: ignore[attr-defined]
            nxt: RequestOutput = queue.get_nowait()
            logprobs = None
            if merged.logprobs is not None or nxt.logprobs is not None:
                logprobs = (merged.logprobs or []) + (nxt.logprobs or [])
            merged = RequestOutput(merged.request_id, merged.new_token_ids + nxt.new_token_ids,
                                   nxt.finish_reason, nxt.stop_token_id, merged.num_prompt_tokens, logprobs,
                                   merged.prompt_logprobs or nxt.prompt_logprobs, merged.first_scheduled_time)
        return merged

    async def abort(self, request_id: str) -> None:
        request = self._live.pop(request_id, None)
        if request is None:
            return  # finished or aborted already: aborts are idempotent
        if request in self._running:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.num_aborted += 1
        self.aborted_ids.append(request_id)
        request.queue.put_nowait(RequestOutput(request_id, [], "abort", None, len(request.prompt_ids)))
        self._wake.set()  # a freed slot may admit a waiting request

    async def check_health(self, timeout: float = 5.0) -> bool:
        return self._dead_reason is None and self._loop_task is not None and not self._loop_task.done()

    def stats(self) -> SchedulerStats:
        blocks = sum(math.ceil((len(r.prompt_ids) + len(r.output_ids)) / self.block_size) for r in self._running)
        return SchedulerStats(running=len(self._running), waiting=len(self._waiting), kv_blocks_used=blocks,
                              kv_blocks_total=self.num_blocks, state_slots_used=len(self._running),
                              state_slots_total=self.max_num_seqs, step_token_counts=list(self.step_token_counts),
                              step_tokens_sum=self.step_tokens_sum)

    # ------------------------------------------------------------------ the "model"
    async def _step_loop(self) -> None:
        while True:
            if not self._live:
                self._wake.clear()
                await self._wake.wait()
            now = time.monotonic()
            while self._waiting and len(self._running) < self.max_num_seqs:
                request = self._waiting.popleft()
                request.first_scheduled_time = time.time()
                request.next_token_at = now + self.ttft_s
                self._running.append(request)
            next_due = math.inf
            step_tokens = 0
            for request in list(self._running):
                if request.next_token_at <= now:
                    step_tokens += 1 if request.output_ids else len(request.prompt_ids)
                    self._step(request)
                    request.next_token_at = now + self.per_token_s
                if request.request_id in self._live:
                    next_due = min(next_due, request.next_token_at)
            if step_tokens:
                self.step_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, step_tokens)] += 1
                self.step_tokens_sum += step_tokens
            if self._waiting and len(self._running) < self.max_num_seqs:
                next_due = now  # a finished request freed a slot: schedule the waiting ones at once
            delay = next_due - time.monotonic()
            if delay > 0:
                self._wake.clear()
                try:  # an arrival or an abort wakes the loop early, so it is scheduled now
                    await asyncio.wait_for(self._wake.wait(), None if delay == math.inf else delay)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # let the frontend run between steps, as a real engine's IO would

    def _step(self, request: _FakeRequest) -> None:
        params = request.params
        first = not request.output_ids
        prompt_logprobs = self._prompt_logprobs(request) if first and params.prompt_logprobs is not None else None
        if params.max_tokens == 0:  # prefill only: prompt logprobs, no token
            self._finish(request, RequestOutput(request.request_id, [], "length", None, len(request.prompt_ids),
                                                None, prompt_logprobs, request.first_scheduled_time))
            return
        n_out = len(request.output_ids) + 1
        position = len(request.prompt_ids) + n_out - 1
        token, h = self._sample(request, position, may_stop=n_out >= params.min_tokens)
        request.output_ids.append(token)
        finish, stop_token = None, None
        if token in request.stop_ids:
            finish, stop_token = "stop", token
        elif n_out >= params.max_tokens or position + 1 >= self.info.max_model_len:
            finish = "length"
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._logprob(token, h, params.logprobs)]
        output = RequestOutput(request.request_id, [token], finish, stop_token, len(request.prompt_ids),
                               logprobs, prompt_logprobs, request.first_scheduled_time)
        if finish is None:
            request.queue.put_nowait(output)
        else:
            self._finish(request, output)

    def _finish(self, request: _FakeRequest, output: RequestOutput) -> None:
        self._running.remove(request)
        del self._live[request.request_id]
        self.num_finished += 1
        request.queue.put_nowait(output)

    def _sample(self, request: _FakeRequest, position: int, may_stop: bool) -> tuple[int, int]:
        h = _mix(request.seed + position * 0x9E3779B97F4A7C15)
        eos = self.info.eos_token_id
        if (may_stop and eos is not None and eos in request.stop_ids
                and (h >> 11) / float(1 << 53) < self.eos_probability):
            return eos, h
        vocab = self.info.vocab_size
        while True:
            token = h % vocab
            if token == eos or token in self.avoid_token_ids:
                pass  # eos comes only from eos_probability
            elif may_stop or token not in request.stop_ids:
                return token, h
            h = _mix(h)

    def _logprob(self, token: int, h: int, top_n: int) -> TokenLogprob:
        lp = _fake_logprob(h)
        vocab = self.info.vocab_size
        top_ids = [token] + [(token + k) % vocab for k in range(1, top_n)] if top_n else []
        top_lps = [lp - 0.5 * k for k in range(len(top_ids))]
        return TokenLogprob(token, lp, top_ids, top_lps)

    def _prompt_logprobs(self, request: _FakeRequest) -> list[TokenLogprob]:
        """Positions 1..P-1 (the first prompt token has none); a function of the prompt only. The
        prompt token is the top-1 entry at even hashes and missing from the top list at odd ones,
        as a real model's prompt tokens often are."""
        top_n = request.params.prompt_logprobs or 0
        vocab = self.info.vocab_size
        prompt = request.prompt_ids
        entries = []
        h = _mix(prompt[0])
        for i in range(1, len(prompt)):
            token = prompt[i]
            h = _mix(h ^ token)  # a rolling hash of prompt[:i + 1]
            lp = _fake_logprob(h)
            if h % 2 == 0:
                top_ids = [token] + [(token + k) % vocab for k in range(1, top_n)] if top_n else []
                top_lps = [lp - 0.5 * k for k in range(len(top_ids))]
            else:  # more likely alternatives than the prompt token, all logprobs still <= 0
                lp -= 0.5 * (top_n + 1)
                top_ids = [(token + k) % vocab for k in range(1, top_n + 1)]
                top_lps = [lp + 0.5 * (top_n - k + 1) for k in range(1, top_n + 1)]
            entries.append(TokenLogprob(token, lp, top_ids, top_lps))
        return entries


def fake_engine_for(tokenizer: Tokenizer, **kwargs) -> FakeEngineClient:
    """A fake engine that matches a tokenizer: its vocabulary and eos; special tokens never sampled."""
    avoid = frozenset(i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i))
    kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
    return FakeEngineClient(vocab_size=tokenizer.vocab_size, avoid_token_ids=avoid, **kwargs)


_APP_OPTIONS = ("max_seqs_per_request", "max_request_bytes", "metrics_require_key", "sse_keepalive_s",
                "max_running_seqs")


@contextmanager
def serve_fake(tokenizer: Tokenizer | None, *, model_name: str = "fake-model", api_key: str | None = None,
               allowed_origins: tuple[str, ...] = (), max_queued_requests: int = 1024,
               engine: FakeEngineClient | None = None, **kwargs) -> Iterator[tuple["BackgroundServer", FakeEngineClient]]:
    """The real app with a fake engine, served in a background thread: ``(server, engine)``.
    Keyword arguments named in ``_APP_OPTIONS`` go to ``build_app``, the others to the engine."""
    from .server import BackgroundServer, build_app

    app_kwargs = {k: kwargs.pop(k) for k in _APP_OPTIONS if k in kwargs}
    if engine is None:
        engine = fake_engine_for(tokenizer, **kwargs) if tokenizer is not None else FakeEngineClient(**kwargs)
    app = build_app(engine, tokenizer, model_name, api_key, list(allowed_origins), max_queued_requests, **app_kwargs)
    with BackgroundServer(app) as server:
        yield server, engine


def main(argv: list[str] | None = None) -> int:
    """``python -m frontend.fake_engine``: the real server with graceful drain on a fake engine,
    for trying the frontend (and testing shutdown) without a model."""
    import argparse

    from engine_core.log_setup import configure_logging
    from model.checkpoint_maker import default_model_dir

    from .server import build_app, run_app

    parser = argparse.ArgumentParser(prog="python -m frontend.fake_engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--per-token-s", type=float, default=0.01)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--max-queued-requests", type=int, default=1024)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, "frontend")
    tokenizer = Tokenizer(default_model_dir())
    engine = fake_engine_for(tokenizer, per_token_s=args.per_token_s)
    app = build_app(engine, tokenizer, "fake-model", None, [], args.max_queued_requests, log_requests=True)
    server = run_app(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout)
    return 1 if server.forced else 0


if __name__ == "__main__":
    raise SystemExit(main())
