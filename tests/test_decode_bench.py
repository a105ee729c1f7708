"""The GPU-idle figure of benchmarks/decode.py: the union of device intervals in a profiler trace."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from benchmarks.decode import device_busy


def _event(start: float, end: float, device=DeviceType.CUDA):
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_device_busy_is_the_union_of_device_intervals():
    events = [_event(0, 10), _event(5, 12), _event(20, 30), _event(22, 25),  # overlapping streams count once
              _event(40, 41), _event(0, 100, DeviceType.CPU)]  # host events do not count
    prof = SimpleNamespace(events=lambda: events)
    assert device_busy(prof) == (12 + 10 + 1, 41)
    assert device_busy(SimpleNamespace(events=lambda: [])) == (0.0, 0.0)


def test_prefill_flops_per_token_adds_the_attention_of_each_position(tmp_path):
    """The tiny model, a 40-token prompt: the weights' products (the head once) plus, per layer, the
    window and selected entries (QK and PV) and the indexer's visible entries, position by position."""
    from benchmarks.decode import prefill_flops_per_token, step_cost
    from model.checkpoint_maker import make_checkpoint
    from model.config import V41Config

    cfg = V41Config.from_pretrained(make_checkpoint(tmp_path / "tiny", preset="tiny", config_only=True))
    context = 40
    expected = step_cost(cfg, 1, context)[1] - 2 * cfg.vocab_size * cfg.hidden_size * (1 - 1 / context)
    for position in range(1, context + 1):
        for role in cfg.roles:
            per_entry = 4 * cfg.num_heads * cfg.head_dim / context
            expected += per_entry * min(position, cfg.sliding_window)
            if role.compress_ratio:
                expected += per_entry * min(position // role.compress_ratio, cfg.index_topk)
                if role.runs_indexer:
                    expected += 2 * cfg.index_num_heads * cfg.index_head_dim * (position // role.compress_ratio) / context
    assert abs(prefill_flops_per_token(cfg, context) - expected) <= 1e-9 * expected


def test_decode_step_times_reports_how_long_the_host_waited_for_results():
    """The engine on the CPU (the default model): the wait is part of each step's time, and the
    runner's own ``collect`` is back in place afterwards."""
    from benchmarks.decode import decode_step_times
    from frontend.llm import LLM

    llm = LLM(None, device="cpu", max_num_seqs=2, max_model_len=64)
    try:
        runner = llm.engine.executor.runner
        prefill, step, waited = decode_step_times(llm, [[5, 6, 7, 8], [9, 10, 11]], 4)
        assert "collect" not in vars(runner)
    finally:
        llm.close()
    assert prefill > 0 and 0 < waited <= step


def test_nothing_is_timed_without_an_in_process_runner():
    """With ``--dp N`` the ranks run in processes of their own: the wait is reported as unknown."""
    from benchmarks.decode import timed_collects

    with timed_collects(SimpleNamespace(executor=SimpleNamespace())) as waited:
        pass
    assert waited == [None]


def test_replays_are_timed_only_where_graphs_replay():
    """On the CPU (no graphs) and with ``--dp N`` (no in-process runner) the replay timer times nothing
    and leaves the engine as it was."""
    from benchmarks.decode import ReplayTimer, decode_step_times
    from frontend.llm import LLM

    with ReplayTimer(SimpleNamespace(executor=SimpleNamespace())) as replays:
        pass
    assert replays.median_us() is None and replays.mean_us() is None
    llm = LLM(None, device="cpu", max_num_seqs=1, max_model_len=64)
    model = weakref.ref(llm.engine.executor.runner.model)
    try:
        replays = ReplayTimer(llm.engine)
        decode_step_times(llm, [[5, 6, 7]], 2, around_steps=replays)
        assert replays.graphs is None and replays.median_us() is None
    finally:
        llm.close()
    del llm
    gc.collect()
    assert model() is None  # the benchmark runs one engine after another: nothing may keep one alive


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_timed_decode_step_replays_a_graph_and_is_timed(tiny_checkpoint):
    """With graphs each timed decode step replays one, and its device time is positive and shorter
    than the whole step's; the graphs' own ``replay`` is back in place afterwards, and the timer lets go
    of them."""
    from benchmarks.decode import ReplayTimer, decode_step_times
    from frontend.llm import LLM

    llm = LLM(str(tiny_checkpoint), device="cuda", max_num_seqs=2, max_model_len=256)
    try:
        replays = ReplayTimer(llm.engine)
        _, step, _ = decode_step_times(llm, [[5, 6, 7, 8], [9, 10, 11]], 6, around_steps=replays)
        assert "replay" not in vars(llm.engine.executor.runner.graphs)
        assert replays.graphs is None  # (holding them would keep the engine alive after close)
        assert 5 <= len(replays.events) <= 7  # one per launched step: the engine runs one step ahead
        assert 0 < replays.median_us() < step * 1e6
        assert 0 < replays.mean_us() < step * 1e6
    finally:
        llm.close()


def test_the_share_outside_the_graph_replays_is_what_the_replays_leave_of_a_step():
    from benchmarks.decode import outside_graphs_pct

    assert outside_graphs_pct(7.42e-3, 7296.0) == pytest.approx(100 * 124 / 7420)
    assert outside_graphs_pct(1e-3, 1000.5) == 0.0  # event and host clocks differ by a little
    assert outside_graphs_pct(1e-3, None) is None


def test_a_variants_suffixes_set_its_tile_tables_and_the_next_variant_gets_the_defaults_back():
    """``--kernels triton-noshape,triton-notcx-sort,triton``: each engine's ``tile_configs`` are the process's
    defaults plus its own suffixes' changes; ``-noshape`` sets the per-launch tables aside,
    ``-notcx`` keeps the routed experts off ``triton_mma_experts``."""
    from benchmarks.decode import set_tile_tables, tile_table_defaults
    from model.kernels import tile_configs

    defaults = tile_table_defaults()
    try:
        assert defaults["_FP8_DECODE_BY_SHAPE"] and defaults["_DECODE_MM_BY_SHAPE"]  # (rows to set aside)
        set_tile_tables(["noshape"], defaults)
        assert tile_configs._GEMV_BY_SHAPE == tile_configs._FP8_DECODE_BY_SHAPE == tile_configs._DECODE_MM_BY_SHAPE == {}
        assert tile_configs.MMA_EXPERTS_MAX_PAIRS == defaults["MMA_EXPERTS_MAX_PAIRS"]
        set_tile_tables(["notcx", "sort", "eager"], defaults)  # (a suffix of no table changes none)
        assert (tile_configs.MMA_EXPERTS_MAX_PAIRS, tile_configs.MMA_EXPERTS_UNSORTED_PAIRS) == (0.0, 0)
        assert tile_configs._FP8_DECODE_BY_SHAPE is defaults["_FP8_DECODE_BY_SHAPE"]
        assert tile_configs.ROUND_TRIP_IN_PRODUCERS is True
        set_tile_tables(["noready"], defaults)  # every product rounds its own input
        assert tile_configs.ROUND_TRIP_IN_PRODUCERS is False
        set_tile_tables(["noside"], defaults)  # everything on the caller's stream
        assert (tile_configs.SIDE_STREAM, tile_configs.ROUND_TRIP_IN_PRODUCERS) == (False, True)
        assert tile_configs.MMA_EXPERTS_MAX_PAIRS == defaults["MMA_EXPERTS_MAX_PAIRS"]
        set_tile_tables([], defaults)
        assert tile_table_defaults() == defaults
    finally:
        set_tile_tables([], defaults)
