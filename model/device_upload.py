"""Host values to the device without a host synchronisation.

A plain ``torch.tensor(values, device="cuda")`` or ``tensor.to("cuda")`` copies from pageable
memory, which makes the host wait for the device: inside a step that stalls zero-overhead
scheduling (the host can no longer run ahead of the device). ``upload`` stages the values in pinned
memory and copies asynchronously; torch's caching host allocator does not hand that pinned buffer
out again before the copy has run, so the caller may forget it at once.

``upload_many`` sends several small arrays in one copy. Every copy is an operation of the step's
stream, which the device runs between two kernels with its compute idle: a sampler's six
per-row parameters took six of them per decode step.
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


_ALIGN = 16  # bytes: each array's start, as a fresh allocation's (kernels specialize on 16-byte alignment)


def upload_many(parts: Sequence[tuple[Sequence | torch.Tensor | np.ndarray, torch.dtype]],
                device: torch.device) -> list[torch.Tensor]:
    """``upload`` of each ``(values, dtype)`` in ``parts``, in one host-to-device copy: the arrays are
    packed into one pinned buffer and come back as 1-D views of one device buffer."""
    arrays = [values.to(dtype).numpy() if isinstance(values, torch.Tensor)
              else np.asarray(values, dtype=_NUMPY_DTYPES[dtype]).reshape(-1) for values, dtype in parts]
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=device.type == "cuda")
    packed = host.numpy()
    for array, offset in zip(arrays, offsets):
        packed[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)
    on_device = host.to(device, non_blocking=True)
    return [on_device[offset:offset + array.nbytes].view(dtype)
            for (_, dtype), array, offset in zip(parts, arrays, offsets)]
