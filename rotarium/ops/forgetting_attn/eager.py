"""Forgetting attention with its probabilities materialised: the path of ``output_attentions=True``.

transformers' softmax models return their attention weights from an "eager" path that forms the ``[Tq, Tk]``
probabilities and multiplies them with the values; this is rotarium's, for FoX and the Transformer alike (with
``g = None``). Memory is quadratic in the length, so only the models' ``output_attentions`` takes it.
"""
from __future__ import annotations

import torch

from rotarium.ops.forgetting_attn.parallel import check_heads
from rotarium.ops.utils import check_dims, check_tensor


def eager_forgetting_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_log_decay_cumsum: torch.Tensor | None = None,
    k_log_decay_cumsum: torch.Tensor | None = None,
    scale: float | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last Tq positions of a sequence attending to its Tk keys, ``softmax_j(scale * q_i.k_j + c_q_i - c_k_j)``
    over the keys up to the query's position (query i sits at key position ``Tk - Tq + i``).

    Args:
        q: ``[B, Tq, HQ, K]``; k: ``[B, Tk, H, K]``, Tk >= Tq, HQ a multiple of H; v: ``[B, Tk, H, V]``.
        q_log_decay_cumsum: ``[B, Tq, HQ]`` cumulative log decay at each query; k_log_decay_cumsum:
            ``[B, Tk, HQ]`` at each key (both or neither).
        scale: score scale, default ``K ** -0.5``.
        attention_mask: ``[B, Tk]``, 0 for padded keys, which get no weight.
        cu_seqlens: int ``[N + 1]`` boundaries of documents packed into a batch of size 1 (Tq = Tk): no query sees
            a key of another document.

    Returns:
        o ``[B, Tq, HQ, V]`` in the dtype of ``v``, and the probabilities ``[B, HQ, Tq, Tk]`` float32 (a query
        without a visible key: zeros, and a zero output).
    """
    check_tensor("q", q, 4, "[B, Tq, HQ, K]")
    check_tensor("k", k, 4, "[B, Tk, H, K]")
    check_tensor("v", v, 4, "[B, Tk, H, V]")
    B, Tq, HQ, K = q.shape
    Tk, H = k.shape[1], k.shape[2]
    check_dims("k", k, (B, None, None, K), "[B, Tk, H, K]")
    check_dims("v", v, (B, Tk, H, None), "[B, Tk, H, V]")
    check_heads(q, k)
    if Tk < Tq:
        raise ValueError(f"`k` holds {Tk} positions but `q` has {Tq}: the keys must include the queries' own")
    if (q_log_decay_cumsum is None) != (k_log_decay_cumsum is None):
        raise ValueError("give both `q_log_decay_cumsum` and `k_log_decay_cumsum`, or neither")
    if cu_seqlens is not None and (B != 1 or Tq != Tk):
        raise ValueError(f"`cu_seqlens` needs one packed row of queries and keys alike, got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    scale = K ** -0.5 if scale is None else scale
    group = HQ // H
    keys = k.float().repeat_interleave(group, 2)
    scores = scale * torch.einsum("bqhd,bkhd->bhqk", q.float(), keys)
    if q_log_decay_cumsum is not None:
        scores = scores + (q_log_decay_cumsum.float().transpose(1, 2)[..., :, None]
                           - k_log_decay_cumsum.float().transpose(1, 2)[..., None, :])
    query_at = torch.arange(Tk - Tq, Tk, device=q.device)
    key_at = torch.arange(Tk, device=q.device)
    visible = (key_at[None, :] <= query_at[:, None])[None, None]  # [1, 1, Tq, Tk]
    if cu_seqlens is not None:
        document = torch.bucketize(key_at, cu_seqlens[1:].to(q.device), right=True)
        visible = visible & (document[:, None] == document[None, :])
    if attention_mask is not None:
        visible = visible & attention_mask.to(q.device, torch.bool)[:, None, None, :]
    # a query without a visible key (left padding) gets zeros, not the NaN of a softmax over nothing
    blind = ~visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(blind, 0.0)
    weights = torch.softmax(scores, dim=-1).masked_fill(blind, 0.0)
    values = v.float().repeat_interleave(group, 2)
    o = torch.einsum("bhqk,bkhd->bqhd", weights, values)
    return o.to(v.dtype), weights
