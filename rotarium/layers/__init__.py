"""Modules: the positional layer, the four token mixers and the shared block pieces."""
from __future__ import annotations

from torch import nn

from rotarium.layers.attention import ForgettingAttention, SoftmaxAttention, TransformerAttention
from rotarium.layers.block import Block
from rotarium.layers.conv import ShortConvolution
from rotarium.layers.linear_attention import DeltaNet, GatedLinearAttention
from rotarium.layers.mlp import SwiGLU, default_intermediate_size
from rotarium.layers.norm import HeadRMSNorm, RMSNorm
from rotarium.layers.positional import (
    POSITION_ENCODINGS,
    MixerSpec,
    PositionalEncoding,
    PositionalOutput,
    PositionalSettings,
    build_positional,
)
from rotarium.layers.sequence import SequenceInfo
from rotarium.layers.state import (
    AttentionState,
    DecodingState,
    LinearAttentionState,
    RotaryState,
    SelectiveRoPEState,
)

# Each family's token mixer, under the family's name (its config's `family`). The layers cannot see the configs
# and models above them, so a family registers its mixer here and `rotarium.models.modeling.FAMILY_MODELS` holds
# the rest of its record (docs/design.md §6).
MIXERS: dict[str, type[nn.Module]] = {
    "gla": GatedLinearAttention,
    "fox": ForgettingAttention,
    "deltanet": DeltaNet,
    "transformer": TransformerAttention,
}


def build_mixer(family: str, **kwargs) -> nn.Module:
    """The token mixer of ``family`` (one of :data:`MIXERS`) built from its keyword arguments."""
    if family not in MIXERS:
        raise ValueError(f"unknown mixer family {family!r}; choose one of {tuple(MIXERS)}")
    return MIXERS[family](**kwargs)


__all__ = [
    "MIXERS",
    "POSITION_ENCODINGS",
    "AttentionState",
    "Block",
    "DecodingState",
    "DeltaNet",
    "ForgettingAttention",
    "GatedLinearAttention",
    "HeadRMSNorm",
    "LinearAttentionState",
    "MixerSpec",
    "PositionalEncoding",
    "PositionalOutput",
    "PositionalSettings",
    "RMSNorm",
    "RotaryState",
    "SelectiveRoPEState",
    "SequenceInfo",
    "ShortConvolution",
    "SoftmaxAttention",
    "SwiGLU",
    "TransformerAttention",
    "build_mixer",
    "build_positional",
    "default_intermediate_size",
]
