"""Step-plan broadcast: ZeroMQ PUB/SUB versus a shared-memory ring, engine core -> N workers.

Measures the one-way latency of delivering an encoded ``StepPlan`` (decode steps of 1, 64, 256 and
1024 sequences, each with a block table) to every worker process and having it decoded there: the
publisher stamps the send time, each reader records the receive-and-decode time, the slowest
reader counts. The shared-memory ring is the simplest correct single-writer/multi-reader design
(a slot per message, a 64-bit sequence number written after the payload, readers spinning on it
with a yield; the benchmark gives every message its own slot, so it needs no reader
acknowledgements — a real ring would, which only adds to its cost), i.e. what an engine would have to maintain in return for avoiding the socket.

    .venv/bin/python benchmarks/broadcast_bench.py [--readers 2] [--iters 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import struct
import time
from multiprocessing import shared_memory

import zmq

from engine_core.protocol import RankBatch, SamplingParams, SequenceStep, StepPlan, decode, encode

SLOT_BYTES = 1 << 18  # room for the largest plan measured (1024 sequences)
HEADER = struct.Struct("<QQd")  # sequence number, payload length, send time


def make_plan(num_seqs: int, step_id: int = 0) -> bytes:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    seqs = [SequenceStep(seq_id=i, epoch=0, start=1000 + i, token_ids=[-1], slot=i,
                         block_table=list(range(i * 9 + 1, i * 9 + 10)), sample=True, seed=i, params=params,
                         prev_row=i, num_prompt_tokens=900)
            for i in range(num_seqs)]
    return encode(StepPlan(step_id, False, [RankBatch(seqs)]))


# ----------------------------------------------------------------------------- ZeroMQ PUB/SUB
def zmq_reader(address: str, iters: int, out):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    latencies = []
    while len(latencies) < iters:
        frames = sub.recv_multipart()
        if frames[0] == b"warm":
            continue
        decode(frames[1], StepPlan)  # the reader's real work: decoding the plan
        sent = struct.unpack("<d", frames[0])[0]
        latencies.append(time.perf_counter() - sent)
    out.put(latencies)


def run_zmq(payload: bytes, readers: int, iters: int) -> list[float]:
    address = f"ipc:///tmp/bcast-bench-{os.getpid()}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(address)
    out = mp.Queue()
    procs = [mp.Process(target=zmq_reader, args=(address, iters, out)) for _ in range(readers)]
    for p in procs:
        p.start()
    for _ in range(50):  # let the subscriptions arrive
        pub.send_multipart([b"warm", b""])
        time.sleep(0.01)
    for _ in range(iters):
        pub.send_multipart([struct.pack("<d", time.perf_counter()), payload])
        time.sleep(0.001)
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    pub.close()
    ctx.term()
    return [max(vals) for vals in zip(*results)]


# ----------------------------------------------------------------------------- shared-memory ring
def shm_reader(name: str, iters: int, out):
    shm = shared_memory.SharedMemory(name=name)
    buf = shm.buf
    latencies, expected = [], 1
    while len(latencies) < iters:
        base = (expected - 1) * SLOT_BYTES
        seq, length, sent = HEADER.unpack_from(buf, base)
        if seq != expected:
            time.sleep(0)  # yield; a pure spin would steal the writer's core on small machines
            continue
        decode(bytes(buf[base + HEADER.size: base + HEADER.size + length]), StepPlan)
        latencies.append(time.perf_counter() - sent)
        expected += 1
    del buf
    shm.close()
    out.put(latencies)


def run_shm(payload: bytes, readers: int, iters: int) -> list[float]:
    shm = shared_memory.SharedMemory(create=True, size=SLOT_BYTES * iters)
    out = mp.Queue()
    procs = [mp.Process(target=shm_reader, args=(shm.name, iters, out)) for _ in range(readers)]
    for p in procs:
        p.start()
    time.sleep(0.3)
    for i in range(1, iters + 1):
        base = (i - 1) * SLOT_BYTES
        shm.buf[base + HEADER.size: base + HEADER.size + len(payload)] = payload
        # the sequence number goes last (its own write) so a reader never sees a half payload
        HEADER.pack_into(shm.buf, base, 0, len(payload), time.perf_counter())
        struct.pack_into("<Q", shm.buf, base, i)
        time.sleep(0.001)
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    shm.close()
    shm.unlink()
    return [max(vals) for vals in zip(*results)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{args.readers} readers, {args.iters} messages per case, 1 ms between messages")
    print("| sequences | plan bytes | ZMQ PUB p50 / p99 (us) | shm ring p50 / p99 (us) |")
    print("|---|---|---|---|")
    for n in (1, 64, 256, 1024):
        payload = make_plan(n)
        z = sorted(run_zmq(payload, args.readers, args.iters))
        s = sorted(run_shm(payload, args.readers, args.iters))
        pct = lambda v, q: v[min(len(v) - 1, int(q * len(v)))] * 1e6  # noqa: E731
        print(f"| {n} | {len(payload)} | {pct(z, .5):.0f} / {pct(z, .99):.0f} | {pct(s, .5):.0f} / {pct(s, .99):.0f} |")


if __name__ == "__main__":
    main()
