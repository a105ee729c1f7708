"""Killing any one process of a running server (SIGKILL: no handler runs in it) leaves no orphan
process and no socket directory behind, within a few seconds; with two data-parallel ranks under
load, killing one worker ends every open stream with an error event, without a hang.

The server runs as ``mini-deepinfer serve`` in a subprocess with ``TMPDIR`` pointing at a fresh
directory, so its private socket directory is the only thing that can appear there. The helpers
here and in server_harness.py (starting a server, walking its process tree) are shared with
test_liveness.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from server_harness import alive, children, process_name, start_server


@pytest.fixture()
def short_tmp():
    """A fresh TMPDIR with a short path (an ipc:// socket path must fit in 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="mdi-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tree(pid: int) -> dict[str, int]:
    """The server's engine core and worker pids (the spawn children run ``multiprocessing.spawn``)."""
    engines = [c for c in children(pid) if "spawn_main" in process_name(c)]
    assert len(engines) == 1, f"expected one engine core under {pid}: {engines}"
    workers = [c for c in children(engines[0]) if "spawn_main" in process_name(c)]
    assert workers, "no worker process found"
    return {"engine": engines[0], "worker": workers[0]}


def wait_until(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def stop(process: subprocess.Popen, pids) -> None:
    """Leave nothing running, whatever the test did."""
    for pid in [process.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    process.wait(timeout=10)


@pytest.mark.parametrize("victim", ["frontend", "engine", "worker"])
def test_sigkill_leaves_no_orphans_and_no_socket_dir(tiny_checkpoint, short_tmp, victim):
    tmp_path = short_tmp
    process, base = start_server(tiny_checkpoint, tmpdir=tmp_path)
    pids = tree(process.pid)
    try:
        (socket_dir,) = list(tmp_path.iterdir())
        assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
        assert sorted(stat.S_IMODE(p.stat().st_mode) for p in socket_dir.iterdir()) == [0o600] * 4
        os.kill(process.pid if victim == "frontend" else pids[victim], signal.SIGKILL)
        everyone = [process.pid, *pids.values()]
        wait_until(lambda: not any(alive(p) for p in everyone) and not any(tmp_path.iterdir()), timeout=8)
        if victim != "frontend":  # the server noticed the death and said so with its exit code
            assert process.wait(timeout=1) == 1
    finally:
        stop(process, pids.values())


def _stream_until_the_end(base: str, model: str, outcome: dict) -> None:
    """One long streaming completion; records how many chunks came and how the stream ended."""
    body = {"model": model, "prompt": "hello world", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    outcome["chunks"] = 0
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    outcome["end"] = "error event"
                    return
                if line.startswith("data: {"):
                    outcome["chunks"] += 1
                elif line == "data: [DONE]":
                    outcome["end"] = "done"
                    return
        outcome["end"] = "closed"
    except httpx.HTTPError as error:  # the connection dropped
        outcome["end"] = f"connection error ({type(error).__name__})"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")])])
def test_a_worker_killed_under_load_with_two_ranks(tiny_checkpoint, short_tmp, device):
    """Two data-parallel ranks (gloo), requests streaming on both: SIGKILL one worker. The surviving
    rank may be waiting for the dead one in a collective; nothing may hang: every open stream ends
    with an error event (never a normal end), the server exits with 1, no process or socket is left.
    On CPU the ranks talk over gloo, on two GPUs over NCCL."""
    process, base = start_server(tiny_checkpoint, "--dp", "2", "--device", device, max_num_seqs=8, tmpdir=short_tmp)
    engines = [c for c in children(process.pid) if "spawn_main" in process_name(c)]
    workers = [c for c in children(engines[0]) if "spawn_main" in process_name(c)] if engines else []
    everyone = [process.pid, *engines, *workers]
    try:
        assert len(engines) == 1 and len(workers) == 2, (engines, workers)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        outcomes = [{} for _ in range(6)]
        threads = [threading.Thread(target=_stream_until_the_end, args=(base, model, o), daemon=True)
                   for o in outcomes]
        for thread in threads:
            thread.start()
        wait_until(lambda: all(o.get("chunks", 0) >= 3 or "end" in o for o in outcomes), timeout=60)
        assert all("end" not in o for o in outcomes), outcomes  # all six still streaming
        os.kill(workers[1], signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads), outcomes  # no stream hangs
        assert all(o["end"] == "error event" for o in outcomes), outcomes  # an error, never a normal end
        assert process.wait(timeout=30) == 1
        wait_until(lambda: not any(alive(p) for p in everyone) and not any(short_tmp.iterdir()), timeout=10)
    finally:
        stop(process, [*engines, *workers])
