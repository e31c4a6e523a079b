"""The pre-norm residual block every family shares: ``h += Mixer(RMSNorm(h))``, ``h += MLP(RMSNorm(h))``."""
from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from rotarium.layers.mlp import SwiGLU
from rotarium.layers.norm import RMSNorm
from rotarium.layers.sequence import SequenceInfo
from rotarium.layers.state import DecodingState


class Block(GradientCheckpointingLayer):
    """transformers' checkpointing layer: ``activation_checkpointing_enable()`` (or the older
    ``gradient_checkpointing_enable()``) recomputes it in the backward, every block or every n-th, with the
    checkpoint function's options, and turns ``use_cache`` off while it does."""

    def __init__(self, hidden_size: int, mixer: torch.nn.Module, intermediate_size: int | None = None,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.mixer_norm = RMSNorm(hidden_size, eps=norm_eps)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(self, hidden_states: torch.Tensor, seq: SequenceInfo, state: DecodingState | None = None,
                use_cache: bool = False, output_attentions: bool = False) -> tuple:
        """``([B, T, d], the mixer's new state when use_cache)``, and its attention weights ``[B, H, T, past + T]``
        after them when ``output_attentions`` (softmax mixers only)."""
        mixed, state, *weights = self.mixer(self.mixer_norm(hidden_states), seq, state, use_cache, output_attentions)
        hidden_states = hidden_states + mixed
        hidden_states = hidden_states + self.mlp(self.mlp_norm(hidden_states))
        return (hidden_states, state, *weights)
