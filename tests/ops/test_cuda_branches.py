"""CUDA-only branches checked on CPU: each stands in for the GPU condition that would have broken it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rotarium.ops.rms_norm as rms_norm_module
from rotarium.ops import chunk_gla
from rotarium.ops.utils import check_cu_seqlens, checks_values


def test_fused_rms_norm_returns_the_input_dtype_when_autocast_computes_in_float32(monkeypatch):
    """CUDA autocast runs F.rms_norm in float32; QK-normed queries must still come back in the dtype of the values."""
    original = F.rms_norm
    monkeypatch.setattr(rms_norm_module, "fused_kernel_available", lambda x: True)
    monkeypatch.setattr(rms_norm_module.F, "rms_norm", lambda *args, **kwargs: original(*args, **kwargs).float())
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    out = rms_norm_module.rms_norm(x, torch.ones(8), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, original(x.float(), (8,), torch.ones(8), 1e-6).bfloat16())


def test_value_checks_read_only_host_tensors_by_default():
    assert checks_values(torch.zeros(2))
    assert not checks_values(torch.zeros(2, device="meta"))  # stands for CUDA: a read would synchronise


def test_packed_boundaries_are_read_from_the_host_copy():
    """Given the host copy, neither the checks nor the PyTorch path read ``cu_seqlens`` itself (on CUDA each read is
    a synchronisation): a device tensor whose values are unknowable works as long as the copy is there."""
    cu_seqlens_cpu = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match="must end at the packed length"):
        check_cu_seqlens(torch.zeros(3, dtype=torch.long, device="meta"), 1, 9, torch.device("meta"), cu_seqlens_cpu)
    q = torch.randn(1, 8, 2, 4)
    g = F.logsigmoid(torch.randn(1, 8, 2, 4))
    expected, _ = chunk_gla(q, q, q, g, cu_seqlens=cu_seqlens_cpu)

    class Unreadable(torch.Tensor):
        def tolist(self):
            raise AssertionError("cu_seqlens was read")

    unreadable = cu_seqlens_cpu.clone().as_subclass(Unreadable)
    out, _ = chunk_gla(q, q, q, g, cu_seqlens=unreadable, cu_seqlens_cpu=cu_seqlens_cpu)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
