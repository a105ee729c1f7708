"""Graceful drain: SIGTERM on a real server process (the frontend on a fake engine).

Before, uvicorn's own handler closed the listener and, after a fixed grace, cancelled the streams
in flight without a word to their clients. Now: admission stops (503 with Retry-After, /health
"draining"), requests in flight finish within --shutdown-timeout or end with an error event /
error response, and the process exits 0; a second signal forces the exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import REPO, free_port, wait_healthy



@pytest.fixture()
def start_server():
    processes = []

    def start(shutdown_timeout: float, per_token_s: float = 0.005) -> tuple[subprocess.Popen, str]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "frontend.fake_engine", "--port", str(port),
                                 "--per-token-s", str(per_token_s), "--shutdown-timeout", str(shutdown_timeout)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        processes.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, timeout=60)
        return proc, url

    yield start
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stream_in_thread(url: str, max_tokens: int) -> tuple[threading.Thread, list[str], threading.Event]:
    """A streaming completion read in a thread; the event is set once its first token arrived."""
    lines: list[str] = []
    first = threading.Event()

    def run():
        body = {"prompt": "Tell me a story", "max_tokens": max_tokens, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()
        except httpx.HTTPError:
            lines.append("<connection closed>")  # a forced exit cuts the stream

    thread = threading.Thread(target=run)
    thread.start()
    assert first.wait(10)
    return thread, lines, first


def _refuses_new_work(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "new", "max_tokens": 1}, timeout=5)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "server_shutting_down"
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining"


def test_sigterm_lets_streams_finish_within_the_timeout(start_server):
    proc, url = start_server(shutdown_timeout=10)
    thread, lines, _ = _stream_in_thread(url, max_tokens=150)  # ~0.75 s of tokens
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    _refuses_new_work(url)
    thread.join(15)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("error" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(15) == 0


def test_sigterm_stops_streams_past_the_timeout(start_server):
    proc, url = start_server(shutdown_timeout=1)
    thread, lines, _ = _stream_in_thread(url, max_tokens=3000)  # ~15 s: longer than the timeout
    blocking: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: blocking.append(httpx.post(
        url + "/v1/completions", json={"prompt": "wait", "max_tokens": 3000}, timeout=30)))
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    _refuses_new_work(url)
    thread.join(15)
    waiter.join(15)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "server_shutdown"
    assert blocking[0].status_code == 503 and blocking[0].json()["error"]["code"] == "server_shutdown"
    assert proc.wait(15) == 0
    assert time.monotonic() - started < 8


def test_second_signal_forces_exit(start_server):
    proc, url = start_server(shutdown_timeout=30)
    thread, _, _ = _stream_in_thread(url, max_tokens=3000)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None  # draining, waiting for the stream
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 1 and time.monotonic() - started < 5
    thread.join(10)
