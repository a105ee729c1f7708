"""Logs and metrics of a real ``mini-deepinfer serve`` (frontend, engine core and two workers as
processes, driven by the official ``openai`` client): one log format with the process and DP rank
on every line, the startup summary, the stats and per-request lines, ``--log-level WARNING``
reaching every process, vLLM's metric names with the ``model_name`` label, and a Grafana dashboard
whose every metric exists on /metrics."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from server_harness import REPO, start_server, stop_server

LINE = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) +"
                  r"\[(frontend|engine-core|worker-dp\d+) pid=\d+\] [\w.]+: ")
DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
NAMES = ("tiny", "alias-b")


def _drive(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:  # every served name is accepted as `model`
        done = client.completions.create(model=name, prompt="The engine", max_tokens=5, temperature=0,
                                         extra_headers={"X-Request-Id": f"obs-{name}"})
        assert done.choices[0].finish_reason == "length" and done.model == NAMES[0]
    chunks = list(client.chat.completions.create(model=NAMES[1], messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks


def _stop_and_read(process) -> list[str]:
    stop_server(process)
    return process.stdout.read().splitlines()


def _series(text: str) -> dict[str, dict[str, str]]:
    """sample name -> labels of one of its series, from the Prometheus text format."""
    found = {}
    for match in re.finditer(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\} \S+$", text, re.M):
        found.setdefault(match.group(1), dict(re.findall(r'(\w+)="([^"]*)"', match.group(2))))
    return found


class RunningServer:
    """A ``serve`` subprocess; ``stop()`` (idempotent) ends it and returns its output lines."""

    def __init__(self, checkpoint, *flags: str):
        self.process, self.base = start_server(checkpoint, *flags, max_num_seqs=4)
        self._lines: list[str] | None = None

    def stop(self) -> list[str]:
        if self._lines is None:
            self._lines = _stop_and_read(self.process)
        return self._lines


@pytest.fixture(scope="module")
def info_server(tiny_checkpoint):
    """A server at INFO (after the subcommand, overriding the harness's WARNING before it) with two
    DP ranks, that has served a few requests; the last test of the module reads its logs."""
    server = RunningServer(tiny_checkpoint, "--log-level", "INFO", "-dp", "2", "--log-stats-interval", "0.2",
                           "--served-model-name", *NAMES)
    try:
        _drive(server.base)
        yield server
    finally:
        server.stop()


def test_grafana_dashboard_metrics_exist_with_vllm_labels(info_server):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    used = {name for expr in exprs for name in re.findall(r"\b((?:vllm|minideepinfer):\w+)", expr)}
    assert len(used) >= 15 and any(n.startswith("vllm:") for n in used)
    series = _series(httpx.get(f"{info_server.base}/metrics").text)
    assert sorted(used - set(series)) == []
    for name in used:
        assert series[name]["model_name"] == NAMES[0] and series[name]["engine"] == "0", name
    assert all('model_name="$model_name"' in e for e in exprs if "label_values" not in e)


def test_vllm_metric_values(info_server):
    text = httpx.get(f"{info_server.base}/metrics").text

    def value(sample: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(sample)}\{{[^}}]*\}} (\S+)$", text, re.M))

    assert value("vllm:request_success_total") >= 3 and value("vllm:generation_tokens_total") >= 14
    assert value("vllm:iteration_tokens_total_count") >= 5 and value("vllm:iteration_tokens_total_sum") >= 14
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1 and value("vllm:num_preemptions_total") == 0
    assert value("vllm:prompt_tokens_total") == value("minideepinfer:prompt_tokens_total") > 0
    assert value("minideepinfer:state_slots_total") == 8  # 4 per rank, 2 ranks


def test_info_logs_of_every_process_in_one_format(info_server, tiny_checkpoint):
    """Everything a user sees at INFO (this test stops the module's server to read its output)."""
    base = info_server.base
    time.sleep(0.6)  # the stats lines of the last interval
    lines = info_server.stop()
    text = "\n".join(lines)
    odd = [line for line in lines if line.strip() and not LINE.match(line)]
    assert odd == [], odd  # one format for every line, uvicorn's included
    for process_name in ("frontend", "engine-core", "worker-dp0", "worker-dp1"):
        assert f"INFO  [{process_name} pid=" in text, process_name
    assert re.search(r"\[frontend pid=\d+\] uvicorn.error: Started server process", text)
    assert re.search(r"\[frontend pid=\d+\] uvicorn.access: .*\"POST /v1/completions HTTP/1.1\" 200", text)
    summary = [
        rf"mini-deepinfer \S+: DeepSeek-V4.1 from {re.escape(str(tiny_checkpoint))}, served as 'tiny', 'alias-b'",
        r"devices: cpu \(1 thread\), cpu \(1 thread\)",
        r"parallel layout: data parallel 2 \(one worker per rank\), 4 routed experts sharded 2 per rank",
        r"dtypes: weights fp8 e4m3 dense \+ fp4 e2m1 experts \(UE8M0 block scales\); KV cache window fp8 e4m3 "
        r"\(UE8M0 scale per 32\), compressed KV fp4 e2m1 \(E4M3 scale per 16\), index keys fp4 e2m1 \(UE8M0 scale "
        r"per 32\)",
        r"kernels: reference; batch invariance on; zero-overhead scheduling on; CUDA graphs none \(eager: not on cuda\)",
        r"KV cache: [\d,]+ tokens per rank \(\d+ blocks of 128, [\d.]+ MiB\) \+ 4 state slots",
        r"max_model_len 4096 \(model limit 4096\): max concurrency 8.00 sequences at 4096 tokens \(4.00 per rank",
        rf"listening on {re.escape(base)} \(OpenAI API under /v1",
    ]
    for pattern in summary:
        assert re.search(r"\[frontend pid=\d+\] frontend.server: " + pattern, text), pattern
    for name in NAMES:
        assert re.search(rf"frontend.requests: request obs-{name}-\d+-0 finished \(length\): \d+ prompt \+ 5 output "
                         r"tokens, TTFT [\d.]+ s, total [\d.]+ s", text), name
    stats = re.findall(r"frontend.stats: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
                       r"([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, "
                       r"State slots: \d+/8, Preemptions: 0", text)
    assert stats and any(float(generation) > 0 for _, generation in stats)


def test_log_level_warning_silences_info_in_every_process(tiny_checkpoint):
    """``--log-level WARNING`` after the subcommand reaches the engine core and the workers: a
    server that starts, serves and drains writes nothing at all."""
    server = RunningServer(tiny_checkpoint, "--log-level", "WARNING", "-dp", "2", "--served-model-name", *NAMES)
    try:
        _drive(server.base)
    finally:
        lines = server.stop()
    assert [line for line in lines if line.strip()] == []


def test_disable_log_requests_and_stats(tiny_checkpoint):
    server = RunningServer(tiny_checkpoint, "--log-level", "INFO", "--disable-log-requests", "--disable-log-stats",
                           "--disable-uvicorn-access-log", "--log-stats-interval", "0.2", "--served-model-name", *NAMES)
    try:
        _drive(server.base)
        time.sleep(0.5)
    finally:
        text = "\n".join(server.stop())
    assert "listening on" in text  # INFO is on...
    for quiet in ("frontend.requests", "frontend.stats", "uvicorn.access"):  # ...but these lines are off
        assert quiet not in text, quiet
