"""The shared index ranges (``model/device_ranges.py``): equal to what torch makes, one storage
handed out again, longer requests growing it, a replaced range never freed."""

from __future__ import annotations

import gc
import weakref

import torch

from model import device_ranges


def test_ranges_equal_torch_and_are_made_once():
    first = device_ranges.arange(10, "cpu")
    assert torch.equal(first, torch.arange(10))
    again = device_ranges.arange(7, "cpu")
    assert torch.equal(again, torch.arange(7))
    assert again.data_ptr() == first.data_ptr()  # a view of the same range: no new tensor, no kernel


def test_a_longer_range_replaces_the_shorter():
    device_ranges.arange(4, "cpu")
    longer = device_ranges.arange(1000, "cpu")
    assert torch.equal(longer, torch.arange(1000))
    assert device_ranges.arange(3, "cpu").data_ptr() == longer.data_ptr()


def test_a_replaced_range_stays_alive():
    """A CUDA graph captured with views of a range reads its memory at every replay: growing the
    range must not free it (the caching allocator would hand it to another tensor)."""
    first = device_ranges.pair_tokens(1, 97, "cpu")  # a k of its own: made here, 97 long
    old = weakref.ref(first._base)  # the cached range this is a view of
    device_ranges.pair_tokens(2, 97, "cpu")  # longer: replaces it
    del first
    gc.collect()
    assert old() is not None


def test_pair_tokens_repeat_each_token_k_times():
    assert torch.equal(device_ranges.pair_tokens(3, 2, "cpu"), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.equal(device_ranges.pair_tokens(2, 6, "cpu"), torch.arange(12) // 6)
    assert torch.equal(device_ranges.pair_tokens(1, 2, "cpu"), torch.tensor([0, 0]))  # k: its own range


def test_very_long_ranges_are_not_kept():
    n = device_ranges.MAX_CACHED + 1
    made = device_ranges.arange(n, "cpu")
    assert made.shape[0] == n and int(made[-1]) == n - 1
    assert device_ranges.arange(n, "cpu").data_ptr() != made.data_ptr()
