"""CUDA graphs of the decode step (skipped without CUDA): replay against eager, tokens against
``--enforce-eager``, and no host synchronisation inside a decode step, constrained rows included."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch

from engine_core.protocol import SamplingParams, StructuredOutput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[3 + (i * 13 + j * 7) % 500 for j in range(n)] for i, n in enumerate((4, 9, 17, 40, 70, 129))]


def _sampling_mix() -> list[SamplingParams]:
    """Greedy and seeded sampling with every sampler feature a decode step can use."""
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=4, logprobs=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                       max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=6, logit_bias={7: 5.0, 9: -100.0}, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=20, max_tokens=24),
    ]


def _tokens(llm) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, _sampling_mix(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_graph_replay_equals_the_same_forward_run_eagerly(tiny_checkpoint):
    """A replay runs the kernels its capture recorded, on the inputs loaded since: bitwise what the
    padded forward computes eagerly from the same cache state."""
    from model.batch import ForwardBatch
    from model.cache import V41Cache
    from model.loader import load_model
    from model.transformer import ModelOptions
    from workers.cuda_graphs import DecodeGraphs, GraphPlan

    device = torch.device("cuda")
    model = load_model(tiny_checkpoint, ModelOptions(batch_invariant=False, kernels="triton"), device)
    block = 16
    n, blocks_each = 5, 8
    cache = V41Cache.allocate(model.cfg, 2 + n * blocks_each, n + 1, block, device)
    tables = [list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)) for i in range(n)]
    for i, prompt in enumerate(PROMPTS[:n]):
        model.forward(ForwardBatch.build([prompt], [0], [i], [tables[i]], device=device), cache)
    plan = GraphPlan.grid([8], [128], block, max_previous_rows=n)
    eager_cache = copy.deepcopy(cache)
    graphs = DecodeGraphs(model, cache, plan, scratch_slot=n, scratch_block=1 + n * blocks_each)
    graphs.capture_all()
    eager = DecodeGraphs(model, eager_cache, plan, scratch_slot=n, scratch_block=1 + n * blocks_each)
    last = torch.tensor([17, 18, 19, 20, 21], device=device)
    for step in range(6):
        args = ([0] * n if step % 2 else [30 + step + i for i in range(n)], [len(p) + step for p in PROMPTS[:n]],
                list(range(n)), list(range(n)) if step % 2 else [-1] * n, tables, (8, 128), last)
        graphs.load(*args)
        replayed = graphs.replay((8, 128), n).clone()
        eager.load(*args)
        eager.run_eager((8, 128))
        assert torch.equal(replayed, eager.logits[:n]), f"step {step}"
        last = replayed.argmax(-1)


def test_graphs_give_the_tokens_of_eager_mode(tiny_checkpoint):
    """The engine with decode graphs against ``--enforce-eager`` (batch-invariant kernels, so that a
    padded row computes what it computes unpadded), for greedy, seeded sampling, penalties, bias."""
    from frontend.llm import LLM

    common = dict(device="cuda", batch_invariant=True, max_num_batched_tokens=256, block_size=16)
    graphs = LLM(str(tiny_checkpoint), **common)
    assert graphs.engine.executor.runner.graphs is not None
    with_graphs = _tokens(graphs)
    eager = LLM(str(tiny_checkpoint), enforce_eager=True, **common)
    assert eager.engine.executor.runner.graphs is None
    assert with_graphs == _tokens(eager)


def test_steps_and_captures_run_on_the_worker_stream_in_any_thread(tiny_checkpoint):
    """The runner's kernels, graph captures and replays share one stream (``workers/worker_stream.py``):
    the one current once the engine is built, also in a thread other than the one that built it,
    which gets the same tokens."""
    import threading

    from frontend.llm import LLM

    llm = LLM(str(tiny_checkpoint), device="cuda", batch_invariant=True, max_num_batched_tokens=256, block_size=16)
    runner = llm.engine.executor.runner
    stream = runner.stream.stream
    assert stream != torch.cuda.default_stream() and torch.cuda.current_stream() == stream
    assert runner.graphs.capture_stream == stream
    here = _tokens(llm)
    seen = {}

    def elsewhere():
        seen["tokens"] = _tokens(llm)
        seen["stream"] = torch.cuda.current_stream()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen["stream"] == stream and seen["tokens"] == here


@contextmanager
def _sync_is_an_error_inside_steps(runner):
    """Run every step of ``runner`` under ``torch.cuda.set_sync_debug_mode("error")``: any host
    synchronisation inside it raises. Collecting results (the one wait point) stays outside."""
    execute = runner.execute
    counted = {"decode": 0, "prefill": 0}

    def checked(step_id, work, *args, **kwargs):
        if work.sequences:
            decode = all(len(s.token_ids) == 1 for s in work.sequences)
            counted["decode" if decode else "prefill"] += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(step_id, work, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.execute = checked
    try:
        yield counted
    finally:
        runner.execute = execute


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_host_synchronisation_inside_a_step(tiny_checkpoint, enforce_eager):
    """Prefill (chunked: 64 tokens a step), decode, graphs or eager: the host never waits for the
    device inside a step, so zero-overhead scheduling keeps it a step ahead."""
    from frontend.llm import LLM

    llm = LLM(str(tiny_checkpoint), device="cuda", max_num_batched_tokens=64, block_size=16,
              enforce_eager=enforce_eager)
    with _sync_is_an_error_inside_steps(llm.engine.executor.runner) as counted:
        _tokens(llm)
    assert counted["decode"] > 10 and counted["prefill"] > 3


def test_collecting_a_step_does_not_wait_for_work_queued_after_it(tiny_checkpoint):
    """``collect`` waits for its own step's results, not for the stream to drain: the engine
    launches step N+1 before collecting step N, and a blocking read there would wait for N+1 too
    (the device would then idle while the host plans N+2). Each launch here is followed by ~50 ms
    of queued device work; when a collect returns, that work must still be running."""
    from frontend.llm import LLM

    llm = LLM(str(tiny_checkpoint), device="cuda", max_num_batched_tokens=64, block_size=16)
    runner = llm.engine.executor.runner
    execute, collect = runner.execute, runner.collect
    busy_after_collect = []

    def execute_then_occupy(*args, **kwargs):
        pending = execute(*args, **kwargs)
        torch.cuda._sleep(100_000_000)  # clock cycles: tens of milliseconds at the H200's clocks
        return pending

    def collect_and_look(pending):
        result = collect(pending)
        busy_after_collect.append(not torch.cuda.current_stream().query())
        return result

    runner.execute, runner.collect = execute_then_occupy, collect_and_look
    outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert len(busy_after_collect) >= 6 and all(busy_after_collect), busy_after_collect


def test_a_constrained_step_does_not_wait_for_its_own_forward(tiny_checkpoint):
    """Structured output: the host advances the matchers and fills the mask while the step's forward
    runs. Their input tokens come from the previous step's copy to the host (a wait for its event
    only), and the mask and its rows go up from pinned memory. Reading the tokens from the device
    waits for the forward too (an upload from pageable memory may as well). Here ~50 ms of device
    work is queued before the grammar work of every step; when that work is done, the device must
    not have reached the end of it."""
    import json

    from frontend.llm import LLM

    llm = LLM(str(tiny_checkpoint), device="cuda", max_num_batched_tokens=64, block_size=16)
    runner = llm.engine.executor.runner
    apply_grammars = runner._apply_grammars
    busy_after_grammar = []

    def occupied_then_apply(logits, seqs, sample_index):
        torch.cuda._sleep(100_000_000)  # clock cycles: tens of milliseconds, queued after the forward
        occupied = torch.cuda.Event()
        occupied.record()  # reached when the device has done the forward and that work
        constrained = apply_grammars(logits, seqs, sample_index)
        busy_after_grammar.append(not occupied.query())
        return constrained

    runner._apply_grammars = occupied_then_apply
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(temperature=0.0, max_tokens=12, structured=StructuredOutput("json_schema", json.dumps(schema)))
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "length" or isinstance(json.loads(completion.text, strict=False)["n"], int)
    assert len(busy_after_grammar) >= 6 and all(busy_after_grammar), busy_after_grammar
