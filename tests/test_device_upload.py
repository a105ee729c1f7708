"""Host values to the device (``model/device_upload.py``): ``upload_many`` gives each array's values in
its dtype, from one buffer (one copy), each array starting 16-byte aligned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.device_upload import upload, upload_many


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_upload_many_gives_each_array_from_one_buffer(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device(device)
    parts = [([3, -1, 2**40], torch.int64), ([0.1, 2.5], torch.float32), ([], torch.float64),
             (np.array([7, 8], dtype=np.int64), torch.int64), (torch.tensor([True, False, True]), torch.bool),
             ([0.25, 1e-300], torch.float64)]
    got = upload_many(parts, device)
    assert len(got) == len(parts)
    for tensor, (values, dtype) in zip(got, parts):
        assert tensor.device.type == device.type and tensor.dtype == dtype
        assert torch.equal(tensor.cpu(), upload(values, dtype, torch.device("cpu")))
        assert tensor.data_ptr() % 16 == 0
    storages = {t.untyped_storage().data_ptr() for t in got}
    assert len(storages) == 1  # one buffer: one host-to-device copy


def test_upload_many_of_nothing():
    assert upload_many([], torch.device("cpu")) == []
