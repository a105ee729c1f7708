"""Rotary position embedding of V4.1: interleaved pairs, YaRN on the compressed layers.

Pure sliding-window layers (compress ratio 0) rotate with ``rope_theta`` and no YaRN; compressed
layers use ``compress_rope_theta`` with YaRN frequency interpolation (no attention-scale
correction). Rotation happens in fp32 on complex numbers formed from adjacent element pairs of
the trailing ``rope_head_dim`` dims, and the result is written back in the tensor's dtype.
"""

from __future__ import annotations

import math
import weakref

import torch

from .config import V41Config


def rope_frequencies(dim: int, theta: float, factor: float, original_len: int,
                     beta_fast: float, beta_slow: float) -> torch.Tensor:
    """Angular frequency of each of the ``dim // 2`` rotated pairs (fp32)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_len > 0:
        # the pair whose wavelength completes `turns` rotations over the original training length
        def pair_index(turns: float) -> float:
            return dim * math.log(original_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair_index(beta_fast)), 0)
        high = min(math.ceil(pair_index(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1 for fast-rotating pairs (kept), 0 for slow ones (divided by factor)
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


# Tables shared by every layer of one kind (compressed or not) of one config and length, per device: a
# table of V4.1's 1M positions (max_position_embeddings) is 256 MB, so one copy per layer would cost
# gigabytes. Entries live as long as a layer holds them.
_SHARED: "weakref.WeakValueDictionary[tuple, RotaryTable]" = weakref.WeakValueDictionary()


def _canonical(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so that one device has one key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class RotaryTable:
    """Complex rotations ``exp(i * p * freq)`` for every position up to ``max_positions``."""

    def __init__(self, freqs: torch.Tensor, max_positions: int, device: torch.device | str = "cpu"):
        angles = torch.outer(torch.arange(max_positions), freqs)
        self.table = torch.polar(torch.ones_like(angles), angles).to(device)
        self.key: tuple = ()  # (config, compressed, positions) of a shared table

    @classmethod
    def for_layer(cls, cfg: V41Config, compress_ratio: int, device: torch.device | str = "cpu",
                  max_positions: int = 0) -> "RotaryTable":
        """The table of a layer with this compress ratio: shared with every layer of the same kind.
        ``max_positions``: the positions it covers (0 or more than the config's: ``max_position_embeddings``)."""
        positions = min(max_positions or cfg.max_position_embeddings, cfg.max_position_embeddings)
        return cls._shared((cfg, bool(compress_ratio), positions), _canonical(device))

    @classmethod
    def _shared(cls, key: tuple, device: torch.device) -> "RotaryTable":
        table = _SHARED.get((*key, device))
        if table is None:
            cfg, compressed, positions = key
            if compressed:
                freqs = rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor,
                                         cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow)
            else:
                freqs = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, 1.0, 0, cfg.beta_fast, cfg.beta_slow)
            # each entry depends on its position and frequency only, so a shorter table holds the same bits
            table = cls(freqs, positions, device)
            table.key = key
            _SHARED[(*key, device)] = table
        return table

    def to(self, device: torch.device | str) -> "RotaryTable":
        """The shared table on ``device`` (this one if it is there already); never moves this one."""
        device = _canonical(device)
        if self.table.device == device:
            return self
        if not self.key:
            moved = RotaryTable.__new__(RotaryTable)
            moved.table, moved.key = self.table.to(device), ()
            return moved
        return RotaryTable._shared(self.key, device)

    def rotate_(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the trailing ``rope_head_dim`` dims of ``x`` in place.

        ``x`` is ``[T, rope_dims]`` or ``[T, H, rope_dims]`` (a view into a larger tensor is fine);
        ``positions`` is ``[T]``. ``inverse`` rotates back (used on the attention output).
        """
        rot = self.table[positions]
        if inverse:
            rot = rot.conj()
        if x.ndim == 3:
            rot = rot.unsqueeze(1)
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        x.copy_(torch.view_as_real(pairs * rot).flatten(-2))
        return x
