"""Step-by-step references for forgetting attention, one query at a time (the test oracles).

Written straight from the definition of Lin et al., "Forgetting Transformer: Softmax Attention with a Forget Gate"
(ICLR 2025; docs/design.md §2.2): ``c = cumsum(g)`` in float32 and
``o_i = sum_{j<=i} softmax_j(scale * q_i.k_j + c_i - c_j) v_j``. Memory is O(T)
per query, so they also serve as oracles for long sequences (forward only).
"""
from __future__ import annotations

import itertools

import torch


def _attend_one(q_i: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """q_i ``[HQ, K]`` against k ``[S, H, K]``, v ``[S, H, V]``, bias ``[S, HQ]`` -> ``[HQ, V]``."""
    HQ, H = q_i.shape[0], k.shape[1]
    kv_head = torch.arange(HQ, device=q_i.device) // (HQ // H)
    if k.shape[0] == 0:
        return q_i.new_zeros(HQ, v.shape[-1])
    scores = scale * (q_i[None] * k[:, kv_head]).sum(-1)
    if bias is not None:
        scores = scores + bias
    p = torch.softmax(scores, dim=0)
    return (p[..., None] * v[:, kv_head]).sum(0)


def naive_forgetting_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q ``[B, T, HQ, K]``, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, HQ]`` or None -> o ``[B, T, HQ, V]``.

    Returns float32. With ``cu_seqlens`` (B = 1) each sequence is run on its own.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        parts = [
            naive_forgetting_attn(q[:, s:e], k[:, s:e], v[:, s:e], None if g is None else g[:, s:e], scale)
            for s, e in itertools.pairwise(bounds)
            if e > s
        ]
        return torch.cat(parts, dim=1)
    q, k, v = q.float(), k.float(), v.float()
    c = None if g is None else g.float().cumsum(1)
    B, T = q.shape[:2]
    rows = []
    for b in range(B):
        out = []
        for i in range(T):
            # c_i - c_j formed first: adding c_i to the score before subtracting c_j loses precision
            bias = None if c is None else c[b, i][None] - c[b, : i + 1]
            out.append(_attend_one(q[b, i], k[b, : i + 1], v[b, : i + 1], bias, scale))
        rows.append(torch.stack(out))
    return torch.stack(rows)


def naive_forgetting_attn_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_log_decay_cumsum: torch.Tensor | None = None,
    k_log_decay_cumsum: torch.Tensor | None = None,
    scale: float | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q ``[B, Tq, HQ, K]`` against all keys k ``[B, Tk, H, K]``, v ``[B, Tk, H, V]`` -> ``[B, Tq, HQ, V]`` float32.

    Query i sits at key position ``Tk - Tq + i``. Bias ``c_q_i - c_k_j`` from
    ``q_log_decay_cumsum [B, Tq, HQ]`` and ``k_log_decay_cumsum [B, Tk, HQ]``;
    ``attention_mask [B, Tk]`` drops keys where it is 0. No visible key: zeros.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v = q.float(), k.float(), v.float()
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    rows = []
    for b in range(B):
        out = []
        for i in range(Tq):
            pos = Tk - Tq + i
            keep = torch.arange(pos + 1, device=q.device)
            if attention_mask is not None:
                keep = keep[attention_mask[b, : pos + 1] != 0]
            bias = None
            if q_log_decay_cumsum is not None:
                cq, ck = q_log_decay_cumsum[b, i].float(), k_log_decay_cumsum[b, keep].float()
                bias = cq[None] - ck
            out.append(_attend_one(q[b, i], k[b, keep], v[b, keep], bias, scale))
        rows.append(torch.stack(out))
    return torch.stack(rows)
