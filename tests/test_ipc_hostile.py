"""Hostile bytes on every ZeroMQ link leave the server serving correct completions, and over
``tcp://`` a peer without the CURVE keys gets nothing.

Garbage (random bytes, wrong frame counts, unknown type bytes, a valid type byte with an
undecodable or mistyped payload, a result from a rank that does not exist) goes to the engine
core's input socket, its results socket, the frontend's output socket, and the step socket
(where a PUB socket takes no messages, only subscriptions, so the worker's loop is also fed the
garbage directly). After each, a greedy request returns the same tokens as before.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import zmq
import zmq.asyncio

from engine_core.config import EngineConfig
from engine_core.ipc import DropLog, Endpoints
from engine_core.protocol import (EngineOutputs, MessageType, SamplingParams, SchedulerStats, StepPlan, StepResult,
                                  WorkerControl, encode)
from frontend.zmq_engine_client import ZmqEngineClient
from workers.step_pipeline import StepPipeline
from workers.worker_process import handle_message

PROMPT = list(range(7, 30))
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def garbage() -> list[list[bytes]]:
    return [[os.urandom(64)], [os.urandom(1), os.urandom(200), os.urandom(3)], [b"\xff", b"x"], [b"", b""],
            [MessageType.ADD.value, b"\xc1\xc1"], [MessageType.OUTPUTS.value, os.urandom(100)],
            [MessageType.STEP_RESULT.value, encode(WorkerControl("pong"))],
            [MessageType.STEP_RESULT.value, encode(StepResult(0, 99, []))],
            [MessageType.CONTROL.value, encode(EngineOutputs([], SchedulerStats()))],
            [MessageType.UTILITY_RESPONSE.value, b"\x93\x01"], [MessageType.ENGINE_DEAD.value, b"\x00"],
            [MessageType.STEP.value, encode(StepPlan(1, False, []))]]


async def _complete(client: ZmqEngineClient, request_id: str) -> list[int]:
    tokens = []
    async for out in client.generate(request_id, PROMPT, GREEDY):
        tokens += out.new_token_ids
    return tokens


async def _inject(context: zmq.asyncio.Context, kind: int, address: str) -> None:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    for frames in garbage():
        await sock.send_multipart(frames)
    await asyncio.sleep(0.3)  # let it arrive before the next request
    sock.close()


def test_garbage_on_every_socket_leaves_the_server_serving(tiny_checkpoint):
    async def main():
        client = ZmqEngineClient(EngineConfig(model=str(tiny_checkpoint), max_num_seqs=4))
        await client.start()
        rogue = zmq.asyncio.Context()
        try:
            expected = await _complete(client, "before")
            assert expected
            ep = client.endpoints
            for garbage_frames in garbage():  # the engine core's input: through the frontend's own socket
                await client.requests.send_multipart(garbage_frames)
            assert await _complete(client, "input") == expected
            await _inject(rogue, zmq.PUSH, ep.results)  # the engine core's results socket
            assert await _complete(client, "results") == expected
            await _inject(rogue, zmq.PUSH, ep.outputs)  # the socket the frontend reads outputs from
            assert await _complete(client, "outputs") == expected
            await _inject(rogue, zmq.XSUB, ep.steps)  # the plan broadcast: only (un)subscriptions get in
            assert await _complete(client, "steps") == expected
            assert await client.check_health(timeout=2.0) and not client.is_dead
        finally:
            rogue.term()
            await client.shutdown()

    asyncio.run(main())


def test_worker_step_loop_drops_garbage(push_pull):
    push, pull = push_pull
    drops = DropLog("test")
    pipeline = StepPipeline(None, 0, push, one_ahead=True)  # no runner: none of the garbage may reach one
    for frames in garbage():
        assert handle_message(frames, pipeline, drops)
    assert drops.dropped == len(garbage())
    # and a real ping still gets its pong
    assert handle_message([MessageType.CONTROL.value, encode(WorkerControl("ping", nonce=5))], pipeline, drops)
    assert pull.poll(2000)
    kind, payload = pull.recv_multipart()
    assert kind == MessageType.CONTROL.value and msgspec.msgpack.decode(payload, type=WorkerControl).nonce == 5


def test_socket_dir_and_sockets_are_private(tmp_path):
    endpoints = Endpoints.local()
    context = zmq.Context()
    try:
        socks = [endpoints.socket(context, zmq.PULL, a, bind=True) for a in (endpoints.requests, endpoints.outputs)]
        assert os.stat(endpoints.directory).st_mode & 0o777 == 0o700
        for address in (endpoints.requests, endpoints.outputs):
            assert os.stat(address[len("ipc://"):]).st_mode & 0o777 == 0o600
        for sock in socks:
            sock.close()
    finally:
        context.term()
        endpoints.cleanup()
    assert not os.path.exists(endpoints.directory)


def test_tcp_needs_curve_keys():
    plain = Endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3", "tcp://127.0.0.1:4")
    with pytest.raises(ValueError, match="CURVE"):
        plain.socket(zmq.Context.instance(), zmq.PULL, plain.requests, bind=True)


def test_curve_over_tcp_serves_and_shuts_out_a_peer_without_keys(tiny_checkpoint):
    async def main():
        endpoints = Endpoints.tcp()
        client = ZmqEngineClient(EngineConfig(model=str(tiny_checkpoint), max_num_seqs=4), endpoints=endpoints)
        await client.start()
        rogue = zmq.asyncio.Context()
        try:
            thief = rogue.socket(zmq.PULL)  # would steal every other request if it could connect
            thief.connect(endpoints.requests)
            snoop = rogue.socket(zmq.SUB)  # would read every step plan
            snoop.setsockopt(zmq.SUBSCRIBE, b"")
            snoop.connect(endpoints.steps)
            wrong_key = rogue.socket(zmq.SUB)  # a CURVE client that guesses the server key
            public, secret = zmq.curve_keypair()
            wrong_key.curve_serverkey, wrong_key.curve_publickey, wrong_key.curve_secretkey = public, public, secret
            wrong_key.setsockopt(zmq.SUBSCRIBE, b"")
            wrong_key.connect(endpoints.steps)
            await asyncio.sleep(0.3)
            tokens = [await _complete(client, f"tcp-{i}") for i in range(3)]
            assert tokens[0] and tokens.count(tokens[0]) == 3
            for sock in (thief, snoop, wrong_key):
                assert not await sock.poll(500), "a peer without the keys received a message"
                sock.close(0)
        finally:
            rogue.term()
            await client.shutdown()

    asyncio.run(main())


def test_endpoints_round_trip_with_keys():
    endpoints = Endpoints.tcp()
    decoded = msgspec.json.decode(msgspec.json.encode(endpoints), type=Endpoints)
    assert decoded == endpoints and len(decoded.server_public) == 40
