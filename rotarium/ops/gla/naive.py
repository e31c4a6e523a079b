"""Step-by-step GLA reference: the recurrence of Yang et al., "Gated Linear Attention Transformers with
Hardware-Efficient Training" (2024; docs/design.md §2.1), one token at a time.

Slow and obviously correct; the tests use it as an oracle for the chunked and
recurrent kernels.
"""
from __future__ import annotations

import itertools

import torch


def _recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, h: torch.Tensor, reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    T = q.shape[1]
    outputs = [None] * T
    for t in range(T - 1, -1, -1) if reverse else range(T):
        if gk is not None:
            h = h * gk[:, t].exp()[..., :, None]
        if gv is not None:
            h = h * gv[:, t].exp()[..., None, :]
        h = h + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs[t] = scale * (q[:, t, :, :, None] * h).sum(-2)
    o = torch.stack(outputs, dim=1) if T > 0 else v.new_zeros(v.shape)
    return o, h


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    q, k, gk: ``[B, T, H, K]``; v, gv: ``[B, T, H, V]``; initial_state ``[N, H, K, V]``.
    ``reverse`` runs the recurrence from the last token to the first. With
    ``cu_seqlens`` (B = 1) each packed sequence runs on its own state.
    Returns ``o [B, T, H, V]`` (dtype of v) and the final state ``[N, H, K, V]`` (float32) or None.
    """
    dtype = v.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, gk, gv = (None if x is None else x.float() for x in (q, k, v, gk, gv))
    B, _, H, K = q.shape
    if cu_seqlens is None:
        h = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
        o, h = _recurrence(q, k, v, gk, gv, scale, h, reverse)
        return o.to(dtype), h if output_final_state else None
    bounds = cu_seqlens.tolist()
    outputs, finals = [], []
    for i, (bos, eos) in enumerate(itertools.pairwise(bounds)):
        h0 = None if initial_state is None else initial_state[i:i + 1]
        part = [None if x is None else x[:, bos:eos] for x in (q, k, v, gk, gv)]
        o, h = naive_recurrent_gla(*part, scale=scale, initial_state=h0, output_final_state=True, reverse=reverse)
        outputs.append(o)
        finals.append(h)
    return torch.cat(outputs, dim=1).to(dtype), torch.cat(finals) if output_final_state else None
