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
    prepending it continues a sequence exactly. Windows never reach across a packed document boundary and skip
    padded tokens, wherever they sit.
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
        weight = self.weight[:, 0, :]
        if seq.mask is None:
            return causal_conv1d(x, weight, state, self.activation, seq.cu_seqlens)
        return self._skipping_padding(x, weight, seq, state)

    def _skipping_padding(self, x: torch.Tensor, weight: torch.Tensor, seq: SequenceInfo,
                          state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution of a padded input, whose windows and state hold real tokens only. Padding can sit between
        real tokens (PEFT's prompt tuning puts its virtual tokens before a left-padded prompt; a padded chunk
        continues a state): zeros there would stand in a real token's window in place of the tokens before them,
        which the attention mask and the positions skip. So each row is reordered, without reading the mask, to its
        padding first, then the state (zeros without one) and its real tokens in order: W - 1 inputs of the state
        stand between the padding and any real window, and the last W - 1 inputs are the new state."""
        B, _, C = x.shape
        history = x.new_zeros(B, self.kernel_size - 1, C) if state is None else state.detach().to(x.dtype)
        real = torch.cat([seq.mask.new_ones(B, history.shape[1]), seq.mask], 1)
        padding_count = (~real).sum(1, keepdim=True)
        # where each input goes: the padding in order from 0, then the history and real tokens in order
        destination = torch.where(real, padding_count + real.long().cumsum(1) - 1, (~real).long().cumsum(1) - 1)
        inputs = torch.cat([history, seq.zero_padding(x)], 1)
        ordered = inputs.gather(1, destination.argsort(1)[..., None].expand(-1, -1, C))
        y, new_state = causal_conv1d(ordered, weight, None, self.activation)
        return y.gather(1, destination[:, history.shape[1]:, None].expand(-1, -1, C)), new_state
