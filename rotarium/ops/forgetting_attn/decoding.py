"""Forgetting attention of new queries against a KV cache (generation and left-padded prefill)."""
from __future__ import annotations

import torch

from rotarium.ops.backend import use_fla
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
        backend: validated like every op's; fla has no kernel for this, so the
            PyTorch path (blockwise over Tq, matmuls) runs on every device.

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
    use_fla(backend, q)  # raises when "fla" is forced where it cannot run
    if scale is None:
        scale = K ** -0.5
    key_mask = None if attention_mask is None else attention_mask != 0
    o = block_attention(
        q, k, v, q_log_decay_cumsum, k_log_decay_cumsum, scale, q_offset=Tk - Tq, key_mask=key_mask
    )
    return o.to(v.dtype)
