"""Modules: the positional layer, the four token mixers and the shared block pieces. Which family a mixer serves is
its config's to say (``mixer_class``, ``rotarium.models.configuration``): the layers know no family."""
from __future__ import annotations

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

__all__ = [
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
    "build_positional",
    "default_intermediate_size",
]
