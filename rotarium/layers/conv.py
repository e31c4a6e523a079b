"""Causal depthwise short convolution with a decoding state."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rotarium.layers.sequence import SequenceInfo

ACTIVATIONS = (None, "silu")


class ShortConvolution(nn.Module):
    """``y_t = act(sum_j w_j x_{t-j})`` over a window of ``kernel_size`` tokens, per channel.

    The weight has ``nn.Conv1d``'s layout ``[C, 1, W]``. The state is the last ``W - 1`` inputs ``[B, W - 1, C]``:
    prepending it continues a sequence exactly. Windows never reach across a packed document boundary and padded
    tokens enter as zeros.
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"short convolution `activation` must be one of {ACTIVATIONS}, got {activation!r}")
        if kernel_size < 1:
            raise ValueError(f"short convolution `kernel_size` must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.kernel_size)  # nn.Conv1d's default for a depthwise kernel
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(
        self, x: torch.Tensor, seq: SequenceInfo, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[B, T, C]`` -> ``(y [B, T, C], new_state [B, W - 1, C])``."""
        B, T, C = x.shape
        W = self.kernel_size
        x = seq.zero_padding(x)
        history = state.to(x.dtype) if state is not None else x.new_zeros(B, W - 1, C)
        extended = torch.cat([history, x], dim=1)  # [B, W - 1 + T, C]
        weight = self.weight[:, 0, :].to(x.dtype)  # [C, W]
        doc_offsets = seq.document_offsets() if seq.cu_seqlens is not None else None
        y = extended[:, W - 1:] * weight[:, W - 1]
        for lag in range(1, W):
            term = extended[:, W - 1 - lag: W - 1 - lag + T] * weight[:, W - 1 - lag]
            if doc_offsets is not None:
                term = term * (doc_offsets >= lag).unsqueeze(-1).to(x.dtype)
            y = y + term
        if self.activation == "silu":
            y = F.silu(y)
        return y, extended[:, extended.shape[1] - (W - 1):].detach() if W > 1 else x.new_zeros(B, 0, C)
