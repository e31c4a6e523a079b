"""Causal depthwise short convolution with a decoding state: the module around
:func:`rotarium.ops.convolution.causal_conv1d`."""
from __future__ import annotations

import math

import torch
from torch import nn

from rotarium.layers.sequence import SequenceInfo
from rotarium.ops.convolution import ACTIVATIONS, causal_conv1d


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
        """``x`` ``[B, T, C]`` -> ``(y [B, T, C], new_state [B, W - 1, C])``. The state is not differentiated."""
        return causal_conv1d(seq.zero_padding(x), self.weight[:, 0, :], state, self.activation, seq.cu_seqlens)
