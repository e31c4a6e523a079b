"""Recurrent (decoding) form of the (gated) delta rule, with fla's ``fused_recurrent_*`` signatures.

Both paths step through the tokens, however many (decoding: one or a few tokens on top of a cached state, where a
chunk would be mostly padding). Where the chunked ops (:mod:`rotarium.ops.delta_rule.chunk`) suit an input better,
choosing them is the caller's: rotarium's mixers do, as fla's layers pass a ``mode``.
"""
from __future__ import annotations

import torch

from rotarium.ops.backend import FLA_KERNELS, record_backend, use_fla
from rotarium.ops.delta_rule.chunk import check_delta_rule_inputs
from rotarium.ops.l2norm import l2norm
from rotarium.ops.utils import float32_internals, run_packed


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
    if T == 0:
        return v.new_zeros(B, 0, H, v.shape[-1]), (S if output_final_state else None)
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
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,  # fla has options rotarium does not take here (use_gate_in_kernel, A_log, ...), before cu_seqlens
    cu_seqlens: torch.LongTensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, step by step: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        g: per-head log decay ``[B, T, H]`` (<= 0), None for no decay.
        gk, gv: fla's per-key and per-value log decays, in fla's positions so that a positional call written for
            fla's op binds the same arguments here; rotarium's kernels do not implement them, and refuse a tensor.
        beta: ``[B, T, H]``, None for ones (as fla).
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, backend:
            as :func:`rotarium.ops.delta_rule.chunk_gated_delta_rule`.

    Returns:
        o ``[B, T, H, V]`` with the dtype of v, and the final state ``[N, H, K, V]`` or None.
        The PyTorch path is differentiable; fla's kernel is for inference (why:
        :data:`rotarium.ops.backend.FLA_KERNELS`), so the mixers train through states with the chunked ops.
    """
    for name, gate, per in (("gk", gk, "key"), ("gv", gv, "value")):
        if gate is not None:
            raise ValueError(f"fused_recurrent_gated_delta_rule: `{name}` (fla's per-{per} log decay) is not "
                             "implemented by rotarium's kernels, which decay each head as a whole: use `g` "
                             "([B, T, H]), or rotarium.ops.fused_recurrent_gla / chunk_gla for a per-key decay "
                             "(gated linear attention, without the delta rule)")
    check_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kernel = FLA_KERNELS["fused_recurrent_gated_delta_rule"]
    if record_backend("fused_recurrent_gated_delta_rule", use_fla(backend, q, kernel.refusal(q))):
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
    kernel = FLA_KERNELS["fused_recurrent_delta_rule"]
    if record_backend("fused_recurrent_delta_rule", use_fla(backend, q, kernel.refusal(q))):
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
