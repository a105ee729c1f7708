"""Killing any one process of a running server (SIGKILL: no handler runs in it) leaves no orphan
process and no socket directory behind, within a few seconds.

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
import time
from pathlib import Path

import pytest

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
