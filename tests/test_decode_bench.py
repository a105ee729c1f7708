"""The GPU-idle figure of benchmarks/decode.py: the union of device intervals in a profiler trace."""

from __future__ import annotations

from types import SimpleNamespace

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
