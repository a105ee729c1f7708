"""The periodic stats line of ``serve`` (off with ``--disable-log-stats``), worded as vLLM's so the
same log searches work:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 190.2 tokens/s, Running: 12 reqs,
    Waiting: 0 reqs, KV cache usage: 31.0%, State slots: 12/64, Preemptions: 0

Throughputs are averaged over the interval, from the frontend's token counts (the ones behind
``prompt_tokens_total`` / ``generation_tokens_total``); the rest is the engine's latest report
(all DP ranks together; preemptions counted since start). A line is written every interval
while the engine is busy, and one more when it goes idle, so an idle server stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .engine_client import EngineClientBase
from .metrics import FrontendMetrics

log = logging.getLogger("frontend.stats")


class StatsLogger:
    def __init__(self, engine: EngineClientBase, metrics: FrontendMetrics, interval_s: float):
        self.engine, self.metrics, self.interval_s = engine, metrics, interval_s
        self._last_time = time.monotonic()
        self._last_prompt = self._last_generation = 0
        self._was_busy = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_once()

    def log_once(self) -> str | None:
        """Write the line if there is something to say; returns it (or None)."""
        now = time.monotonic()
        totals, stats = self.metrics.totals, self.engine.stats()
        elapsed = max(now - self._last_time, 1e-9)
        prompt_rate = (totals.prompt_tokens - self._last_prompt) / elapsed
        generation_rate = (totals.generation_tokens - self._last_generation) / elapsed
        self._last_time, self._last_prompt, self._last_generation = now, totals.prompt_tokens, totals.generation_tokens
        busy = bool(prompt_rate or generation_rate or stats.running or stats.waiting)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        kv_usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        line = (f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: "
                f"{generation_rate:.1f} tokens/s, Running: {stats.running} reqs, Waiting: {stats.waiting} reqs, "
                f"KV cache usage: {100 * kv_usage:.1f}%, State slots: {stats.state_slots_used}/"
                f"{stats.state_slots_total}, Preemptions: {stats.preemptions}")
        log.info("%s", line)
        return line
