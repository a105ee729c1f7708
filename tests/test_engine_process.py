"""The engine core and its workers as real processes over ZeroMQ, driven by the frontend's client.

Checks: startup handshake, health round trip, tokens identical to the in-process engine (so the
wire, the executor and zero-overhead scheduling across processes change nothing), aborts returning
every block and slot, expert parallelism over 2 and 4 gloo ranks giving the same tokens as 1 rank, and a
worker crash being noticed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from server_harness import children

from engine_core.config import EngineConfig
from engine_core.protocol import SamplingParams
from frontend.engine_client import EngineDeadError
from frontend.llm import LLM
from frontend.zmq_engine_client import ZmqEngineClient

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 41, 70)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10),
          SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=14),
          SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=9),
          SamplingParams(temperature=1.0, seed=13, max_tokens=12, presence_penalty=0.5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from model.checkpoint_maker import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny"))


@pytest.fixture(scope="module")
def reference_tokens(checkpoint):
    llm = LLM(checkpoint, max_num_seqs=8, max_num_batched_tokens=64)
    return [r.token_ids for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


async def _run(client: ZmqEngineClient, prefix: str) -> list[list[int]]:
    async def one(i):
        tokens = []
        async for out in client.generate(f"{prefix}-{i}", PROMPTS[i], PARAMS[i]):
            tokens += out.new_token_ids
        return tokens

    return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))


async def _wait_idle(client: ZmqEngineClient, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.running == stats.waiting == stats.kv_blocks_used == stats.state_slots_used == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {client.stats()}")


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_processes_match_in_process_engine(checkpoint, reference_tokens, dp):
    async def main():
        client = ZmqEngineClient(EngineConfig(model=checkpoint, dp_size=dp, max_num_seqs=8,
                                              max_num_batched_tokens=64))
        await client.start()
        try:
            assert await client.check_health()
            assert await _run(client, f"dp{dp}") == reference_tokens
            await _wait_idle(client)
            assert client.stats().kv_blocks_total == dp * (client.stats().kv_blocks_total // dp)
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_abort_frees_everything_and_worker_death_is_noticed(checkpoint):
    async def main():
        client = ZmqEngineClient(EngineConfig(model=checkpoint, max_num_seqs=4))
        await client.start()
        try:
            stream = client.generate("long", list(range(5, 60)), SamplingParams(max_tokens=4000, ignore_eos=True))
            first = await stream.__anext__()
            assert first.new_token_ids
            await stream.aclose()  # the consumer goes away: the client aborts the request
            await _wait_idle(client)
            # a request rejected by the engine comes back as an error, and the engine keeps serving
            with pytest.raises(ValueError, match="vocabulary"):
                async for _ in client.generate("bad", [10**6], SamplingParams(max_tokens=2)):
                    pass
            assert await client.check_health()

            worker_pid = children(client.process.pid)
            assert worker_pid, "no worker process found"
            os.kill(worker_pid[0], signal.SIGKILL)
            deadline = time.monotonic() + 15
            while await client.check_health(timeout=1.0) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert not await client.check_health(timeout=1.0)
            with pytest.raises(EngineDeadError):
                async for _ in client.generate("after", [5, 6, 7], SamplingParams(max_tokens=2)):
                    pass
        finally:
            await client.shutdown()

    asyncio.run(main())


