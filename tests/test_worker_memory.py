"""A CPU worker's resident memory stays bounded under a workload of ever-changing shapes.

Each round runs requests of prompt lengths and batch sizes not seen before (the case that used
to grow oneDNN's shape-keyed caches by tens of MiB per round); after a warm-up round, the RSS
of later rounds must stay within a small bound of the round after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from workers.memory import MallocTrimmer, limit_native_caches, malloc_trim, rss_bytes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")

ROUNDS = 4
GROWTH_BOUND_MIB = 25  # measured over rounds 1-3: +6 MiB with the caches capped, +42 MiB with 1024 entries

# A fresh interpreter: oneDNN reads its cache capacities once per process, and the test suite's
# process may have run oneDNN operations already.
SCRIPT = textwrap.dedent(f"""
    import json
    from engine_core.protocol import SamplingParams
    from frontend.llm import LLM
    from workers.memory import malloc_trim, rss_bytes

    llm = LLM(max_num_seqs=8)
    out = []
    length = 3
    for r in range({ROUNDS}):
        prompts = []
        for i in range(24):
            length += 5  # a new prompt length every request: new GEMM shapes in every prefill
            prompts.append([10 + (j * 31 + i) % 900 for j in range(length % 400 + 1)])
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        malloc_trim()
        out.append(rss_bytes())
    print(json.dumps(out))
""")


def test_rss_bounded_over_rounds_of_new_shapes():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = [v / 2**20 for v in json.loads(proc.stdout.strip().splitlines()[-1])]
    growth = max(rss[2:]) - rss[1]  # round 0 warms up everything else (tokenizer, first shapes)
    assert growth < GROWTH_BOUND_MIB, f"RSS per round (MiB): {[round(v) for v in rss]}"


def test_limit_native_caches_respects_the_environment(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert limit_native_caches(32) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7", "LRU_CACHE_CAPACITY": "32"}
    assert os.environ["LRU_CACHE_CAPACITY"] == "32"


def test_trimmer_trims_once_per_idle_period():
    now = [0.0]
    trimmer = MallocTrimmer(idle_s=1.0, clock=lambda: now[0])
    assert not trimmer.idle()  # nothing ran yet
    trimmer.busy()
    now[0] = 0.5
    assert not trimmer.idle()  # not idle long enough
    now[0] = 1.5
    trimmed = trimmer.idle()
    assert trimmed == malloc_trim()  # True on glibc
    assert not trimmer.idle()  # once per idle period
    trimmer.busy()
    now[0] = 3.0
    assert trimmer.idle() == trimmed
    assert rss_bytes() > 0
