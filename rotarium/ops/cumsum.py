"""Cumulative sum over time that restarts at every packed sequence (fla's ``chunk_global_cumsum`` with ``cu_seqlens``).

FoX's cumulative log forget gate and Selective RoPE's cumulative angle both use it.
"""
from __future__ import annotations

import torch

from rotarium.ops.utils import document_index


def segment_cumsum(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Cumulative sum of x ``[B, T, ...]`` over time (dim 1), in x's dtype and differentiable.

    With ``cu_seqlens`` (int ``[N + 1]`` boundaries of sequences packed into a batch of size 1) the sum restarts at
    every boundary.
    """
    if cu_seqlens is None:
        return x.cumsum(1)
    # float64 so that subtracting the running total at a sequence start loses nothing over long packed batches
    total = x.double().cumsum(1)
    starts = cu_seqlens.long()[document_index(cu_seqlens, x.shape[1])]  # [T]: where each token's sequence starts
    before = total[0, (starts - 1).clamp_min(0)]  # the running total just before that start
    first = (starts == 0).view(-1, *([1] * (x.ndim - 2)))
    return (total - torch.where(first, 0.0, before).unsqueeze(0)).to(x.dtype)
