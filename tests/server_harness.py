"""Running real servers and watching their processes, shared by the end-to-end tests.

``start_server`` runs ``mini-deepinfer serve`` on the given checkpoint in a subprocess and returns
once ``/health`` answers 200; ``stop_server`` ends it. The process helpers read ``/proc`` (Linux).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, base: str, timeout: float = 120) -> None:
    """Return once ``base/health`` answers 200; raise (with the server's output) if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("server did not become healthy")


def start_server(checkpoint, *extra: str, max_num_seqs: int = 4, tmpdir: Path | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """A healthy ``serve`` subprocess (its temporary files in ``tmpdir`` if given) and its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "deploy.cli", "--log-level", "WARNING", "serve", "--model", str(checkpoint),
           "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", "64", *extra]
    env = dict(os.environ, TMPDIR=str(tmpdir)) if tmpdir is not None else None
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(process, base)
    return process, base


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within 20 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def children(pid: int) -> list[int]:
    """Direct children of a process, from /proc (Linux)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False
