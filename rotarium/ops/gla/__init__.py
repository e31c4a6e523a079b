"""Gated linear attention (docs/design.md §2.1): the chunked training op, the recurrent decoding op, the naive
reference."""
from rotarium.ops.gla.chunk import chunk_gla
from rotarium.ops.gla.fused_recurrent import fused_recurrent_gla
from rotarium.ops.gla.naive import naive_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla", "naive_recurrent_gla"]
