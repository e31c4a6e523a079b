"""Softmax attention mixers: the Transformer's attention and FoX's forgetting attention, one module.

FoX (Lin et al., ICLR 2025) is causal softmax attention with a per-head forget gate, ``logits + c_i - c_j`` with
``c = cumsum(log f)``; the Transformer is the same without the gate (Selective RoPE gives it one, on by default).
Both run on :func:`rotarium.ops.parallel_forgetting_attn`, and on
:func:`rotarium.ops.forgetting_attn_with_cache` when there are cached keys or padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rotarium.layers.norm import HeadRMSNorm, RMSNorm
from rotarium.layers.positional import HeadDims, PositionalSettings, build_positional
from rotarium.layers.sequence import SequenceInfo
from rotarium.ops import forgetting_attn_with_cache, parallel_forgetting_attn


class SoftmaxAttention(nn.Module):
    """Causal softmax attention with grouped-query heads, an optional FoX forget gate, QK-norm and output gate.

    The QK-norm is an RMSNorm over each head's features, with one weight shared by all heads (Llama-style models,
    fla's Transformer) or, with ``qk_norm_per_head``, a weight per head (fla's Forgetting Transformer, the FoX
    paper's "Pro" models); ``qk_norm_eps`` (default ``norm_eps``) matches the epsilon of the model converted.

    The cache holds the rotated keys and values (RoVE's values are stored rotated), the cumulative log decay of
    every cached position and the padding mask of the cached keys.
    """

    def __init__(self, hidden_size: int, num_heads: int, positional: PositionalSettings,
                 num_kv_heads: int | None = None, head_dim: int | None = None, forget_gate: bool = False,
                 qk_norm: bool = False, qk_norm_per_head: bool = False, qk_norm_eps: float | None = None,
                 output_gate: bool = False, attention_bias: bool = False, norm_eps: float = 1e-6):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads < 1 or (head_dim is None and hidden_size % num_heads):
            raise ValueError(f"`num_heads` ({num_heads}) must divide `hidden_size` ({hidden_size}), "
                             "or give `head_dim` explicitly")
        if num_heads % num_kv_heads:
            raise ValueError(f"`num_kv_heads` ({num_kv_heads}) must divide `num_heads` ({num_heads})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.forget_gate, self.qk_norm, self.output_gate = forget_gate, qk_norm, output_gate
        if forget_gate:
            self.fgate_proj = nn.Linear(hidden_size, num_heads, bias=True)
        if (qk_norm_per_head or qk_norm_eps is not None) and not qk_norm:
            raise ValueError("`qk_norm_per_head` and `qk_norm_eps` shape the QK-norm: set `qk_norm=True` to use them")
        if qk_norm_eps is not None and not qk_norm_eps > 0:
            raise ValueError(f"`qk_norm_eps` must be positive, got {qk_norm_eps!r}")
        if qk_norm:
            eps = norm_eps if qk_norm_eps is None else qk_norm_eps
            if qk_norm_per_head:
                self.q_norm = HeadRMSNorm(num_heads, self.head_dim, eps=eps)
                self.k_norm = HeadRMSNorm(num_kv_heads, self.head_dim, eps=eps)
            else:
                self.q_norm = RMSNorm(self.head_dim, eps=eps)
                self.k_norm = RMSNorm(self.head_dim, eps=eps)
        if output_gate:
            self.ogate_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.positional = build_positional(positional, HeadDims(
            hidden_size, num_heads, num_kv_heads, self.head_dim, self.head_dim, mixer_has_decay=forget_gate,
            heads_major=True))

    def forward(self, hidden_states: torch.Tensor, seq: SequenceInfo, state: dict | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, dict | None]:
        """hidden_states ``[B, T, d]`` -> ``([B, T, d], the layer's new cache state when use_cache)``."""
        x = hidden_states
        B, T, _ = x.shape
        state = state or {}
        if seq.cu_seqlens is not None and (state or use_cache):
            raise ValueError("packed inputs (`cu_seqlens`) cannot use a cache; run them with use_cache=False")
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        enc = self.positional(q, k, v, x, seq, state.get("positional"))
        g = seq.zero_padding(F.logsigmoid(self.fgate_proj(x).float())) if self.forget_gate else enc.log_decay

        if not state and seq.mask is None:
            o = parallel_forgetting_attn(enc.q, enc.k, enc.v, g, scale=self.scale, cu_seqlens=seq.cu_seqlens)
            keys, values = enc.k, enc.v
            key_mask = torch.ones(B, T, dtype=torch.bool, device=x.device)
            log_decay_cumsum = None if g is None or not use_cache else g.cumsum(1)
        else:
            keys = _append(state.get("keys"), enc.k)
            values = _append(state.get("values"), enc.v)
            current_mask = seq.mask if seq.mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
            key_mask = _append(state.get("key_mask"), current_mask)
            log_decay_cumsum = q_cumsum = None
            if g is not None:
                previous = state.get("log_decay_cumsum")
                q_cumsum = g.cumsum(1) + (previous[:, -1:] if previous is not None else 0)
                log_decay_cumsum = _append(previous, q_cumsum)
            o = forgetting_attn_with_cache(enc.q, keys, values, q_cumsum, log_decay_cumsum, scale=self.scale,
                                           attention_mask=None if bool(key_mask.all()) else key_mask)
        o = enc.restore(o)
        if self.output_gate:
            o = o * torch.sigmoid(self.ogate_proj(x)).view(B, T, self.num_heads, self.head_dim)
        out = self.o_proj(o.reshape(B, T, -1))
        if not use_cache:
            return out, None
        return out, {"keys": keys, "values": values, "key_mask": key_mask, "log_decay_cumsum": log_decay_cumsum,
                     "positional": enc.state}


def _append(cached: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if cached is None else torch.cat([cached, new], dim=1)

