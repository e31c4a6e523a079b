"""Delta rule and gated delta rule (DeltaNet, Gated DeltaNet), chunked and recurrent."""
from rotarium.ops.delta_rule.chunk import chunk_delta_rule, chunk_gated_delta_rule
from rotarium.ops.delta_rule.fused_recurrent import fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule
from rotarium.ops.delta_rule.naive import naive_delta_rule, naive_gated_delta_rule

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "naive_delta_rule",
    "naive_gated_delta_rule",
]
