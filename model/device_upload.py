"""Host values to the device without a host synchronisation.

A plain ``torch.tensor(values, device="cuda")`` or ``tensor.to("cuda")`` copies from pageable
memory, which makes the host wait for the device: inside a step that stalls zero-overhead
scheduling (the host can no longer run ahead of the device). ``upload`` stages the values in pinned
memory and copies asynchronously; torch's caching host allocator does not hand that pinned buffer
out again before the copy has run, so the caller may forget it at once.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                 torch.float64: np.float64, torch.bool: np.bool_}


def upload(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, a numpy array or a CPU tensor) as a ``dtype`` tensor on ``device``."""
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    elif dtype in _NUMPY_DTYPES:
        host = torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))  # a copy: never the caller's array
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
