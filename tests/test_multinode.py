"""Multi-node serving on one machine: node 0 (``serve --nnodes 2 --node-rank 0``: frontend, engine
core, rank 0) and node 1 (``serve --headless --node-rank 1``: rank 1) as separate real processes,
linked over tcp on 127.0.0.1 (CURVE keys from a shared cluster key file) and joined through gloo.

* the two nodes serve the official ``openai`` client the greedy text of one rank, with node 1's
  rank doing part of the work (per-rank metrics); node 1 may start first;
* killing node 1's worker is reported by the service at once: the stream in flight ends with an
  error, node 0 names the worker and exits 1, node 1 exits 1;
* a node that cannot join (here: another cluster key) ends node 0's start after ``--join-timeout``
  with a line naming the rank, its node and the likely cause, and node 1 exits saying so;
* a node started with other engine flags is refused before any exchange, naming the flag;
* the layout, the port and key derivation, and one-line configuration errors (exit code 2).
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
import openai
import pytest
import zmq
from server_harness import REPO, alive, children, free_port, process_name, start_server

from deploy.cli import main
from engine_core.cluster import NodeLayout, cluster_endpoints, curve_keys, dist_init_method
from engine_core.config import EngineConfig
from frontend.llm import LLM, SamplingParams
from workers.rank_agreement import differing_settings, shared_settings

PROMPTS = [list(range(3, 3 + n)) for n in (4, 19, 33, 7)]
MAX_TOKENS = 8
# start_server's engine flags: every node must run with the same ones
ENGINE_FLAGS = ("--max-num-seqs", "4", "--max-num-batched-tokens", "64")


@pytest.fixture()
def cluster_key(tmp_path) -> Path:
    path = tmp_path / "cluster.key"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


def _master_port() -> int:
    """A port P with P, P+1 and P+2 free (torch.distributed, step plans, results)."""
    for _ in range(50):
        port = free_port()
        if port + 2 < 65536 and all(_is_free(port + i) for i in (1, 2)):
            return port
    raise RuntimeError("no three consecutive free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _node_flags(master_port: int, key: Path, node_rank: int) -> list[str]:
    return ["--dp", "2", "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
            "--master-port", str(master_port), "--cluster-key-file", str(key)]


def _start_headless(checkpoint, master_port: int, key: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deploy.cli", "--log-level", "INFO", "serve", "--headless", "--model", str(checkpoint),
           *_node_flags(master_port, key, 1), *ENGINE_FLAGS, *extra]
    with open(log, "w") as out:  # a file, not a pipe: nobody reads it while the node runs
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def _head_that_fails(checkpoint, master_port: int, key: Path, *extra: str,
                     timeout: float) -> subprocess.CompletedProcess:
    """Node 0's ``serve`` run to its end (a deployment that cannot form exits), its output captured."""
    return subprocess.run([sys.executable, "-m", "deploy.cli", "--log-level", "WARNING", "serve", "--model",
                           str(checkpoint), "--port", str(free_port()), *_node_flags(master_port, key, 0),
                           *ENGINE_FLAGS, *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout)


def _worker_of(supervisor: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = [c for c in children(supervisor) if "spawn_main" in process_name(c)]
        if workers:
            return workers[0]
        time.sleep(0.1)
    raise AssertionError("the headless node started no worker")


def _kill_all(processes: list[subprocess.Popen], pids: list[int]) -> None:
    """Leave nothing running, whatever the test did (the nodes' children included)."""
    pids = [*pids, *(c for p in processes for c in children(p.pid))]
    for pid in [*pids, *(p.pid for p in processes)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for process in processes:
        process.wait(timeout=10)


def _per_rank(text: str, name: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith(f"minideepinfer:{name}{{") and 'dp_rank="' in line:
            rank = line.split('dp_rank="', 1)[1].split('"', 1)[0]
            values[rank] = float(line.rsplit(" ", 1)[1])
    return values


def test_two_nodes_serve_the_tokens_of_one_rank_and_a_dead_headless_worker_ends_the_service(
        tiny_checkpoint, cluster_key, tmp_path):
    with LLM(str(tiny_checkpoint), max_num_seqs=4, max_num_batched_tokens=64) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [out.outputs[0].text for out in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    port = _master_port()
    node1_log = tmp_path / "node1.log"
    node1 = _start_headless(tiny_checkpoint, port, cluster_key, node1_log)  # first: the order does not matter
    processes, pids = [node1], []
    try:
        head, base = start_server(tiny_checkpoint, *_node_flags(port, cluster_key, 0))
        processes.append(head)
        pids += [p for c in children(head.pid) for p in (c, *children(c))] + children(node1.pid)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)
        reply = client.completions.create(model="", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0,
                                          extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
        scheduled = _per_rank(httpx.get(f"{base}/metrics", timeout=5).text, "scheduled_tokens_per_rank_total")
        assert set(scheduled) == {"0", "1"} and scheduled["1"] > 0, scheduled  # node 1's rank did work

        stream = iter(client.completions.create(model="", prompt=list(range(5, 30)), max_tokens=3000, stream=True,
                                                temperature=0.0, extra_body={"ignore_eos": True}))
        assert next(stream).choices[0].text is not None
        worker = _worker_of(node1.pid)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert head.wait(timeout=15) == 1
        detected = time.monotonic() - killed
        assert detected < 8.0, detected
        assert f"worker 1 on node 1 ({os.uname().nodename}) exited (code -9)" in head.stdout.read()
        assert node1.wait(timeout=15) == 1
        assert "telling the engine core" in node1_log.read_text()
        deadline = time.monotonic() + 10  # node 0's worker may first have to see its collective fail
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), [(p, process_name(p)) for p in pids if alive(p)]
    finally:
        _kill_all(processes, pids)


def test_a_node_with_another_cluster_key_never_joins_and_both_nodes_say_why(tiny_checkpoint, cluster_key, tmp_path):
    other_key = tmp_path / "other.key"
    other_key.write_text("x" * 40)
    other_key.chmod(0o600)
    port = _master_port()
    node1_log = tmp_path / "node1.log"
    node1 = _start_headless(tiny_checkpoint, port, other_key, node1_log)
    try:
        head = _head_that_fails(tiny_checkpoint, port, cluster_key, "--join-timeout", "3", timeout=60)
        assert head.returncode == 1
        assert "rank 1 (node 1) did not join within 3 s (--join-timeout)" in head.stderr
        assert "failed the CURVE handshake: is --cluster-key-file the same file on every node?" in head.stderr
        assert node1.wait(timeout=20) == 1
        assert "refused the CURVE handshake" in node1_log.read_text()
    finally:
        _kill_all([node1], [])


def test_a_node_with_other_engine_flags_is_refused_naming_the_flag(tiny_checkpoint, cluster_key, tmp_path):
    port = _master_port()
    node1_log = tmp_path / "node1.log"
    node1 = _start_headless(tiny_checkpoint, port, cluster_key, node1_log, "--max-num-batched-tokens", "32")
    try:
        head = _head_that_fails(tiny_checkpoint, port, cluster_key, timeout=90)
        assert head.returncode == 1
        assert "rank 1 (node 1) has max_num_batched_tokens: 32 (rank 0: 64)" in head.stderr
        assert node1.wait(timeout=20) == 1  # node 0 shut the deployment down; node 1 says why too
        assert "worker 1 failed to start: the nodes run with different engine settings" in node1_log.read_text()
    finally:
        _kill_all([node1], [])


# ----------------------------------------------------------------------------- layout, keys, settings
def test_layout_ports_and_keys(tiny_checkpoint, cluster_key):
    config = EngineConfig(model=str(tiny_checkpoint), dp_size=8, nnodes=4, node_rank=2, headless=True,
                          master_addr="10.0.0.1", master_port=29500, cluster_key_file=str(cluster_key))
    layout = NodeLayout.of(config)
    assert (layout.ranks_per_node, layout.world_size, list(layout.local_ranks)) == (2, 8, [4, 5])
    assert [layout.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.local_rank(5) == 1
    assert layout.describe_ranks([5, 2, 3]) == "ranks 2, 3 (node 1), 5 (node 2)"
    assert dist_init_method(config) == "tcp://10.0.0.1:29500"
    endpoints = cluster_endpoints(config)
    assert (endpoints.steps, endpoints.results) == ("tcp://10.0.0.1:29501", "tcp://10.0.0.1:29502")
    # every node derives the same keypairs from the file; each public key belongs to its secret
    assert curve_keys(cluster_key.read_bytes().strip()) == (endpoints.server_public, endpoints.server_secret,
                                                            endpoints.client_public, endpoints.client_secret)
    assert zmq.curve_public(endpoints.server_secret.encode()).decode() == endpoints.server_public
    assert zmq.curve_public(endpoints.client_secret.encode()).decode() == endpoints.client_public
    assert endpoints.server_public != endpoints.client_public
    assert curve_keys(b"y" * 32)[0] != endpoints.server_public


def test_settings_that_may_differ_per_node_are_not_compared(tiny_checkpoint):
    base = EngineConfig(model=str(tiny_checkpoint), dp_size=2, nnodes=2)
    node1 = EngineConfig(model=str(tiny_checkpoint), dp_size=2, nnodes=2, node_rank=1, headless=True, cpu_threads=2,
                         num_blocks=40, cpu_kv_cache_gb=0.5, step_timeout=5.0, seed=3)
    assert differing_settings(shared_settings(base), shared_settings(node1)) == []
    other = EngineConfig(model=str(tiny_checkpoint), dp_size=2, nnodes=2, node_rank=1, headless=True,
                         max_num_batched_tokens=64, kernels="reference")
    assert differing_settings(shared_settings(base), shared_settings(other)) == [
        "max_num_batched_tokens: 64 (rank 0: 512)"]


@pytest.mark.parametrize("flags, message", [
    (["--dp", "3", "--nnodes", "2"], "--data-parallel-size 3 is not a multiple of --nnodes 2"),
    (["--dp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"], "--node-rank 2 is not a node of --nnodes 2"),
    (["--dp", "2", "--headless"], "--headless is for the other nodes"),
    (["--dp", "2", "--nnodes", "2", "--node-rank", "1"], "--node-rank 1 runs only workers: add --headless"),
    (["--dp", "2", "--nnodes", "2", "--master-port", "65534"], "--master-port must be in [1, 65533]"),
    (["--dp", "2", "--nnodes", "2"], "--nnodes > 1 needs --cluster-key-file"),
    (["--dp", "2", "--nnodes", "2", "--cluster-key-file", "{missing}"], "does not exist"),
    (["--dp", "2", "--nnodes", "2", "--cluster-key-file", "{short}"], "holds 5 characters, fewer than 32"),
])
def test_multi_node_config_errors_are_one_line_and_exit_code_2(tiny_checkpoint, tmp_path, capsys, flags, message):
    short = tmp_path / "short.key"
    short.write_text("12345\n")
    flags = [f.format(missing=tmp_path / "missing.key", short=short) for f in flags]
    assert main(["serve", "--model", str(tiny_checkpoint), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_vllm_spellings_of_the_node_0_address_and_port():
    from deploy.cli import build_parser

    args = build_parser().parse_args(["serve", "--data-parallel-address", "10.1.2.3",
                                      "--data-parallel-rpc-port", "13345"])
    assert (args.master_addr, args.master_port) == ("10.1.2.3", 13345)
