"""Recurrent GLA for decoding: fla's Triton kernel on CUDA, a step loop in PyTorch."""
from __future__ import annotations

import torch

from rotarium.ops.backend import FLA_KERNELS, record_backend, use_fla
from rotarium.ops.gla.chunk import check_gla_inputs
from rotarium.ops.utils import float32_internals, run_packed


@float32_internals
def _step_loop(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, initial_state: torch.Tensor | None, output_final_state: bool, reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence one token at a time on ``[B, T, H, D]`` inputs (with packing, zero padding at the end leaves
    the state unchanged, also in reverse, where it comes first)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    state = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=torch.float32), state if output_final_state else None
    # unbind, not indexing per step: the backward of T index ops would allocate T full-size gradients. The outer
    # products k_t v_t^T are formed step by step, so that a long input holds one [K, V] product at a time.
    qs = (q.float() * scale).unsqueeze(-2).unbind(1)  # T x [B, H, 1, K]
    ks = k.float()[..., :, None].unbind(1)  # T x [B, H, K, 1]
    vs = v.float()[..., None, :].unbind(1)  # T x [B, H, 1, V]
    dks = None if gk is None else gk.float().exp()[..., :, None].unbind(1)
    dvs = None if gv is None else gv.float().exp()[..., None, :].unbind(1)
    outputs = [None] * T
    for t in range(T - 1, -1, -1) if reverse else range(T):
        if dks is not None:
            state = state * dks[t]
        if dvs is not None:
            state = state * dvs[t]
        state = state + ks[t] * vs[t]
        outputs[t] = (qs[t] @ state).squeeze(-2)
    return torch.stack(outputs, dim=1), state if output_final_state else None


def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    *,  # fla has state_v_first here, before cu_seqlens
    cu_seqlens: torch.LongTensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention, token by token: ``S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T``,
    ``o_t = scale * S_t^T q_t``. Meant for decoding (one or a few tokens on a cached state).

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        gk: key-side log decay ``[B, T, H, K]`` (<= 0) or None (no decay).
        gv: value-side log decay ``[B, T, H, V]`` (<= 0) or None.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the state after the last processed token.
        reverse: run the recurrence from the last token to the first.
        cu_seqlens: int64 ``[N+1]`` cumulative lengths of sequences packed into a batch of size 1.
        backend: ``"auto"`` / ``"torch"`` / ``"fla"`` (see rotarium.ops.backend).

    Returns:
        ``o [B, T, H, V]`` (dtype of v) and the final state ``[N, H, K, V]`` (float32) or None.

    Both paths step through the tokens, however many: where the chunked kernel
    (:func:`rotarium.ops.gla.chunk_gla`) suits the input better, choosing it is the caller's (rotarium's mixers
    do, as fla's layers pass a ``mode``).
    """
    check_gla_inputs(q, k, v, {"gk": gk, "gv": gv}, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if record_backend("fused_recurrent_gla", use_fla(backend, q, FLA_KERNELS["fused_recurrent_gla"].refusal(q))):
        from fla.ops.gla import fused_recurrent_gla as fla_fused_recurrent_gla

        return fla_fused_recurrent_gla(
            q=q, k=k, v=v, gk=gk, gv=gv, scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens,
        )
    o, final_state = run_packed(
        _step_loop, cu_seqlens, {"q": q, "k": k, "v": v, "gk": gk, "gv": gv},
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, reverse=reverse,
    )
    return o.to(v.dtype), final_state
