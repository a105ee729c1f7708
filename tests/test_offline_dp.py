"""The offline path with several DP ranks: ``LLM(dp_size=N)`` (vLLM's ``data_parallel_size=N``)
and ``generate``/``run-batch --dp N`` start one worker process per rank, as ``serve`` does, and
give the same tokens as one rank (greedy and seeded sampling: a sequence's tokens do not depend on
the rank it runs on or on the experts being sharded). The worker processes and their socket
directory go away on ``close()``, at the end of a ``with`` block, when the ``LLM`` is garbage
collected, and when the interpreter exits without closing it.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from server_harness import REPO

from deploy.cli import main
from engine_core.config import EngineConfigError
from engine_core.protocol import SamplingParams as EngineSamplingParams
from frontend.llm import LLM, SamplingParams

ENGINE = dict(device="cpu", block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128)
PROMPTS = [list(range(3, 3 + n)) for n in (4, 19, 33)] + ["The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=5, n=2, max_tokens=6, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), f"worker processes still alive: {[p for p in pids if _alive(p)]}"


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), **ENGINE) as llm:
        yield _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)), \
            _tokens(llm.generate(PROMPTS[:2], SEEDED, use_tqdm=False))


def test_dp2_gives_the_tokens_of_one_rank_and_del_stops_its_workers(tiny_checkpoint, one_rank):
    greedy, seeded = one_rank
    llm = LLM(str(tiny_checkpoint), dp_size=2, **ENGINE)
    workers = llm.engine.executor.processes
    pids = [p.pid for p in workers]
    socket_dir = llm.engine.executor.endpoints.directory
    assert len(pids) == 2 and all(_alive(p) for p in pids) and os.path.isdir(socket_dir)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == greedy
    assert _tokens(llm.generate(PROMPTS[:2], SEEDED, use_tqdm=False)) == seeded
    stats = llm.engine.stats()
    assert all(t > 0 for t in stats.rank_tokens_scheduled)  # both ranks ran sequences
    assert stats.running == stats.kv_blocks_used == 0
    del llm, workers  # no close(): garbage collection stops the workers
    gc.collect()
    _wait_gone(pids)
    assert not os.path.exists(socket_dir)


def test_dp2_without_zos_gives_the_tokens_of_one_rank(tiny_checkpoint, one_rank):
    """Without ZOS the engine core broadcasts ``collect`` for every step it waits for
    (workers/step_pipeline.py); on CPU workers, which send each step's results at once, it finds
    nothing held and must change nothing."""
    greedy, seeded = one_rank
    with LLM(str(tiny_checkpoint), dp_size=2, zos=False, **ENGINE) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == greedy
        assert _tokens(llm.generate(PROMPTS[:2], SEEDED, use_tqdm=False)) == seeded


def test_data_parallel_size_is_an_alias_and_a_bad_size_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ValueError, match="disagree"):
        LLM(str(tiny_checkpoint), dp_size=2, data_parallel_size=4, **ENGINE)
    with pytest.raises(EngineConfigError, match="does not divide"):  # refused before any process starts
        LLM(str(tiny_checkpoint), data_parallel_size=3, **ENGINE)


def test_close_and_interpreter_exit_stop_the_workers(tiny_checkpoint, one_rank, tmp_path):
    """In a fresh interpreter: a ``with`` block closes its LLM (generating afterwards is an error);
    a second LLM is left open when the script ends, and the exit stops its workers."""
    script = textwrap.dedent(f"""
        import json, os, sys
        from frontend.llm import LLM, SamplingParams

        if __name__ == "__main__":
            engine = dict({ENGINE!r})
            with LLM({str(tiny_checkpoint)!r}, data_parallel_size=2, **engine) as llm:
                out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                   use_tqdm=False)
                closed = [p.pid for p in llm.engine.executor.processes]
                closed_dir = llm.engine.executor.endpoints.directory
            try:
                llm.generate([[5, 6]])
                error = ""
            except RuntimeError as exc:
                error = str(exc)
            left_open = LLM({str(tiny_checkpoint)!r}, dp_size=2, **engine)
            print(json.dumps(dict(tokens=out[0].outputs[0].token_ids, closed=closed, closed_dir=closed_dir,
                                  error=error, open=[p.pid for p in left_open.engine.executor.processes],
                                  open_dir=left_open.engine.executor.endpoints.directory)))
    """)
    path = tmp_path / "offline_dp.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    with LLM(str(tiny_checkpoint), **ENGINE) as reference:
        want = reference.generate([[5, 6, 7, 8]], EngineSamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
    assert report["tokens"] == want
    assert report["error"] == "this LLM is closed"
    assert not any(_alive(p) for p in report["closed"]) and not os.path.exists(report["closed_dir"])
    _wait_gone(report["open"])
    assert not os.path.exists(report["open_dir"])


def test_run_batch_with_dp2_gives_the_tokens_of_one_rank(tiny_checkpoint, one_rank, tmp_path):
    greedy, _ = one_rank
    lines = [json.dumps({"prompt_token_ids": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
             if isinstance(p, list) else json.dumps({"prompt": p, "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True}) for p in PROMPTS]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    flags = ["--device", "cpu", "--block-size", "16", "--num-blocks", "64", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "64", "--max-model-len", "128"]
    code = main(["--log-level", "WARNING", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                 str(tmp_path / "out.jsonl"), "--model", str(tiny_checkpoint), "--no-progress", "--dp", "2", *flags])
    assert code == 0
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in results] == [g[0] for g in greedy]


def test_hf_overrides_reach_every_rank(tmp_path):
    """``hf_overrides`` with dummy weights: each worker process reads config.json with the overrides and
    makes the same weights (seeded by name), so two ranks, which shard the two experts, give one
    rank's tokens."""
    from model.checkpoint_maker import make_checkpoint

    directory = str(make_checkpoint(tmp_path / "tiny", preset="tiny", config_only=True))
    small = dict(load_format="dummy", hf_overrides={"num_hidden_layers": 4, "n_routed_experts": 2}, **ENGINE)
    with LLM(directory, **small) as llm:
        expected = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(directory, dp_size=2, **small) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
