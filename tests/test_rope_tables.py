"""The rotary tables cover the positions the engine can reach, not always the model's whole limit.

V4.1's 1M positions (``max_position_embeddings``) make each of its two tables 256 MiB on every device;
an engine with ``--max-model-len`` builds them for its own positions only (``ModelOptions.max_positions``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.config import EngineConfig
from frontend.llm import LLM, SamplingParams
from model.loader import load_model
from model.rope import RotaryTable, rope_frequencies
from model.transformer import ModelOptions
from workers.model_runner import rope_positions


def table_lengths(model) -> set[int]:
    return {block.attention.rope.table.shape[0] for block in model.blocks}


@pytest.mark.parametrize("yarn", [False, True])
def test_a_shorter_table_holds_the_same_bits(yarn: bool):
    # V4.1's frequencies (head dim 64; the compressed layers' YaRN); 70,000 positions pass the CPU's
    # parallel grain, so the long table is computed in pieces while the short one is not
    freqs = (rope_frequencies(64, 160000.0, 16.0, 65536, 32, 1) if yarn
             else rope_frequencies(64, 10000.0, 1.0, 0, 32, 1))
    long, short = RotaryTable(freqs, 70_000), RotaryTable(freqs, 1_000)
    assert torch.equal(torch.view_as_real(long.table[:1_000]), torch.view_as_real(short.table))


def test_the_loader_builds_the_tables_for_max_positions(tiny_checkpoint: Path, single_thread, random_tokens,
                                                         run_sequence):
    full = load_model(tiny_checkpoint, ModelOptions())
    limit = full.cfg.max_position_embeddings
    assert table_lengths(full) == {limit}
    assert table_lengths(load_model(tiny_checkpoint, ModelOptions(max_positions=10 * limit))) == {limit}
    short = load_model(tiny_checkpoint, ModelOptions(max_positions=96))
    assert table_lengths(short) == {96}
    # one table per kind of layer (plain and compressed) and length, shared by the layers of that kind
    assert len({id(block.attention.rope) for block in short.blocks}) == 2
    # the same logits, bit for bit: positions below 96 read the same rotations
    prompt = random_tokens(full.cfg.vocab_size, 90, seed=3)
    assert torch.equal(run_sequence(short, prompt).prefill, run_sequence(full, prompt).prefill)
    with pytest.raises(IndexError):  # a position past the table is an error, never a wrong rotation on CPU
        run_sequence(short, random_tokens(full.cfg.vocab_size, 97, seed=3))


def test_the_engine_covers_its_sequences_and_its_memory_profile():
    assert rope_positions(EngineConfig("model", max_model_len=None)) == 0  # the model's own limit
    assert rope_positions(EngineConfig("model", max_model_len=4096, max_num_batched_tokens=512)) == 4096
    assert rope_positions(EngineConfig("model", max_model_len=100, max_num_batched_tokens=512)) == 512


def test_an_engine_runs_sequences_to_max_model_len(tiny_checkpoint: Path):
    llm = LLM(str(tiny_checkpoint), device="cpu", block_size=16, num_blocks=16, max_num_seqs=2, max_model_len=80,
              max_num_batched_tokens=32)
    model = llm.engine.executor.runner.model
    assert table_lengths(model) == {80}
    # a prompt of 70 tokens in chunks of 32, then decode steps to the last position (79)
    out = llm.generate([[5 + i % 50 for i in range(70)]], SamplingParams(max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_short_tables_give_the_tokens_of_full_ones_on_cuda(tiny_checkpoint: Path):
    """The Triton kernels read the rotations by position from the device's table, with no bounds check:
    an engine whose tables stop at its ``--max-model-len`` decodes to that limit (CUDA graphs included)
    the tokens of one with the model's whole tables."""
    common = dict(device="cuda", batch_invariant=True, block_size=16, max_num_seqs=2, max_num_batched_tokens=32)
    prompt = [[5 + i % 50 for i in range(70)]]
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0)
    tokens = []
    for limit in (80, None):
        with LLM(str(tiny_checkpoint), max_model_len=limit, **common) as llm:
            assert table_lengths(llm.engine.executor.runner.model) == {limit or llm.engine.executor.runner.cfg
                                                                      .max_position_embeddings}
            tokens.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert len(tokens[0]) == 10 and tokens[0] == tokens[1][:10]
