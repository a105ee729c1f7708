"""A worker that is alive but stuck (SIGSTOP) is detected within the step timeout, mid-step or idle:
every in-flight request ends with an error, health turns bad, and the engine (and with it the
server) exits non-zero. The test timeouts are short; the defaults (120 s per step, idle pings
answered within 12 s) are held to by the same code.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from server_harness import alive, children, process_name, start_server
from test_process_cleanup import short_tmp, stop, tree, wait_until  # noqa: F401 - short_tmp is a fixture

from engine_core.config import EngineConfig
from engine_core.mp_executor import idle_ping_timeout
from engine_core.protocol import SamplingParams
from frontend.engine_client import EngineDeadError
from frontend.zmq_engine_client import ZmqEngineClient

STEP_TIMEOUT_S = 1.5


def test_idle_ping_timeout_is_short_but_not_twitchy():
    assert idle_ping_timeout(120.0) == 12.0
    assert idle_ping_timeout(1.5) == 1.5  # never longer than a step may take
    assert idle_ping_timeout(30.0) == 5.0


def test_worker_stopped_mid_stream_fails_the_stream(tiny_checkpoint):
    async def main():
        client = ZmqEngineClient(EngineConfig(model=str(tiny_checkpoint), max_num_seqs=4,
                                              step_timeout=STEP_TIMEOUT_S))
        await client.start()
        worker = _worker_of(client.process.pid)
        try:
            stream = client.generate("long", list(range(5, 40)), SamplingParams(max_tokens=100000, ignore_eos=True))
            assert (await stream.__anext__()).new_token_ids
            os.kill(worker, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(EngineDeadError, match="stuck"):
                async for _ in stream:
                    pass
            detected = time.monotonic() - stopped
            assert detected < STEP_TIMEOUT_S + 3.0, detected
            assert not await client.check_health(timeout=1.0)
            await asyncio.get_running_loop().run_in_executor(None, client.process.join, 15)
            assert client.process.exitcode == 1
            assert not alive(worker)  # the stuck worker was killed, not left stopped
        finally:
            _continue(worker)
            await client.shutdown()

    asyncio.run(main())


def test_worker_stopped_while_idle_makes_the_server_exit(tiny_checkpoint, short_tmp):
    process, base = start_server(tiny_checkpoint, "--step-timeout", "1", tmpdir=short_tmp)
    pids = tree(process.pid)
    try:
        os.kill(pids["worker"], signal.SIGSTOP)
        stopped = time.monotonic()
        # idle pings go out every 2 s and may take 1 s; the engine checks once a second
        assert process.wait(timeout=15) == 1
        detected = time.monotonic() - stopped
        assert detected < 8.0, detected
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{base}/health", timeout=1)
        wait_until(lambda: not any(alive(p) for p in pids.values()) and not any(short_tmp.iterdir()), timeout=5)
    finally:
        _continue(pids["worker"])
        stop(process, pids.values())


def _worker_of(engine_pid: int) -> int:
    (worker,) = [c for c in children(engine_pid) if "spawn_main" in process_name(c)]
    return worker


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass
