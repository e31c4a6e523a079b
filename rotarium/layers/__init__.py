"""Modules: the positional layer, the four token mixers and the shared block pieces."""
from __future__ import annotations

from functools import partial

from torch import nn

from rotarium.layers.attention import SoftmaxAttention
from rotarium.layers.block import Block
from rotarium.layers.conv import ShortConvolution
from rotarium.layers.linear_attention import DeltaNet, GatedLinearAttention
from rotarium.layers.mlp import SwiGLU, default_intermediate_size
from rotarium.layers.norm import HeadRMSNorm, RMSNorm
from rotarium.layers.positional import (
    POSITION_ENCODINGS,
    Encoded,
    HeadDims,
    PositionalEncoding,
    PositionalSettings,
    build_positional,
)
from rotarium.layers.sequence import SequenceInfo

MIXERS = {
    "gla": GatedLinearAttention,
    "fox": partial(SoftmaxAttention, forget_gate=True),
    "deltanet": DeltaNet,
    "transformer": partial(SoftmaxAttention, forget_gate=False),
}


def build_mixer(family: str, **kwargs) -> nn.Module:
    """The token mixer of ``family`` (one of :data:`MIXERS`) built from its keyword arguments."""
    if family not in MIXERS:
        raise ValueError(f"unknown mixer family {family!r}; choose one of {tuple(MIXERS)}")
    return MIXERS[family](**kwargs)


__all__ = [
    "MIXERS", "POSITION_ENCODINGS", "Block", "DeltaNet", "Encoded", "GatedLinearAttention", "HeadDims", "HeadRMSNorm",
    "PositionalEncoding", "PositionalSettings", "RMSNorm", "SequenceInfo", "ShortConvolution", "SoftmaxAttention",
    "SwiGLU", "build_mixer", "build_positional", "default_intermediate_size",
]
