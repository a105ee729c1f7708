"""Engram table storage: the default decision from free memory, explicit choices, and the tables
kept in host memory giving the same lookups as tables on the device (on a GPU: the GPU gathers
rows from pinned host memory in place; the GPU part runs only where CUDA is available)."""

from __future__ import annotations

import copy

import pytest
import torch

from model.engram_storage import GPU_WEIGHT_SHARE, choose_engram_storage, engram_table_bytes, host_resident
from model.loader import load_model

GIB = 2**30


def test_default_follows_free_memory():
    fits = choose_engram_storage(None, "cuda", table_bytes=20 * GIB, other_weight_bytes=60 * GIB, free_bytes=130 * GIB)
    assert fits.storage == "gpu" and "fit" in fits.reason
    too_big = choose_engram_storage(None, "cuda", table_bytes=197 * GIB, other_weight_bytes=60 * GIB,
                                    free_bytes=130 * GIB)
    assert too_big.storage == "host" and "exceed" in too_big.reason
    edge = int(100 * GIB / GPU_WEIGHT_SHARE)
    assert choose_engram_storage(None, "cuda", 50 * GIB, 50 * GIB, edge).storage == "gpu"
    assert choose_engram_storage(None, "cuda", 50 * GIB, 50 * GIB + 1, edge).storage == "host"
    assert choose_engram_storage(None, "cuda", 0, 200 * GIB, GIB).storage == "gpu"  # no tables
    assert "pinned host memory" in too_big.describe(197 * GIB)


def test_explicit_choice_and_cpu():
    assert choose_engram_storage("host", "cuda", 1, 1, free_bytes=None).storage == "host"
    assert choose_engram_storage("gpu", "cuda", 10 * GIB, 10 * GIB, free_bytes=GIB).storage == "gpu"
    for requested in (None, "gpu", "host"):  # one memory on a CPU device
        placement = choose_engram_storage(requested, "cpu", 197 * GIB, 0, None)
        assert placement.storage == "gpu" and "CPU" in placement.reason
    with pytest.raises(ValueError, match="engram-storage"):
        choose_engram_storage("disk", "cuda", 1, 1, GIB)
    with pytest.raises(ValueError, match="free memory"):
        choose_engram_storage(None, "cuda", 1, 1, None)


def test_table_bytes(tiny_checkpoint):
    from model.config import V41Config

    cfg = V41Config.from_pretrained(tiny_checkpoint)
    model = load_model(tiny_checkpoint)
    held = sum(block.engram.table.nbytes + (0 if block.engram.table_scale is None else block.engram.table_scale.nbytes)
               for block in model.blocks if block.engram is not None)
    assert engram_table_bytes(cfg) == held > 0


def _engram_inputs(engram, columns: int, tokens: int, device):
    gen = torch.Generator().manual_seed(3)
    stream = torch.randn(tokens, engram.hc, engram.dim, generator=gen).to(torch.bfloat16).to(device)
    hash_ids = torch.randint(0, engram.table.shape[0], (tokens, columns), generator=gen).to(device)
    return stream, hash_ids


def _first_engram(checkpoint):
    model = load_model(checkpoint)
    return next(b.engram for b in model.blocks if b.engram is not None), model.cfg.num_hash_columns


def test_host_storage_on_cpu_is_the_device_memory(tiny_checkpoint):
    engram, columns = _first_engram(tiny_checkpoint)
    host = copy.copy(engram)
    host.storage = "host"
    table = engram.table
    host.to("cpu")
    assert host.table is table and not host.host_mapped  # nothing moved, nothing copied
    stream, hash_ids = _engram_inputs(engram, columns, 9, "cpu")
    assert torch.equal(host(stream, hash_ids), engram(stream, hash_ids))
    with pytest.raises(ValueError, match="storage"):
        type(engram)(engram.table, engram.table_scale, engram.wkv, torch.ones(1), torch.ones(1), 1, 1, 1e-6,
                     engram.kernels, storage="disk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tables_gathered_by_the_gpu(tiny_checkpoint):
    """Tables in pinned host memory: GPU views of the host bytes themselves, identical lookups."""
    rows = torch.randint(-128, 127, (4096, 256), dtype=torch.int8)
    view = host_resident(rows, "cuda")
    assert view.is_cuda and view.data_ptr() == rows.data_ptr()  # no device copy
    index = torch.randint(0, 4096, (100,), device="cuda")
    assert torch.equal(view[index].cpu(), rows[index.cpu()])

    on_gpu, columns = _first_engram(tiny_checkpoint)
    on_host = copy.copy(on_gpu)
    on_host.storage = "host"
    host_table = on_gpu.table
    on_host.to("cuda")
    assert on_host.host_mapped and on_host.table.is_cuda and on_host.table.data_ptr() == host_table.data_ptr()
    on_host.to("cuda")  # moving again keeps the mapping (no copy)
    assert on_host.table.data_ptr() == host_table.data_ptr()
    on_gpu.to("cuda")
    stream, hash_ids = _engram_inputs(on_gpu, columns, 33, "cuda")
    assert torch.equal(on_host(stream, hash_ids), on_gpu(stream, hash_ids))


def test_loader_decision_is_logged(tiny_checkpoint, caplog):
    from model.config import V41Config
    from model.engram_storage import place_engram_tables

    cfg = V41Config.from_pretrained(tiny_checkpoint)
    with caplog.at_level("INFO", logger="model.engram_storage"):
        placement = place_engram_tables(cfg, None, "cpu", rank_weight_bytes=10 * engram_table_bytes(cfg))
    assert placement.storage == "gpu"
    assert "Engram tables in device memory" in caplog.text
