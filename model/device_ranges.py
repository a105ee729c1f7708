"""Index ranges made once per device and handed out again by every later forward.

A one-token decode step of the 8-layer V4.1-Flash config ran ~25 ``torch.arange`` kernels and ~16
more that derive the MoE's pair rows from one (``pair_tokens``), all for values that depend on a
length alone; inside a CUDA graph on one H200 each costs a launch of ~1-2 µs. Here each range is
made once per device, as long as the longest asked for so far, and callers get a slice of it (a
view: no kernel). The tensors are shared, so callers must never write into them.

Nothing is cached while a CUDA graph is being captured: a kernel recorded there has not run yet, so
its output would hold garbage for anyone who read it outside the graph. The engine runs every
graph's forward once eagerly before capturing it, which makes the same ranges first, so the graph
records views of them and no kernel. A graph holds only the addresses it read, so a range that a
longer one replaces is kept alive, never freed (its memory must not be handed to another tensor
while a graph may still read it); ranges grow at least twofold, so this at most doubles their bytes.
"""

from __future__ import annotations

import torch

MAX_CACHED = 1 << 22  # longer ranges (rare: a long prefill's query x top-k) are made each time; so at
# most ~64 MiB of int64 ranges (the longest and the ones it replaced) stay per device and kind

_ranges: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, k) -> arange(n) // k
_replaced: list[torch.Tensor] = []  # shorter ranges that captured graphs may still read: never freed


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _range(n: int, k: int, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    key = (device, k)
    cached = _ranges.get(key)
    if cached is not None and cached.shape[0] >= n:
        return cached[:n]
    if n > MAX_CACHED or _capturing(device):
        return _make(n, k, device)
    made = _make(min(max(n, 2 * cached.shape[0]), MAX_CACHED) if cached is not None else n, k, device)
    if cached is not None:
        _replaced.append(cached)
    _ranges[key] = made
    return made[:n]


def _make(n: int, k: int, device: torch.device) -> torch.Tensor:
    made = torch.arange(n, device=device)
    return made // k if k != 1 else made


def arange(n: int, device: torch.device | str) -> torch.Tensor:
    """``torch.arange(n, device=device)`` (int64), shared: do not write into it."""
    return _range(n, 1, device)


def pair_tokens(tokens: int, k: int, device: torch.device | str) -> torch.Tensor:
    """``[tokens * k]`` int64: the token of each (token, choice) pair, ``arange(tokens * k) // k``,
    shared: do not write into it."""
    return _range(tokens * k, k, device)
