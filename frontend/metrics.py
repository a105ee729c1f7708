"""Prometheus metrics of one app, in its own ``CollectorRegistry`` (several apps in one process,
as in the tests, must not collide in the global registry).

Names and labels follow vLLM's, so dashboards made for vLLM work: every metric is exported as
``PREFIX:name`` (``--metrics-prefix``, default ``minideepinfer``), where ``name`` is vLLM's name
whenever vLLM has the metric (``num_requests_running``, ``kv_cache_usage_perc``,
``time_to_first_token_seconds``, ...), and the ones vLLM defines are exported a second time under
``vllm:`` (``--no-vllm-metrics-alias`` turns that off). Every series carries vLLM's labels
``model_name`` (the first served name) and ``engine`` (always "0": one engine core serves all DP
ranks); ``request_success`` adds ``finished_reason``. ``METRICS`` lists them all (and
docs/configuration.md is generated from it).

* gauges and the engine's counters are read from ``engine.stats()`` when Prometheus scrapes (no
  background polling), summed over DP ranks; the tokens-per-step histogram comes from there too;
* the same engine values per DP rank are separate ``*_per_rank`` families with a ``dp_rank`` label
  (ours only: vLLM runs one engine per rank and tells them apart by ``engine``, which here stays
  "0"). They are not extra series of the summed families, so that ``sum(...)`` over a family,
  as every vLLM dashboard does, still counts each sequence once. There is no per-rank waiting:
  the queue is shared and a sequence gets its rank only when it is admitted;
* latency and length histograms, finished/aborted/rejected counters: ``RequestTimer`` follows one
  engine request from arrival to finish and records them (and the request's log line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine_core.protocol import ITERATION_TOKEN_BUCKETS, RequestOutput

from .engine_client import EngineClientBase

DEFAULT_PREFIX = "minideepinfer"
VLLM_PREFIX = "vllm"
LABELS = ("model_name", "engine")
RANK_LABELS = (*LABELS, "dp_rank")
FINISH_REASONS = ("stop", "length", "abort")
request_log = logging.getLogger("frontend.requests")


@dataclass(frozen=True)
class MetricInfo:
    name: str  # after "PREFIX:"; counters without their "_total" suffix
    kind: str  # gauge | counter | histogram
    help: str
    vllm_names: tuple[str, ...] = ()  # the names vLLM exports it under (vllm:...), if any


METRICS: tuple[MetricInfo, ...] = (
    MetricInfo("num_requests_running", "gauge", "Requests running in the engine (all DP ranks).",
               ("num_requests_running",)),
    MetricInfo("num_requests_waiting", "gauge",
               "Requests waiting in the engine's queue (one queue for all DP ranks: a request gets its rank "
               "when it is admitted).", ("num_requests_waiting",)),
    MetricInfo("kv_cache_usage_perc", "gauge", "KV-cache usage: the fraction of KV blocks in use (1 means 100 percent).",
               ("kv_cache_usage_perc", "gpu_cache_usage_perc")),
    MetricInfo("kv_blocks_used", "gauge", "KV cache blocks in use (all DP ranks)."),
    MetricInfo("kv_blocks_total", "gauge", "KV cache blocks in all (all DP ranks)."),
    MetricInfo("state_slots_used", "gauge", "Per-sequence state slots in use (all DP ranks)."),
    MetricInfo("state_slots_total", "gauge", "Per-sequence state slots in all (all DP ranks)."),
    MetricInfo("num_requests_running_per_rank", "gauge", "Requests running on each DP rank (label dp_rank)."),
    MetricInfo("kv_cache_usage_perc_per_rank", "gauge",
               "KV-cache usage of each DP rank (label dp_rank): the fraction of its KV blocks in use."),
    MetricInfo("kv_blocks_used_per_rank", "gauge", "KV cache blocks in use on each DP rank (label dp_rank)."),
    MetricInfo("state_slots_used_per_rank", "gauge",
               "Per-sequence state slots in use on each DP rank (label dp_rank)."),
    MetricInfo("frontend_requests_pending", "gauge", "Engine requests the frontend sent that have no output yet."),
    MetricInfo("num_preemptions", "counter", "Sequences preempted (their cache freed, recomputed later).",
               ("num_preemptions",)),
    MetricInfo("num_preemptions_per_rank", "counter", "Sequences preempted on each DP rank (label dp_rank)."),
    MetricInfo("scheduled_tokens_per_rank", "counter",
               "Prompt and decode tokens scheduled on each DP rank (label dp_rank): its share of the work."),
    MetricInfo("expert_load_imbalance", "gauge",
               "Routed-expert load imbalance over the DP ranks: per MoE layer the busiest rank's (token, expert) "
               "pairs over the mean rank's, summed over layers (1 is a perfect balance), in the last window the "
               "workers reported (docs/expert-load-balance.md)."),
    MetricInfo("expert_routed_pairs_per_rank", "counter",
               "(token, expert) pairs the routed experts of each DP rank computed (label dp_rank), counted with "
               "expert parallelism or --eplb-stats-file."),
    MetricInfo("expert_rebalances", "counter",
               "Expert placements changed while serving (--eplb-step-interval): expert weights moved between ranks."),
    MetricInfo("prompt_tokens", "counter", "Prompt tokens of the requests prefilled.", ("prompt_tokens",)),
    MetricInfo("generation_tokens", "counter", "Tokens generated.", ("generation_tokens",)),
    MetricInfo("request_success", "counter", "Engine requests finished, by finished_reason (stop, length, abort).",
               ("request_success",)),
    MetricInfo("requests_aborted", "counter", "Engine requests aborted by the frontend (client gone, error)."),
    MetricInfo("requests_rejected", "counter", "Requests rejected with 503 (queue full)."),
    MetricInfo("iteration_tokens_total", "histogram", "Tokens per engine step (all DP ranks).",
               ("iteration_tokens_total",)),
    MetricInfo("time_to_first_token_seconds", "histogram", "Time from arrival to the first token.",
               ("time_to_first_token_seconds",)),
    MetricInfo("inter_token_latency_seconds", "histogram", "Time between two outputs of a request.",
               ("inter_token_latency_seconds", "time_per_output_token_seconds")),
    MetricInfo("request_time_per_output_token_seconds", "histogram",
               "Per request: decode time / (output tokens - 1).", ("request_time_per_output_token_seconds",)),
    MetricInfo("e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
               ("e2e_request_latency_seconds",)),
    MetricInfo("request_queue_time_seconds", "histogram", "Time from arrival until the engine first scheduled it.",
               ("request_queue_time_seconds",)),
    MetricInfo("request_prefill_time_seconds", "histogram", "Time from first scheduled to the first token.",
               ("request_prefill_time_seconds",)),
    MetricInfo("request_decode_time_seconds", "histogram", "Time from the first token to the last.",
               ("request_decode_time_seconds",)),
    MetricInfo("request_inference_time_seconds", "histogram", "Time from first scheduled to the last token.",
               ("request_inference_time_seconds",)),
    MetricInfo("request_prompt_tokens", "histogram", "Prompt tokens per finished request.", ("request_prompt_tokens",)),
    MetricInfo("request_generation_tokens", "histogram", "Generated tokens per finished request.",
               ("request_generation_tokens",)),
)
_INFO = {m.name: m for m in METRICS}

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0, 1280.0)
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 5M

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    """Scheduler gauges and counters, read when Prometheus scrapes."""

    def __init__(self, engine: EngineClientBase, frontend_waiting: Callable[[], int], prefix: str,
                 label_values: list[str]):
        self.engine, self.frontend_waiting = engine, frontend_waiting
        self.prefix, self.label_values = prefix, label_values

    def _family(self, cls, name: str, labels: tuple[str, ...] = LABELS, **kwargs):
        return cls(f"{self.prefix}:{name}", _INFO[name].help, labels=labels, **kwargs)

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        gauges = {
            "num_requests_running": stats.running, "num_requests_waiting": stats.waiting,
            "kv_cache_usage_perc": stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0,
            "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
            "state_slots_used": stats.state_slots_used, "state_slots_total": stats.state_slots_total,
            "frontend_requests_pending": self.frontend_waiting(),
            "expert_load_imbalance": stats.expert_load_imbalance,
        }
        for name, value in gauges.items():
            family = self._family(GaugeMetricFamily, name)
            family.add_metric(self.label_values, value)
            yield family
        for name, value in (("num_preemptions", stats.preemptions), ("expert_rebalances", stats.expert_rebalances)):
            counter = self._family(CounterMetricFamily, name)
            counter.add_metric(self.label_values, value)
            yield counter
        yield self._iteration_tokens(stats.step_token_counts, stats.step_tokens_sum)
        yield from self._per_rank(stats)

    def _per_rank(self, stats) -> Iterator[Metric]:
        usage = [used / total if total else 0.0 for used, total in zip(stats.rank_kv_blocks_used,
                                                                      stats.rank_kv_blocks_total)]
        families = (
            (GaugeMetricFamily, "num_requests_running_per_rank", stats.rank_running),
            (GaugeMetricFamily, "kv_cache_usage_perc_per_rank", usage),
            (GaugeMetricFamily, "kv_blocks_used_per_rank", stats.rank_kv_blocks_used),
            (GaugeMetricFamily, "state_slots_used_per_rank", stats.rank_state_slots_used),
            (CounterMetricFamily, "num_preemptions_per_rank", stats.rank_preemptions),
            (CounterMetricFamily, "scheduled_tokens_per_rank", stats.rank_tokens_scheduled),
            (CounterMetricFamily, "expert_routed_pairs_per_rank", stats.rank_expert_pairs),
        )
        for cls, name, values in families:
            family = self._family(cls, name, RANK_LABELS)
            for rank, value in enumerate(values):
                family.add_metric([*self.label_values, str(rank)], value)
            yield family

    def _iteration_tokens(self, counts: list[int], total_tokens: int) -> HistogramMetricFamily:
        counts = list(counts) or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        buckets, cumulative = [], 0
        for bound, count in zip((*ITERATION_TOKEN_BUCKETS, float("inf")), counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = self._family(HistogramMetricFamily, "iteration_tokens_total")
        family.add_metric(self.label_values, buckets, total_tokens)
        return family


class _Alias(Collector):
    """The metrics vLLM defines, again under their ``vllm:`` names (same samples, renamed)."""

    def __init__(self, sources: list, prefix: str):
        self.sources, self.prefix = sources, prefix

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for family in source.collect():
                info = _INFO[family.name.split(":", 1)[1]]
                for alias in info.vllm_names:
                    yield _renamed(family, f"{VLLM_PREFIX}:{alias}")


def _renamed(family: Metric, name: str) -> Metric:
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return copy


@dataclass
class Totals:
    """Plain running totals (the periodic stats line reads them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0


class FrontendMetrics:
    def __init__(self, engine: EngineClientBase, frontend_waiting: Callable[[], int] = lambda: 0, *,
                 model_name: str = "", prefix: str = DEFAULT_PREFIX, vllm_alias: bool = True,
                 log_requests: bool = False):
        self.registry = r = CollectorRegistry()
        self.prefix, self.log_requests = prefix, log_requests
        self.totals = Totals()
        label_values = [model_name, "0"]
        self._engine = _EngineCollector(engine, frontend_waiting, prefix, label_values)
        r.register(self._engine)
        sources: list = [self._engine]

        def metric(cls, name: str, extra_labels: tuple[str, ...] = (), **kwargs):
            parent = cls(f"{prefix}:{name}", _INFO[name].help, (*LABELS, *extra_labels), registry=r, **kwargs)
            sources.append(parent)
            return parent if extra_labels else parent.labels(*label_values)

        self.ttft = metric(Histogram, "time_to_first_token_seconds", buckets=TTFT_BUCKETS)
        self.itl = metric(Histogram, "inter_token_latency_seconds", buckets=ITL_BUCKETS)
        self.tpot = metric(Histogram, "request_time_per_output_token_seconds", buckets=ITL_BUCKETS)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds", buckets=REQUEST_BUCKETS)
        self.queue_time = metric(Histogram, "request_queue_time_seconds", buckets=QUEUE_BUCKETS)
        self.prefill_time = metric(Histogram, "request_prefill_time_seconds", buckets=REQUEST_BUCKETS)
        self.decode_time = metric(Histogram, "request_decode_time_seconds", buckets=REQUEST_BUCKETS)
        self.inference_time = metric(Histogram, "request_inference_time_seconds", buckets=REQUEST_BUCKETS)
        self.request_prompt_tokens = metric(Histogram, "request_prompt_tokens", buckets=TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = metric(Histogram, "request_generation_tokens", buckets=TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = metric(Counter, "prompt_tokens")
        self.generation_tokens = metric(Counter, "generation_tokens")
        self.aborted = metric(Counter, "requests_aborted")
        self.rejected = metric(Counter, "requests_rejected")
        self._success, self._label_values = metric(Counter, "request_success", ("finished_reason",)), label_values
        for reason in FINISH_REASONS:
            self.finished_with(reason)  # exported at 0 from the start
        if vllm_alias and prefix != VLLM_PREFIX:
            r.register(_Alias(sources, prefix))

    def set_pending_source(self, frontend_waiting: Callable[[], int]) -> None:
        """Where the frontend_requests_pending gauge reads its value (the serving context, made after this)."""
        self._engine.frontend_waiting = frontend_waiting

    def finished_with(self, reason: str):
        """The request_success counter of one finish reason."""
        return self._success.labels(*self._label_values, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency and token accounting of one engine request, from arrival to finish or abort, and
    its log line (``--disable-log-requests`` turns the line off)."""

    __slots__ = ("metrics", "arrival", "arrival_wall", "request_id", "first_scheduled", "first_token", "last_output",
                 "num_prompt_tokens", "num_tokens", "done")

    def __init__(self, metrics: FrontendMetrics, arrival: float, arrival_wall: float, request_id: str | None = None):
        self.metrics = metrics
        self.arrival, self.arrival_wall = arrival, arrival_wall  # monotonic and wall-clock
        self.request_id = request_id  # else taken from the first output
        self.first_scheduled: float | None = None  # monotonic
        self.first_token: float | None = None
        self.last_output: float | None = None
        self.num_prompt_tokens = 0
        self.num_tokens = 0
        self.done = False

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        if self.last_output is None:  # the prefill is done: first output
            self.request_id = self.request_id or output.request_id
            self.num_prompt_tokens = output.num_prompt_tokens
            m.prompt_tokens.inc(output.num_prompt_tokens)
            m.totals.prompt_tokens += output.num_prompt_tokens
            if output.first_scheduled_time:
                queued = min(max(0.0, output.first_scheduled_time - self.arrival_wall), now - self.arrival)
                self.first_scheduled = self.arrival + queued
                m.queue_time.observe(queued)
            if output.new_token_ids:
                self.first_token = now
                m.ttft.observe(now - self.arrival)
        elif output.new_token_ids:
            if self.first_token is None:
                self.first_token = now
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last_output)
        if output.new_token_ids:
            self.last_output = now
            self.num_tokens += len(output.new_token_ids)
            m.generation_tokens.inc(len(output.new_token_ids))
            m.totals.generation_tokens += len(output.new_token_ids)
        elif self.last_output is None:
            self.last_output = now

    def on_finish(self, finish_reason: str) -> None:
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        m = self.metrics
        m.finished_with(finish_reason).inc()
        m.e2e.observe(now - self.arrival)
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        if self.first_scheduled is not None:
            m.inference_time.observe(now - self.first_scheduled)
            if self.first_token is not None:
                m.prefill_time.observe(self.first_token - self.first_scheduled)
        if self.first_token is not None:
            decode = now - self.first_token
            m.decode_time.observe(decode)
            if self.num_tokens > 1:
                m.tpot.observe(decode / (self.num_tokens - 1))
        self._log(f"finished ({finish_reason})", now)

    def on_abort(self) -> None:
        if not self.done:
            self.done = True
            self.metrics.aborted.inc()
            self._log("aborted", time.monotonic())

    def _log(self, outcome: str, now: float) -> None:
        if not self.metrics.log_requests:
            return
        ttft = f"{self.first_token - self.arrival:.3f} s" if self.first_token is not None else "-"
        request_log.info("request %s %s: %d prompt + %d output tokens, TTFT %s, total %.3f s",
                         self.request_id or "(before its first output)", outcome, self.num_prompt_tokens,
                         self.num_tokens, ttft, now - self.arrival)


def metric_names(prefix: str, vllm_alias: bool) -> Iterable[str]:
    """The metric family names exported (docs and tests)."""
    for info in METRICS:
        yield f"{prefix}:{info.name}"
    if vllm_alias and prefix != VLLM_PREFIX:
        for info in METRICS:
            for alias in info.vllm_names:
                yield f"{VLLM_PREFIX}:{alias}"
