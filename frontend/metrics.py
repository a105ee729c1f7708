"""Prometheus metrics of one app, in its own ``CollectorRegistry`` (several apps in one process,
as in the tests, must not collide in the global registry).

* gauges read from ``engine.stats()`` at scrape time (already summed over DP ranks), plus the
  frontend's own count of requests still waiting for their first output;
* latency histograms in seconds (TTFT, inter-token latency, end-to-end, queue time), with buckets
  that reach down to the millisecond a fast engine needs and up to the minutes of a long request;
* counters: finished requests by reason, prompt and generated tokens, aborts, rejections.

``RequestTimer`` follows one engine request and feeds the histograms and counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine_core.protocol import RequestOutput

from .engine_client import EngineClientBase

PREFIX = "minideepinfer"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0, 1280.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineGauges(Collector):
    """Scheduler gauges, read when Prometheus scrapes (no background polling)."""

    def __init__(self, engine: EngineClientBase, frontend_waiting: Callable[[], int]):
        self.engine, self.frontend_waiting = engine, frontend_waiting

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.engine.stats()
        gauges = {
            "requests_running": ("Requests running in the engine (all DP ranks).", stats.running),
            "requests_waiting": ("Requests waiting in the engine's queue (all DP ranks).", stats.waiting),
            "kv_blocks_used": ("KV cache blocks in use.", stats.kv_blocks_used),
            "kv_blocks_total": ("KV cache blocks in all.", stats.kv_blocks_total),
            "state_slots_used": ("Sequence state slots in use.", stats.state_slots_used),
            "state_slots_total": ("Sequence state slots in all.", stats.state_slots_total),
            "frontend_requests_pending": ("Engine requests the frontend sent that have no output yet.",
                                          self.frontend_waiting()),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class FrontendMetrics:
    def __init__(self, engine: EngineClientBase, frontend_waiting: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineGauges(engine, frontend_waiting))
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between two outputs of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}_request_queue_time_seconds",
                                    "Time from arrival until the engine first scheduled the request.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Finished engine requests, by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of engine requests (prefilled).",
                                     registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=r)
        self.aborted = Counter(f"{PREFIX}_requests_aborted",
                               "Engine requests aborted before they finished (client disconnect, error).",
                               registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests rejected with 503 (queue full).",
                                registry=r)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)  # exported at 0 from the start

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency and token accounting of one engine request, from arrival to finish or abort."""

    __slots__ = ("metrics", "arrival", "arrival_wall", "last_output", "num_tokens", "done")

    def __init__(self, metrics: FrontendMetrics, arrival: float, arrival_wall: float):
        self.metrics = metrics
        self.arrival, self.arrival_wall = arrival, arrival_wall  # monotonic and wall-clock
        self.last_output: float | None = None
        self.num_tokens = 0
        self.done = False

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if self.last_output is None:  # the prefill is done: first output
            m.prompt_tokens.inc(output.num_prompt_tokens)
            if output.first_scheduled_time:
                m.queue_time.observe(max(0.0, output.first_scheduled_time - self.arrival_wall))
            if output.new_token_ids:
                m.ttft.observe(now - self.arrival)
        elif output.new_token_ids:
            m.itl.observe(now - self.last_output)
        if output.new_token_ids:
            self.last_output = now
            self.num_tokens += len(output.new_token_ids)
            m.generation_tokens.inc(len(output.new_token_ids))
        elif self.last_output is None:
            self.last_output = now

    def on_finish(self, finish_reason: str) -> None:
        if not self.done:
            self.done = True
            self.metrics.finished.labels(finish_reason).inc()
            self.metrics.e2e.observe(time.monotonic() - self.arrival)

    def on_abort(self) -> None:
        if not self.done:
            self.done = True
            self.metrics.aborted.inc()
