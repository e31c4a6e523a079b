"""Every kernel and autograd Function of rotarium, with fla's names and its ``[B, T, H, D]`` layout.

- ``gla``, ``delta_rule``, ``forgetting_attn``: the token mixers' ops (exported here). Each runs fla's Triton kernel
  on CUDA when fla works there and rotarium's chunkwise PyTorch implementation everywhere else (see
  :mod:`rotarium.ops.backend` for forcing either one), and each folder holds a step-by-step ``naive`` reference.
- ``rotary``, ``cumsum``, ``l2norm``, ``rms_norm``, ``convolution``: the smaller kernels of the layers (positional
  rotations, sums restarting at packed sequences, normalisations, the short convolution).
- ``linear_cross_entropy``: the causal-LM loss through the output projection, chunk by chunk (fla's on CUDA).
- ``utils``: validation at the op boundary, packing, chunk layouts.

Allocation: on CPU, obtaining a large fresh tensor from the operating system can cost more than the arithmetic that
fills it. So the PyTorch kernels write into buffers they already hold, in place where autograd would allocate, and
lay long inputs out block by block; benchmarks/ops.py and benchmarks/layers.py time them (docs/benchmarks.md).
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
from rotarium.ops.linear_cross_entropy import fused_linear_cross_entropy_loss

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "fla_available",
    "forgetting_attn_with_cache",
    "fused_linear_cross_entropy_loss",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "parallel_forgetting_attn",
]
