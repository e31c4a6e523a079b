"""The one RMSNorm of rotarium: ``torch.nn.RMSNorm``'s parameters and state dict, computed by
:func:`rotarium.ops.rms_norm.rms_norm`."""
from __future__ import annotations

import torch
from torch import nn

from rotarium.ops.rms_norm import rms_norm


class RMSNorm(nn.RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the per-head norms get the kernels' bf16 outputs next to a float32 weight, a pair that
        # torch.rms_norm only runs unfused (and warns about); the weight follows the input, as autocast's matmuls do.
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return rms_norm(x, weight, self.eps)


class HeadRMSNorm(nn.Module):
    """RMSNorm of each head over its features with a weight of its own per head (weight ``[H, D]``): the QK-norm of
    fla's Forgetting Transformer and of the FoX paper's "Pro" models, where :class:`RMSNorm` shares one ``[D]`` weight
    across heads. Computed in float32, as fla's group norm computes it."""

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, H, D]`` -> ``[B, T, H, D]`` in x's dtype."""
        normalized = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normalized * self.weight.float()).to(x.dtype)
