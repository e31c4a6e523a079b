"""Forgetting attention of new queries against a KV cache (generation and left-padded prefill).

On CUDA, one-token steps run fla's decoding kernel (``fla.ops.attn.decoding.attn_decoding_one_step``). Otherwise,
steps without gradients or padding run PyTorch's fused attention kernel on the cache where it lies (bf16 ones on a
float32 copy on a CPU or with a gate), and everything else runs the blockwise PyTorch path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rotarium.ops.backend import FLA_KERNELS, record_backend, use_fla
from rotarium.ops.forgetting_attn.parallel import block_attention, check_heads
from rotarium.ops.utils import check_dims, check_same_device, check_same_dtype, check_tensor


def forgetting_attn_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_log_decay_cumsum: torch.Tensor | None = None,
    k_log_decay_cumsum: torch.Tensor | None = None,
    scale: float | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """The last Tq positions of a sequence attending to all of its Tk cached keys.

    Query i sits at key position ``Tk - Tq + i`` and sees the keys up to there, with
    score ``scale * q_i.k_j + c_q_i - c_k_j``. The cache holds cumulative log decays
    ``c`` (not the gates), so a token's bias needs no pass over the prefix.

    Args:
        q: new queries ``[B, Tq, HQ, K]``.
        k: all keys ``[B, Tk, H, K]``, Tk >= Tq, HQ a multiple of H.
        v: all values ``[B, Tk, H, V]``.
        q_log_decay_cumsum: ``[B, Tq, HQ]`` cumulative log decay at each query.
        k_log_decay_cumsum: ``[B, Tk, HQ]`` cumulative log decay at each key (both or neither).
        scale: score scale, default ``K ** -0.5``.
        attention_mask: ``[B, Tk]``, 1 for real tokens, 0 for padding (left-padded
            batches); padded keys get no weight, and a query without a visible key
            gives zeros.
        backend: ``"auto"``, ``"torch"`` or ``"fla"`` (see :mod:`rotarium.ops.backend`).
            fla's kernel serves the calls its row of
            :data:`rotarium.ops.backend.FLA_KERNELS` allows (one query per row, Tq = 1,
            without gradients); other calls run the PyTorch path (blockwise over Tq,
            matmuls) on every backend.

    fla's kernel computes the same function with other inputs. It takes packed
    sequences with one query at the end of each, and log gates whose cumulative sums
    it forms itself, measuring the query's from the last key. So the fla path hands
    it the differences of ``k_log_decay_cumsum`` as gates, and needs no
    ``q_log_decay_cumsum``: a bias shared by all of a query's scores leaves its
    softmax unchanged. The cumulative sums are thus formed twice, in float32, which
    rounds the scores slightly differently from the PyTorch path. fla's kernel has no
    padding mask: each row's real keys are gathered to the front of the row (in
    order, a copy of the cache) and its padded keys become a sequence of their own,
    whose output is dropped. Unpadded keys laid out time-major (``k.transpose(0, 1)``
    contiguous, as :class:`rotarium.layers.state.KVCache` keeps them) are read
    where they lie, the batch folded into the heads.

    Returns:
        o ``[B, Tq, HQ, V]`` in the dtype of ``v``.
    """
    check_tensor("q", q, 4, "[B, Tq, HQ, K]")
    check_tensor("k", k, 4, "[B, Tk, H, K]")
    check_tensor("v", v, 4, "[B, Tk, H, V]")
    B, Tq, HQ, K = q.shape
    Tk = k.shape[1]
    check_dims("k", k, (B, None, None, K), "[B, Tk, H, K]")
    check_dims("v", v, (B, Tk, k.shape[2], None), "[B, Tk, H, V]")
    if Tk < Tq:
        raise ValueError(f"`k` holds {Tk} positions but `q` has {Tq}: the cache must include the new tokens")
    check_heads(q, k)
    if (q_log_decay_cumsum is None) != (k_log_decay_cumsum is None):
        raise ValueError("give both `q_log_decay_cumsum` and `k_log_decay_cumsum`, or neither")
    if q_log_decay_cumsum is not None:
        check_tensor("q_log_decay_cumsum", q_log_decay_cumsum, 3, "[B, Tq, HQ]")
        check_dims("q_log_decay_cumsum", q_log_decay_cumsum, (B, Tq, HQ), "[B, Tq, HQ]")
        check_tensor("k_log_decay_cumsum", k_log_decay_cumsum, 3, "[B, Tk, HQ]")
        check_dims("k_log_decay_cumsum", k_log_decay_cumsum, (B, Tk, HQ), "[B, Tk, HQ]")
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, Tk)
    ):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        raise ValueError(f"`attention_mask` must have shape [B, Tk] = {(B, Tk)}, got {shape}")
    check_same_device(
        "q", q, k=k, v=v, q_log_decay_cumsum=q_log_decay_cumsum, k_log_decay_cumsum=k_log_decay_cumsum,
        attention_mask=attention_mask,
    )
    check_same_dtype(q=q, k=k, v=v)
    kernel = FLA_KERNELS["attn_decoding_one_step"]
    to_fla = use_fla(backend, q, kernel.refusal(q))
    if scale is None:
        scale = K ** -0.5
    key_mask = None if attention_mask is None else attention_mask != 0
    records_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, q_log_decay_cumsum, k_log_decay_cumsum))
    if record_backend("forgetting_attn_with_cache", to_fla and kernel.serves(Tq, records_grad)):
        return _fla_decoding(q, k, v, k_log_decay_cumsum, scale, key_mask)
    if key_mask is None and not records_grad:
        # bf16 runs the fused kernel on a float32 copy on a CPU, whose kernel handles a few bf16 queries against many
        # keys slower than float32 ones, and wherever a gate's bias c_q - c_k (as large as the decay over the whole
        # cache) would be rounded to bf16, by more than a score's own rounding. The copy keeps the cache's layout.
        native = q.device.type != "cpu" and q_log_decay_cumsum is None
        compute = q.dtype if native else torch.promote_types(q.dtype, torch.float32)
        o = _fused_steps(q.to(compute), k.to(compute), v.to(compute), q_log_decay_cumsum, k_log_decay_cumsum, scale)
    else:
        o = block_attention(
            q, k, v, q_log_decay_cumsum, k_log_decay_cumsum, scale, q_offset=Tk - Tq, key_mask=key_mask
        )
    return o.to(v.dtype)


def _fused_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cumsum: torch.Tensor | None,
                 k_cumsum: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The validated call of :func:`forgetting_attn_with_cache` without padding or gradients, through PyTorch's
    fused attention kernel, which reads the keys and values through their strides: a cache laid out time-major is
    read where it lies, where the blocks would first copy all of it into their own layout at every step. The query
    heads sharing a key head (GQA) become more queries of that head, rather than copies of its keys and values.
    The gate's bias ``c_q - c_k`` (and, for several queries, the causal offset) enters as the kernel's additive
    mask."""
    B, Tq, HQ, K = q.shape
    Tk, H = k.shape[1], k.shape[2]
    G = HQ // H
    queries = q.reshape(B, Tq, H, G, K).permute(0, 2, 3, 1, 4).reshape(B, H, G * Tq, K)
    mask = None
    if q_cumsum is not None:  # [B, HQ, Tq, Tk] -> [B, H, G * Tq, Tk], as the queries
        mask = q_cumsum.float().transpose(1, 2)[..., None] - k_cumsum.float().transpose(1, 2)[:, :, None, :]
        mask = mask.reshape(B, H, G * Tq, Tk)
    if Tq > 1:  # query i sits at key position Tk - Tq + i
        positions = torch.arange(Tk, device=q.device)
        visible = (positions[None, :] <= positions[Tk - Tq:, None]).repeat(G, 1)
        mask = visible if mask is None else mask.masked_fill(~visible, float("-inf"))
    o = F.scaled_dot_product_attention(queries, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.reshape(B, H, G, Tq, -1).permute(0, 3, 1, 2, 4).reshape(B, Tq, HQ, -1)


def _fla_decoding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cumsum: torch.Tensor | None, scale: float,
                  key_mask: torch.Tensor | None) -> torch.Tensor:
    """fla's one-step decoding for validated inputs with Tq = 1 (see :func:`forgetting_attn_with_cache`)."""
    from fla.ops.attn.decoding import attn_decoding_one_step

    B, Tk, H, K = k.shape
    HQ, V = q.shape[2], v.shape[-1]
    if key_mask is None and all(t is None or t.transpose(0, 1).is_contiguous() for t in (k, v, k_cumsum)):
        # One sequence whose heads are the B * H (row, head) pairs: head b * H + h has query heads
        # b * HQ + h * G ... b * HQ + (h + 1) * G - 1, fla's grouping.
        o = attn_decoding_one_step(
            q.reshape(1, 1, B * HQ, K), _fold(k), _fold(v), g=None if k_cumsum is None else _gates(_fold(k_cumsum)),
            scale=scale, cu_seqlens=torch.arange(2, device=q.device) * Tk)
        return o.view(B, 1, HQ, V)
    starts = torch.arange(B, device=q.device) * Tk
    if key_mask is None:
        bounds, queries = torch.cat([starts, starts[-1:] + Tk]), q
    else:
        # Real keys first, in order; row b becomes the sequences [b Tk, b Tk + n_b) and [b Tk + n_b, (b + 1) Tk).
        order = torch.sort(key_mask.to(torch.uint8), dim=1, descending=True, stable=True).indices
        k, v = (t.gather(1, order[:, :, None, None].expand_as(t)) for t in (k, v))
        if k_cumsum is not None:
            k_cumsum = k_cumsum.gather(1, order[:, :, None].expand_as(k_cumsum))
        real = starts + key_mask.sum(1)
        bounds = torch.cat([torch.stack([starts, real], 1).flatten(), starts[-1:] + Tk])
        queries = q.repeat_interleave(2, dim=0)  # the padding sequences get a query too; their outputs are dropped
    gates = None if k_cumsum is None else _gates(k_cumsum.contiguous()).reshape(1, B * Tk, HQ)
    o = attn_decoding_one_step(queries.reshape(1, -1, HQ, K), k.reshape(1, B * Tk, H, K),
                               v.reshape(1, B * Tk, H, V), g=gates, scale=scale, cu_seqlens=bounds)
    o = o.view(-1, 1, HQ, V)
    return o if key_mask is None else o[0::2]


def _fold(t: torch.Tensor) -> torch.Tensor:
    """A time-major ``[B, T, H, ...]`` tensor as ``[1, T, B * H, ...]``, without a copy."""
    return t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


def _gates(cumsum: torch.Tensor) -> torch.Tensor:
    """Log gates ``[N, T, H]`` whose cumulative sums along T are ``cumsum`` (each sequence's first gate is its
    first cumulative value)."""
    return torch.cat([cumsum[:, :1], cumsum[:, 1:] - cumsum[:, :-1]], dim=1)
