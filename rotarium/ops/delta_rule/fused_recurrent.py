"""Recurrent (decoding) form of the (gated) delta rule, with fla's ``fused_recurrent_*`` signatures.

The PyTorch path steps through time for inputs of at most MAX_STEPS tokens (decoding: one or a few tokens on top of a
cached state), where a chunk would be mostly padding, and hands longer inputs to the chunked implementation, which
computes the same recurrence.
"""
from __future__ import annotations

import torch

from rotarium.ops.backend import dispatch, use_fla
from rotarium.ops.delta_rule.chunk import check_delta_rule_inputs, chunk_gated_delta_rule_torch
from rotarium.ops.l2norm import l2norm
from rotarium.ops.utils import MAX_STEPS, float32_internals, run_packed


def _recurrent_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 ``[B, T, H, D]`` inputs; ``S <- exp(g) S``, ``u = beta (v - S^T k)``, ``S <- S + k u^T``."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    decays = [None] * T if g is None else g.exp()[..., None, None].unbind(1)
    outputs = []
    for q_t, k_t, v_t, b_t, a_t in zip(q.unbind(1), k.unbind(1), v.unbind(1), beta.unbind(1), decays):
        if a_t is not None:
            S = S * a_t
        u = b_t[..., None] * (v_t - (k_t[..., None, :] @ S).squeeze(-2))
        S = S + k_t[..., :, None] * u[..., None, :]
        outputs.append((q_t[..., None, :] @ S).squeeze(-2))
    o = torch.stack(outputs, 1) * scale
    return o, (S if output_final_state else None)


@float32_internals
def _fused_recurrent_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if q.shape[1] > MAX_STEPS or q.shape[1] == 0:
        return chunk_gated_delta_rule_torch(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
        )
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    o, final_state = run_packed(
        _recurrent_fwd,
        cu_seqlens,
        {"q": q, "k": k, "v": v.float(), "g": None if g is None else g.float(), "beta": beta.float()},
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o.to(v.dtype), final_state


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, step by step: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        g: per-head log decay ``[B, T, H]`` (<= 0), None for no decay.
        beta: ``[B, T, H]``, None for ones (as fla).
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, backend:
            as :func:`rotarium.ops.delta_rule.chunk_gated_delta_rule`.

    Returns:
        o ``[B, T, H, V]`` with the dtype of v, and the final state ``[N, H, K, V]`` or None.
        For inference on fla: its gated kernel raises in backward, and its plain kernel's backward needs an initial
        state that requires a gradient, so the mixers train through states with the chunked ops instead. The
        PyTorch path is differentiable.
    """
    check_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if dispatch("fused_recurrent_gated_delta_rule", use_fla(backend, q)):
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_recurrent

        return fla_fused_recurrent(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )
    if beta is None:
        beta = q.new_ones(q.shape[:3])
    return _fused_recurrent_torch(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule, step by step: ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.

    Shapes and arguments as :func:`fused_recurrent_gated_delta_rule`, without ``g``.
    """
    check_delta_rule_inputs(q, k, v, None, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if dispatch("fused_recurrent_delta_rule", use_fla(backend, q)):
        from fla.ops.delta_rule import fused_recurrent_delta_rule as fla_fused_recurrent

        return fla_fused_recurrent(
            q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )
    if beta is None:
        beta = q.new_ones(q.shape[:3])
    return _fused_recurrent_torch(
        q, k, v, None, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )
