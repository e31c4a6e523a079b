"""The one RMSNorm of rotarium.

``torch.nn.RMSNorm`` dispatches to a fused kernel on CUDA in recent PyTorch, so one implementation serves every
device; fla's fused norm would only save a few percent and would make checkpoints depend on where they were trained.
"""
from __future__ import annotations

from torch import nn


class RMSNorm(nn.RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps)
