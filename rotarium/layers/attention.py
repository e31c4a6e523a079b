"""Softmax attention mixers: the Transformer's attention and FoX's forgetting attention, one module with a
named subclass for each family (:class:`TransformerAttention`, :class:`ForgettingAttention`).

FoX (Lin et al., ICLR 2025) is causal softmax attention with a per-head forget gate, ``logits + c_i - c_j`` with
``c = cumsum(log f)``; the Transformer is the same without the gate (Selective RoPE gives it one, on by default).
Both run on :func:`rotarium.ops.parallel_forgetting_attn`, and on
:func:`rotarium.ops.forgetting_attn_with_cache` when there are cached keys or padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rotarium.layers.norm import HeadRMSNorm, RMSNorm
from rotarium.layers.positional import MixerSpec, PositionalSettings, build_positional
from rotarium.layers.sequence import SequenceInfo
from rotarium.ops import forgetting_attn_with_cache, parallel_forgetting_attn
from rotarium.ops.cumsum import segment_cumsum
from rotarium.ops.forgetting_attn import eager_forgetting_attn
from rotarium.utils.deprecation import warn_renamed


class SoftmaxAttention(nn.Module):
    """Causal softmax attention with grouped-query heads, an optional FoX forget gate, QK-norm and output gate.

    The QK-norm is an RMSNorm over each head's features, with one weight shared by all heads (Llama-style models,
    fla's Transformer) or, with ``qk_norm_per_head``, a weight per head (fla's Forgetting Transformer, the FoX
    paper's "Pro" models); ``qk_norm_eps`` (default ``norm_eps``) matches the epsilon of the model converted.

    The layer's decoding state is a :class:`KVCache` (``state["kv"]``) of the rotated keys and values (RoVE's values
    are stored rotated), with the positional layer's state beside it (``state["positional"]``).
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

    def forward(self, hidden_states: torch.Tensor, seq: SequenceInfo, state: dict | None = None,
                use_cache: bool = False, output_attentions: bool = False) -> tuple:
        """hidden_states ``[B, T, d]`` -> ``([B, T, d], the layer's new cache state when use_cache)``, and with
        ``output_attentions`` the attention probabilities ``[B, H, T, past + T]`` after them, from the eager path
        (:func:`rotarium.ops.forgetting_attn.eager_forgetting_attn`) that also computes the output."""
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

        cache: KVCache | None = state.get("kv")
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
        new_state = {"kv": cache, "positional": enc.state} if use_cache else None
        return (out, new_state, weights) if output_attentions else (out, new_state)


    @property
    def output_gate(self) -> bool:  # the earlier name, kept with a warning (docs/design.md §6)
        warn_renamed("output_gate", "sigmoid_output_gate")
        return self.sigmoid_output_gate


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


@dataclass(eq=False)
class _Buffers:
    """Storage shared by the states of one decoding chain: time-major ``[capacity, B, ...]`` tensors, of which the
    first ``filled`` positions hold data."""

    keys: torch.Tensor
    values: torch.Tensor
    log_decay_cumsum: torch.Tensor | None
    key_mask: torch.Tensor | None
    filled: int

    @property
    def capacity(self) -> int:
        return self.keys.shape[0]

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.keys, self.values, self.log_decay_cumsum, self.key_mask


