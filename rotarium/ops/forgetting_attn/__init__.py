"""Softmax attention ops: FoX forgetting attention (plain causal attention with ``g=None``) and its KV-cache entry
point, and the eager path that returns the attention weights."""
from rotarium.ops.forgetting_attn.decoding import forgetting_attn_with_cache
from rotarium.ops.forgetting_attn.eager import eager_forgetting_attn
from rotarium.ops.forgetting_attn.naive import naive_forgetting_attn, naive_forgetting_attn_with_cache
from rotarium.ops.forgetting_attn.parallel import parallel_forgetting_attn

__all__ = [
    "eager_forgetting_attn",
    "forgetting_attn_with_cache",
    "naive_forgetting_attn",
    "naive_forgetting_attn_with_cache",
    "parallel_forgetting_attn",
]
