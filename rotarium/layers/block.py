"""The pre-norm residual block every family shares: ``h += Mixer(RMSNorm(h))``, ``h += MLP(RMSNorm(h))``."""
from __future__ import annotations

import torch
from torch import nn

from rotarium.layers.mlp import SwiGLU
from rotarium.layers.norm import RMSNorm
from rotarium.layers.sequence import SequenceInfo


class Block(nn.Module):
    def __init__(self, hidden_size: int, mixer: nn.Module, intermediate_size: int | None = None,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.mixer_norm = RMSNorm(hidden_size, eps=norm_eps)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(self, hidden_states: torch.Tensor, seq: SequenceInfo, state: dict | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, dict | None]:
        mixed, state = self.mixer(self.mixer_norm(hidden_states), seq, state, use_cache)
        hidden_states = hidden_states + mixed
        hidden_states = hidden_states + self.mlp(self.mlp_norm(hidden_states))
        return hidden_states, state
