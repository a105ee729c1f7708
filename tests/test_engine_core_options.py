"""Engine-core options and reports with the real tiny model on CPU: ``--seed`` makes unseeded
requests reproducible, the tokens-per-step histogram (vllm:iteration_tokens_total) counts every
step, the KV cache that cannot hold ``max_model_len`` is said aloud, and the startup summary
describes the engine that runs."""

from __future__ import annotations

import logging

from engine_core.config import EngineConfig
from engine_core.core import EngineCore
from engine_core.engine_summary import build_summary
from engine_core.executor import InProcessExecutor
from engine_core.protocol import ITERATION_TOKEN_BUCKETS, AddRequest, SamplingParams
from frontend.startup_summary import max_concurrency, summary_lines

ENGINE = dict(block_size=16, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=16)
PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], "b": [30, 31, 32]}


def make_engine(checkpoint, **overrides) -> EngineCore:
    config = EngineConfig(model=str(checkpoint), **{**ENGINE, **overrides})
    return EngineCore(config, InProcessExecutor(config))


def run(core: EngineCore, params: SamplingParams) -> tuple[dict[str, list[int]], int]:
    """Every prompt to the end: the tokens of each, and the number of steps taken."""
    for request_id, ids in PROMPTS.items():
        core.add_request(AddRequest(request_id, list(ids), params))
    tokens: dict[str, list[int]] = {r: [] for r in PROMPTS}
    steps = 0
    while core.has_work:
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
        steps += 1
    return tokens, steps


def test_seed_makes_unseeded_requests_reproducible(tiny_checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)  # no seed of its own
    first, _ = run(make_engine(tiny_checkpoint, seed=11), params)
    again, _ = run(make_engine(tiny_checkpoint, seed=11), params)
    other, _ = run(make_engine(tiny_checkpoint, seed=12), params)
    assert first == again
    assert first != other  # 16 tokens sampled at temperature 1 over a 1k vocabulary: never all equal


def test_step_token_histogram_counts_every_step(tiny_checkpoint):
    core = make_engine(tiny_checkpoint)
    _, steps = run(core, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    stats = core.stats()
    assert len(stats.step_token_counts) == len(ITERATION_TOKEN_BUCKETS) + 1
    assert sum(stats.step_token_counts) == core.scheduler.next_step_id >= steps - 1
    # every prompt token is prefilled once, every output token but the last is fed back once
    assert stats.step_tokens_sum == sum(len(p) for p in PROMPTS.values()) + len(PROMPTS) * (6 - 1)
    # a's first chunk (16 tokens: bucket le=16), then a's last 4 with b's 3 (7: le=8), then 5 decode
    # steps of both sequences (2 tokens: le=8)
    expected = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    expected[ITERATION_TOKEN_BUCKETS.index(16)], expected[ITERATION_TOKEN_BUCKETS.index(8)] = 1, 6
    assert stats.step_token_counts == expected


def test_kv_cache_smaller_than_max_model_len_is_logged(tiny_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="engine_core.core"):
        core = make_engine(tiny_checkpoint, num_blocks=5, max_model_len=256)  # 4 blocks: 64 tokens of KV
    assert core.max_model_len == 64
    assert "the KV cache holds 64 tokens per rank, fewer than max_model_len 256" in caplog.text


def test_startup_summary_describes_the_engine(tiny_checkpoint):
    core = make_engine(tiny_checkpoint, max_model_len=128, enforce_eager=True)
    summary = build_summary(core.config, core.executor.info, core.max_model_len, ["cpu (1 thread)"], "bf16")
    assert (summary.kv_blocks_per_rank, summary.block_size, summary.state_slots_per_rank) == (39, 16, 4)
    assert summary.max_model_len == 128 and summary.model_max_len == 4096
    assert max_concurrency(summary) == (4, 39 / 8)  # 8 blocks per sequence of 128 tokens; 4 slots
    text = "\n".join(summary_lines(str(tiny_checkpoint), ("tiny",), summary, "http://127.0.0.1:8000"))
    for expected in ("devices: cpu (1 thread)", "one rank (one worker) holding all 4 routed experts",
                     "weights fp8 e4m3 dense + fp4 e2m1 experts (UE8M0 block scales); KV cache bf16",
                     "CUDA graphs none (eager: not on cuda)", "KV cache: 624 tokens per rank (39 blocks of 16",
                     "max_model_len 128 (model limit 4096): max concurrency 4.00 sequences at 128 tokens",
                     "listening on http://127.0.0.1:8000"):
        assert expected in text, expected
    first = summary_lines(str(tiny_checkpoint), ("tiny",), summary, "", {"num_hidden_layers": 4})[0]
    assert first.endswith(f"from {tiny_checkpoint} (config.json with {{\"num_hidden_layers\": 4}}), served as 'tiny'")


def test_startup_summary_names_the_cuda_graphs(tiny_checkpoint):
    from engine_core.engine_summary import cuda_graphs
    from model.config import V41Config

    cfg = V41Config.from_pretrained(tiny_checkpoint)

    def graphs(**options) -> str:
        return cuda_graphs(EngineConfig(model=str(tiny_checkpoint), device="cuda", **options), cfg, 4096)

    assert graphs(max_num_seqs=64) == "decode, 33 graphs: 11 batch sizes 1..64 x 3 contexts up to 4096 tokens"
    assert graphs(max_num_seqs=20, cuda_graph_sizes=(1, 4, 16), max_seq_len_to_capture=512) == \
        "decode, 3 graphs: 3 batch sizes 1..16 x 1 contexts up to 512 tokens"
    assert graphs(enforce_eager=True) == "none (eager: --enforce-eager)"
    assert cuda_graphs(EngineConfig(model=str(tiny_checkpoint), device="cuda", max_num_seqs=64), cfg, 32768) == \
        "decode, 58 graphs: 11 batch sizes 1..64 x 6 contexts up to 32768 tokens, fewer batch sizes beyond 8192"
    assert graphs(kernels="reference").startswith("none (eager: the reference kernels")
    # expert parallelism: no batch beyond what one exchange carries per peer without a second round
    assert graphs(dp_size=2, max_num_seqs=64) == "decode, 33 graphs: 11 batch sizes 1..64 x 3 contexts up to 4096 tokens"
    small_capacity = graphs(dp_size=2, max_num_seqs=64, max_num_batched_tokens=64, expert_capacity_factor=0.5)
    assert small_capacity.startswith("decode, ") and " 1..64 " not in small_capacity