class KVCache:
    """The KV cache of a softmax mixer: the keys and values (as the positional layer left them), the cumulative log
    decay of every position and, once some padding was seen, the padding mask, for ``length`` positions.

    Decoding appends one token at a time. The buffers keep room beyond ``length`` and write new tokens in place;
    when they run out, the capacity doubles, so that n tokens cost O(n) copying in all rather than a copy of the
    whole cache per token. The buffers are time-major (``[capacity, B, ...]``), so the filled part is one
    contiguous block: fla's decoding kernel reads it where it lies (:func:`rotarium.ops.forgetting_attn_with_cache`
    folds the batch into its heads). ``keys``, ``values``, ``log_decay_cumsum`` and ``key_mask`` are views
    ``[B, length, ...]``. Whether any padding was seen is a Python fact (``key_mask`` is None until then), so
    choosing the unpadded path never reads the device.

    A state stays valid after it was continued: an append writes in place only into positions no state holds yet,
    and copies when another state was already appended to the same buffers (two continuations of one prefix) or
    when autograd records the step (it keeps the earlier views for the backward pass, and writing into their
    storage would invalidate them).
    """

    def __init__(self, buffers: _Buffers, length: int):
        self._buffers, self.length = buffers, length

    @classmethod
    def start(cls, k: torch.Tensor, v: torch.Tensor, log_decay_cumsum: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> KVCache:
        """The cache of a first chunk ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``log_decay_cumsum [B, T, HQ]``, ``mask
        [B, T]`` (None: no padding); it holds the tensors as given, without room to grow until the first append."""
        tensors = (k, v, log_decay_cumsum, mask)
        t_major = [None if t is None else t.transpose(0, 1) for t in tensors]
        return cls(_Buffers(*t_major, filled=k.shape[1]), k.shape[1])

    @property
    def batch_size(self) -> int:
        return self._buffers.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self._buffers.capacity

    def _view(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:self.length].transpose(0, 1)

    @property
    def keys(self) -> torch.Tensor:
        return self._view(self._buffers.keys)

    @property
    def values(self) -> torch.Tensor:
        return self._view(self._buffers.values)

    @property
    def log_decay_cumsum(self) -> torch.Tensor | None:
        return self._view(self._buffers.log_decay_cumsum)

    @property
    def key_mask(self) -> torch.Tensor | None:
        """``[B, length]`` bool, True for real tokens; None when no padding was ever seen."""
        return self._view(self._buffers.key_mask)

    def append(self, k: torch.Tensor, v: torch.Tensor, log_decay_cumsum: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> KVCache:
        """This cache followed by T more positions (shapes as in :meth:`start`); ``self`` stays valid."""
        old, new = self._buffers, (k, v, log_decay_cumsum, mask)
        if (log_decay_cumsum is None) != (old.log_decay_cumsum is None):
            raise ValueError("`log_decay_cumsum` must be given at every step or at none")
        length = self.length + k.shape[1]
        records_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (*new, *old.tensors()))
        # (an inference-mode tensor cannot be written outside inference mode)
        in_place = (old.filled == self.length and length <= old.capacity and not records_grad
                    and all(t is None or t.is_contiguous() for t in old.tensors())
                    and (torch.is_inference_mode_enabled() or not old.keys.is_inference()))
        if in_place:
            buffers = old
        else:
            # autograd keeps no spare room: it could not be written in place later
            capacity = length if records_grad else max(length, 2 * old.capacity)
            buffers = _Buffers(*[None if t is None else _grown(t, self.length, capacity) for t in old.tensors()],
                               filled=self.length)
        if mask is not None and buffers.key_mask is None:
            buffers.key_mask = torch.ones(buffers.capacity, self.batch_size, dtype=torch.bool, device=k.device)
        for buffer, t in zip(buffers.tensors(), new):
            if buffer is not None:
                buffer[self.length:length] = True if t is None else t.transpose(0, 1)
        buffers.filled = length
        return KVCache(buffers, length)

    def release_later_positions(self) -> None:
        """Lets the next append write in place after this state's positions: for a state taken back by a rollback
        (``RotariumCacheLayer.crop``), whose later positions only the dropped states held."""
        self._buffers.filled = self.length

    def select_rows(self, index: torch.Tensor) -> KVCache:
        """The cache of the batch rows ``index`` (int64 ``[B']``, repeats allowed): beam reordering, expansion and
        selection. The spare room is kept, so decoding goes on in place."""
        index = index.to(self._buffers.keys.device)
        buffers = _Buffers(*[None if t is None else t.index_select(1, index) for t in self._buffers.tensors()],
                           filled=self.length)
        return KVCache(buffers, self.length)


def _grown(buffer: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """A contiguous ``[capacity, ...]`` copy of ``buffer``'s first ``length`` positions; the rest is unset."""
    grown = buffer.new_empty(capacity, *buffer.shape[1:])
    grown[:length] = buffer[:length]
    return grown
