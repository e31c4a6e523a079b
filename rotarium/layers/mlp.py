"""SwiGLU feed-forward network (Llama's layout and parameter names)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def default_intermediate_size(hidden_size: int) -> int:
    """``256 * ceil(int(d * 4 * 2/3) / 256)``: the 8/3 width of SwiGLU rounded up to a multiple of 256."""
    return 256 * math.ceil(int(hidden_size * 4 * 2 / 3) / 256)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or default_intermediate_size(hidden_size)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
