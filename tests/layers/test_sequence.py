"""A CUDA-only branch of ``SequenceInfo`` checked on CPU: it takes the host copy of ``cu_seqlens`` once and counts the
positions once."""
from __future__ import annotations

import torch

from rotarium.layers import SequenceInfo


def test_sequence_info_takes_the_host_copy_once_and_counts_positions_once():
    x = torch.randn(1, 8, 4)
    seq = SequenceInfo.build(x, cu_seqlens=torch.tensor([0, 3, 8]))
    assert seq.cu_seqlens_cpu is not None and seq.cu_seqlens_cpu.device.type == "cpu"
    assert seq.token_positions(None) is seq.token_positions(None)
    assert seq.token_positions(None).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    unpacked = SequenceInfo.build(torch.zeros(2, 5, 4, device="meta"))
    assert unpacked.token_positions(None).device.type == "meta"
