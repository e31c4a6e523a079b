"""Cumulative sum over time that restarts at every packed sequence (fla's ``chunk_global_cumsum`` with ``cu_seqlens``).

FoX's cumulative log forget gate and Selective RoPE's cumulative angle both use it.
"""
from __future__ import annotations

import torch


def segment_cumsum(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Cumulative sum of x ``[B, T, ...]`` over time (dim 1), in x's dtype and differentiable.

    With ``cu_seqlens`` (int ``[N + 1]`` boundaries of sequences packed into a batch of size 1) the sum restarts at
    every boundary.
    """
    if cu_seqlens is None:
        return x.cumsum(1)
    # float64 so that subtracting the running total at a sequence start loses nothing over long packed batches
    total = x.double().cumsum(1)
    starts = cu_seqlens[:-1].long()
    before_start = torch.where(starts > 0, starts - 1, 0)
    offsets = torch.where((starts > 0).view(-1, *([1] * (x.ndim - 2))), total[0, before_start],
                          torch.zeros_like(total[0, before_start]))
    lengths = cu_seqlens[1:].long() - starts
    per_token = torch.repeat_interleave(offsets, lengths, dim=0, output_size=x.shape[1])
    return (total - per_token.unsqueeze(0)).to(x.dtype)
