"""Chunked linear-attention and softmax-attention kernels with fla's signatures.

Every op takes ``[B, T, H, D]`` tensors and runs fla's Triton kernel on CUDA when
fla works there, rotarium's chunkwise PyTorch implementation everywhere else
(see :mod:`rotarium.ops.backend` for forcing either one). Each op folder holds
a step-by-step ``naive`` reference beside the kernel.
"""
from rotarium.ops.backend import fla_available
from rotarium.ops.delta_rule import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from rotarium.ops.forgetting_attn import forgetting_attn_with_cache, parallel_forgetting_attn
from rotarium.ops.gla import chunk_gla, fused_recurrent_gla

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "fla_available",
    "forgetting_attn_with_cache",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "parallel_forgetting_attn",
]
