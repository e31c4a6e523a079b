"""Step-by-step references for the (gated) delta rule, written from its definition (docs/design.md §2.3).

One time step at a time, in float32, the update applied literally:
``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale * S_t^T q_t``.
Slow and obviously correct: the oracle the chunked kernels are tested against.
"""
from __future__ import annotations

import torch


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g (log decay, None for none) and beta ``[B, T, H]``,
    initial_state ``[B, H, K, V]``. Returns o ``[B, T, H, V]`` (dtype of v) and the final state or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, beta = (x.float() for x in (q, k, v, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    eye = torch.eye(K, device=q.device)
    outputs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t, :, None, None]
        transition = eye - b_t * k_t[..., :, None] * k_t[..., None, :]  # [B, H, K, K]
        decay = 1.0 if g is None else g[:, t, :, None, None].float().exp()
        S = decay * (transition @ S) + b_t * k_t[..., :, None] * v_t[..., None, :]
        outputs.append(scale * (S.transpose(-1, -2) @ q[:, t, ..., None]).squeeze(-1))
    o = torch.stack(outputs, dim=1).to(dtype) if T > 0 else v.new_zeros(B, 0, H, V, dtype=dtype)
    return o, (S if output_final_state else None)


def naive_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule without decay; shapes as :func:`naive_gated_delta_rule`."""
    return naive_gated_delta_rule(q, k, v, None, beta, scale, initial_state, output_final_state)
