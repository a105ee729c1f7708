"""Dummy weights: a checkpoint reader that makes every tensor up, directly on the device.

Real-size runs (timing, memory, kernels at the real widths) need no trained weights, but writing
and reading tens of GB of random safetensors would dominate every run. ``DummyCheckpointReader``
answers the loader's questions from ``weight_spec.checkpoint_tensors`` instead and draws each
tensor when it is asked for, in its storage format, with the initialisers of
``make-checkpoint`` (so norms, gains and scales have the statistics the kernels expect).

Each weight has its own generator, seeded from (seed, name), so tensors can be fetched in any
order, or on several ranks, and a name always gives the same values on one kind of device (CPU
and CUDA generators differ). A quantized weight and its scale are drawn together; the half not
asked for yet waits in a small cache until it is fetched, so memory is never held twice.

The routers' biases are zero, not drawn: a trained router's bias is what balances its experts'
load, and a random one (make-checkpoint's, std 0.5 against scores that vary by ~0.1 between tokens)
sends every token to the same few experts: 22-31 of the 384 for a batch of 64 tokens at the
real widths, where a load-balanced router spreads them over ~240 (as uniform routing does). With
zero biases the random gate weights alone choose, and a batch's tokens spread like uniform routing
(``tests/test_dummy_weights.py``), so a decode step reads the expert weights a served model reads.

Real-size Engram tables (~197 GB) cannot be made up: build ``cfg`` with
``presets.shrink_engram_config`` (or ``shrink_engram`` on the text config) first, and give the
model and this reader the same shrunk config.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import torch

from .checkpoint_maker import check_tensor, random_tensor, scale_name
from .config import V41Config
from .weight_spec import checkpoint_tensors

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


def tensor_seed(seed: int, name: str) -> int:
    """A stable 63-bit generator seed for one tensor (Python's ``hash`` changes per process)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DummyCheckpointReader:
    """``model.loader.CheckpointReader``'s interface over made-up weights for ``cfg``."""

    def __init__(self, cfg: V41Config, device: str | torch.device | None = None, seed: int = 0,
                 path: str | Path = "<dummy weights>"):
        self.cfg = cfg
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.seed = int(seed)
        self.path = Path(path)
        self._specs = checkpoint_tensors(cfg)
        self._waiting: dict[str, torch.Tensor] = {}  # the other half of a weight/scale pair
        total = sum(_DTYPE_BYTES[s.dtype] * math.prod(s.shape) for s in self._specs.values())
        logger.info("dummy weights: %d tensors, %.2f GB, made on %s with seed %d",
                    len(self._specs), total / 1e9, self.device, self.seed)

    def names(self) -> list[str]:
        return list(self._specs)

    def dtype_and_shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        spec = self._specs[name]
        return spec.dtype, spec.shape

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on ``self.device``; a scale is the one its weight was quantized with."""
        spec = self._specs[name]
        waiting = self._waiting.pop(name, None)
        if waiting is not None:
            return waiting
        if spec.kind == "gate_bias":  # a load-balanced router's (the module's docstring)
            return torch.zeros(spec.shape, dtype=torch.float32, device=self.device)
        weight_name = name.removesuffix(".scale") + ".weight" if spec.kind == "scale" else name
        gen = torch.Generator(device=self.device).manual_seed(tensor_seed(self.seed, weight_name))
        values, scale = random_tensor(weight_name, self._specs[weight_name], gen, packed_fp4_codes=True)
        if scale is None:
            check_tensor(name, values, spec)
            return values
        check_tensor(weight_name, values, self._specs[weight_name])
        check_tensor(scale_name(weight_name), scale, self._specs.get(scale_name(weight_name)))
        if name == weight_name:
            self._waiting[scale_name(weight_name)] = scale
            return values
        self._waiting[weight_name] = values
        return scale

