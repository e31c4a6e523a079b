"""Softmax attention mixers: the Transformer's attention and FoX's forgetting attention, one module with a
named subclass for each family (:class:`TransformerAttention`, :class:`ForgettingAttention`).

FoX (Lin et al., ICLR 2025) is causal softmax attention with a per-head forget gate, ``logits + c_i - c_j`` with
``c = cumsum(log f)``; the Transformer is the same without the gate (Selective RoPE gives it one, on by default).
Both run on :func:`rotarium.ops.parallel_forgetting_attn`, and on
:func:`rotarium.ops.forgetting_attn_with_cache` when there are cached keys or padding. The kernels are imported
from their own modules, not the ops packages (which also gather the naive references): an exported checkpoint ships
what the model's modules import (:mod:`rotarium.models.remote_code`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rotarium.layers.norm import HeadRMSNorm, RMSNorm
from rotarium.layers.positional import MixerSpec, PositionalSettings, build_positional
from rotarium.layers.sequence import SequenceInfo
from rotarium.layers.state import AttentionState, KVCache
from rotarium.ops.cumsum import segment_cumsum
from rotarium.ops.forgetting_attn.decoding import forgetting_attn_with_cache
from rotarium.ops.forgetting_attn.eager import eager_forgetting_attn
from rotarium.ops.forgetting_attn.parallel import parallel_forgetting_attn


class SoftmaxAttention(nn.Module):
    """Causal softmax attention with grouped-query heads, an optional FoX forget gate, QK-norm and output gate.

    The QK-norm is an RMSNorm over each head's features, with one weight shared by all heads (Llama-style models,
    fla's Transformer) or, with ``qk_norm_per_head``, a weight per head (fla's Forgetting Transformer, the FoX
    paper's "Pro" models); ``qk_norm_eps`` (default ``norm_eps``) matches the epsilon of the model converted. The
    output gate (``output_gate``, the config key; ``sigmoid_output_gate`` on the module) multiplies each head's output
    by ``sigmoid(W x)``, as FoX's; the linear mixers' gate is a SiLU.

    The layer's decoding state is an :class:`~rotarium.layers.state.AttentionState`: a :class:`KVCache` of the rotated
    keys and values (RoVE's values are stored rotated) and the positional layer's state.
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
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.forget_gate, self.qk_norm, self.sigmoid_output_gate = forget_gate, qk_norm, output_gate
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
        self.positional = build_positional(positional, MixerSpec(
            hidden_size, num_heads, num_kv_heads, self.head_dim, self.head_dim, has_decay=forget_gate,
            heads_major=True, softmax=True))

    @property
    def scale(self) -> float:
        """The scores' scale, ``head_dim ** -0.5``: computed from the integer, which torch.compile takes for a
        constant, where a float attribute would enter a graph with dynamic shapes as a symbolic input."""
        return self.head_dim ** -0.5

    def unweighted_flops_per_token(self, seq_len: int) -> int:
        """The forward FLOPs per token that no weight counts (rotarium.training.flops): the scores and the weighted
        sum of the values, ``2 Q`` each per query head and context position."""
        return 4 * self.num_heads * self.head_dim * seq_len

    def forward(self, hidden_states: torch.Tensor, seq: SequenceInfo, state: AttentionState | None = None,
                use_cache: bool = False, output_attentions: bool = False) -> tuple:
        """hidden_states ``[B, T, d]`` -> ``([B, T, d], the layer's new cache state when use_cache)``, and with
        ``output_attentions`` the attention probabilities ``[B, H, T, past + T]`` after them, from the eager path
        (:func:`rotarium.ops.forgetting_attn.eager_forgetting_attn`) that also computes the output."""
        x = hidden_states
        B, T, _ = x.shape
        if seq.cu_seqlens is not None and (state is not None or use_cache):
            raise ValueError("packed inputs (`cu_seqlens`) cannot use a cache; run them with use_cache=False")
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        enc = self.positional(q, k, v, x, seq, None if state is None else state.positional)
        g = seq.zero_padding(F.logsigmoid(self.fgate_proj(x).float())) if self.forget_gate else enc.log_decay

        cache = None if state is None else state.kv
        weights = None
        if cache is None and seq.mask is None:
            if output_attentions:
                c = None if g is None else segment_cumsum(g, seq.cu_seqlens)
                o, weights = eager_forgetting_attn(enc.q, enc.k, enc.v, c, c, scale=self.scale,
                                                   cu_seqlens=seq.cu_seqlens)
            else:
                o = parallel_forgetting_attn(enc.q, enc.k, enc.v, g, scale=self.scale, cu_seqlens=seq.cu_seqlens,
                                             cu_seqlens_cpu=seq.cu_seqlens_cpu)
            cache = KVCache.start(enc.k, enc.v, None if g is None else g.cumsum(1)) if use_cache else None
        else:
            q_cumsum = None
            if g is not None:
                q_cumsum = g.cumsum(1) if cache is None else g.cumsum(1) + cache.log_decay_cumsum[:, -1:]
            if cache is None:
                cache = KVCache.start(enc.k, enc.v, q_cumsum, seq.mask)
            else:
                cache = cache.append(enc.k, enc.v, q_cumsum, seq.mask)
            attended = (enc.q, cache.keys, cache.values, q_cumsum, cache.log_decay_cumsum)
            if output_attentions:
                o, weights = eager_forgetting_attn(*attended, scale=self.scale, attention_mask=cache.key_mask)
            else:
                o = forgetting_attn_with_cache(*attended, scale=self.scale, attention_mask=cache.key_mask)
        o = enc.restore(o)
        if self.sigmoid_output_gate:
            o = o * torch.sigmoid(self.ogate_proj(x)).view(B, T, self.num_heads, self.head_dim)
        out = self.o_proj(o.reshape(B, T, -1))
        new_state = AttentionState(cache, enc.state) if use_cache else None
        return (out, new_state, weights) if output_attentions else (out, new_state)


class ForgettingAttention(SoftmaxAttention):
    """FoX's mixer (docs/design.md §2.2): :class:`SoftmaxAttention` with its forget gate. ``options`` are the
    other keyword arguments of :class:`SoftmaxAttention`."""

    def __init__(self, hidden_size: int, num_heads: int, positional: PositionalSettings, **options: Any):
        super().__init__(hidden_size, num_heads, positional, forget_gate=True, **options)


class TransformerAttention(SoftmaxAttention):
    """The Transformer's mixer (docs/design.md §2.4): :class:`SoftmaxAttention` without a forget gate.
    ``options`` are the other keyword arguments of :class:`SoftmaxAttention`."""

    def __init__(self, hidden_size: int, num_heads: int, positional: PositionalSettings, **options: Any):
        super().__init__(hidden_size, num_heads, positional, forget_gate=False, **options)
