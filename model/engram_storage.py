"""Where the Engram tables live: in GPU memory, or in pinned host memory that the GPU reads directly.

The tables of the real V4.1-Flash hold ~197 GB: next to a rank's experts they do not fit on one
GPU. Each forward touches only the few rows its tokens hash to (``columns`` rows per token and
Engram layer), so the tables can stay in host memory and the GPU gather those rows itself:

* ``gpu``: tables moved to the device like every other weight (fastest lookups).
* ``host``: tables stay in host memory, page-locked in place (``cudaHostRegister``: no copy, no
  rounding of the allocation) and mapped into the GPU's address space (unified virtual
  addressing). The model indexes a CUDA tensor viewing that memory, so the lookup is an ordinary
  gather kernel whose reads cross PCIe: no host synchronisation, nothing different in the model.

On a CPU device host and device memory are the same: both choices keep the tables where they are.

Default (no ``--engram-storage``): ``gpu`` when every weight of the rank, tables included, fits in
``GPU_WEIGHT_SHARE`` of the free GPU memory (the rest is left to the KV caches and activations);
``host`` otherwise. The decision and its reason are logged at startup.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import torch

from .config import V41Config
from .weight_spec import checkpoint_tensors

log = logging.getLogger(__name__)

STORAGES = ("gpu", "host")
GPU_WEIGHT_SHARE = 0.8  # tables go on the GPU by default only if all weights fit in this share of free memory
_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def engram_table_bytes(cfg: V41Config) -> int:
    """Bytes of every Engram table of ``cfg`` (values and scales), as the checkpoint stores them."""
    return sum(math.prod(spec.shape) * _BYTES[spec.dtype] for name, spec in checkpoint_tensors(cfg).items()
               if ".engram.embed." in name)


@dataclass(frozen=True)
class EngramPlacement:
    storage: str  # "gpu" or "host"
    reason: str

    def describe(self, table_bytes: int) -> str:
        where = "device memory" if self.storage == "gpu" else "pinned host memory, gathered by the GPU over PCIe"
        return f"{table_bytes / 2**30:.2f} GiB of Engram tables in {where} ({self.reason})"


def choose_engram_storage(requested: str | None, device: torch.device | str, table_bytes: int,
                          other_weight_bytes: int, free_bytes: int | None) -> EngramPlacement:
    """Where the tables go. ``requested``: ``gpu``, ``host`` or None (decide from ``free_bytes``,
    the free device memory before loading; None on a CPU device)."""
    if requested is not None and requested not in STORAGES:
        raise ValueError(f"--engram-storage must be one of {', '.join(STORAGES)}, got {requested!r}")
    if torch.device(device).type != "cuda":
        return EngramPlacement("gpu", "a CPU device: host memory is the device's memory")
    if requested is not None:
        return EngramPlacement(requested, f"--engram-storage {requested}")
    if table_bytes == 0:
        return EngramPlacement("gpu", "no Engram tables")
    if free_bytes is None:
        raise ValueError("choosing the Engram storage on a GPU needs its free memory")
    need, budget = other_weight_bytes + table_bytes, GPU_WEIGHT_SHARE * free_bytes
    if need <= budget:
        return EngramPlacement("gpu", f"all weights, {need / 2**30:.1f} GiB, fit in {GPU_WEIGHT_SHARE:.0%} of the "
                                      f"{free_bytes / 2**30:.1f} GiB free")
    return EngramPlacement("host", f"all weights, {need / 2**30:.1f} GiB, exceed {GPU_WEIGHT_SHARE:.0%} of the "
                                   f"{free_bytes / 2**30:.1f} GiB free")


def place_engram_tables(cfg: V41Config, requested: str | None, device: torch.device | str,
                        rank_weight_bytes: int) -> EngramPlacement:
    """The loader's decision, made before any weight is on the device and logged:
    ``rank_weight_bytes`` are all the checkpoint bytes this rank loads, tables included."""
    tables = engram_table_bytes(cfg)
    device = torch.device(device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    placement = choose_engram_storage(requested, device, tables, rank_weight_bytes - tables, free)
    if tables:
        log.info("Engram: %s", placement.describe(tables))
    return placement


class _MappedHostMemory:
    """A CPU tensor's memory page-locked and mapped for the GPU, described as CUDA memory
    (``__cuda_array_interface__``) so that torch can view it as a CUDA tensor without copying.
    Unregistered when the last view of it is gone."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # keeps the memory alive as long as a view exists
        self.nbytes = tensor.untyped_storage().nbytes()
        self.address = tensor.data_ptr()
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(self.address, self.nbytes, _HOST_REGISTER_PORTABLE_MAPPED))
        weakref.finalize(self, cudart.cudaHostUnregister, self.address)

    @property
    def __cuda_array_interface__(self) -> dict:
        # with unified addressing a registered host pointer is valid on the device as it is
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 2,
                "strides": None}


def host_resident(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CUDA tensor on ``device`` equal to ``tensor`` whose memory stays on the host (see module doc)."""
    device = torch.device(device)
    host = tensor.detach().cpu().contiguous()
    if host.storage_offset() or host.untyped_storage().nbytes() != host.nbytes:
        host = host.clone()  # register exactly this tensor's bytes, not a larger storage it is part of
    if host.numel() == 0:
        return host.to(device)
    raw = torch.asarray(_MappedHostMemory(host), device=device)
    if raw.data_ptr() != host.data_ptr():
        raise RuntimeError("the GPU cannot address registered host memory in place (no unified addressing): "
                           "use --engram-storage gpu")
    return raw.view(host.dtype).view(host.shape)
