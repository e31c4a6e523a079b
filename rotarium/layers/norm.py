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
