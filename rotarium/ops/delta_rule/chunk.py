"""Chunked (gated) delta rule: fla's Triton kernels on CUDA, a chunkwise PyTorch implementation elsewhere.

Recurrence per head, with log decay g_t <= 0 (g = 0 for the plain delta rule), as in Yang et al., "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length" (2024) and "Gated Delta Networks: Improving Mamba2 with Delta
Rule" (2025); see docs/design.md §2.3:
``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

Chunkwise form (chunk C = 64, gamma = within-chunk cumulative sum of g, S the state entering the chunk).
Writing the step as ``S_t = exp(g_t) S_{t-1} + k_t u_t^T`` with ``u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)``
and unrolling inside the chunk gives the lower-triangular system (WY / UT transform)
``(I + A) u = diag(beta) (V - exp(gamma) K S)``, ``A_ij = beta_i k_i.k_j exp(gamma_i - gamma_j)`` for j < i, so
``u = U - W S`` with ``U = (I + A)^-1 diag(beta) V`` and ``W = (I + A)^-1 diag(beta) exp(gamma) K``. Then
``O = exp(gamma) Q S + P u`` with ``P = (Q K^T * exp(gamma_i - gamma_j))`` masked to j <= i, and
``S' = exp(gamma_C) S + (exp(gamma_C - gamma) K)^T u``.
So the sequential part is, per chunk, ``u = U - W S`` and ``S'`` from it, two products of ``[C, K] x [K, V]``'s
size; A, its inverse, U, W and P are batched over the chunks before the scan, and O over them after it. Folding W
into a transition ``G = exp(gamma_C) I - (exp(gamma_C - gamma) K)^T W`` would leave one ``[K, K] @ [K, V]`` product
per chunk, but forming G and the outputs' share of it costs about half again as many FLOPs when K = 2C.
Where every chunk decays by at most e^-BOUND, the decays move off the keys altogether: a per-head decay commutes
with the rule's transitions, so the chunk runs the plain rule on rescaled values (see :func:`_intra_chunk`).
"""
from __future__ import annotations

import warnings

import torch

from rotarium.ops.backend import (
    FLA_KERNELS,
    fla_gated_backward_refused,
    record_backend,
    requested_backend,
    use_fla,
)
from rotarium.ops.l2norm import l2norm
from rotarium.ops.opaque import opaque_to_compiler, recurrent_outputs
from rotarium.ops.utils import (
    check_cu_seqlens,
    check_dims,
    check_initial_state,
    check_log_decay,
    check_same_device,
    check_same_dtype,
    check_tensor,
    float32_internals,
    join_time_blocks,
    run_packed,
    time_blocks,
)

CHUNK_SIZE = 64
# Largest |exponent| of the factored intra-chunk decay (see _intra_chunk); e^40 is far inside float32's range.
BOUND = 40.0

def check_delta_rule_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> None:
    check_tensor("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_tensor("k", k, 4, "[B, T, H, K]")
    check_dims("k", k, (B, T, H, K), "[B, T, H, K]")
    check_tensor("v", v, 4, "[B, T, H, V]")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V]")
    check_same_dtype(q=q, k=k, v=v)
    for name, x in (("g", g), ("beta", beta)):
        if x is not None:
            check_tensor(name, x, 3, "[B, T, H]")
            check_dims(name, x, (B, T, H), "[B, T, H]")
    check_same_device("q", q, k=k, v=v, g=g, beta=beta)
    check_cu_seqlens(cu_seqlens, B, T, q.device, cu_seqlens_cpu)
    num_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    check_initial_state(initial_state, num_states, H, K, v.shape[-1], q.device)
    check_log_decay("g", g)


def fla_cannot_train_gated(backend: str | None, *tensors: torch.Tensor | None) -> bool:
    """On ``backend="auto"``, a gated call that needs gradients where fla would refuse its backward runs our
    PyTorch path (with a warning once) instead of failing mid-step; a forced ``"fla"`` keeps fla's own error."""
    if requested_backend(backend) != "auto" or not torch.is_grad_enabled():
        return False
    if not any(t is not None and t.requires_grad for t in tensors) or not fla_gated_backward_refused():
        return False
    warnings.warn(FLA_KERNELS["chunk_gated_delta_rule"].backward_refusal, stacklevel=3)
    return True


# Side of the diagonal blocks that unit_lower_inverse_ inverts with a triangular solve before doubling them.
INVERSE_BASE = 16


def _invert_unit_lower_(A: torch.Tensor) -> torch.Tensor:
    """``(I + tril(A, -1))^-1`` of a contiguous ``[N, C, C]``, written over A (only its strict lower triangle is read).

    The diagonal blocks of side INVERSE_BASE are inverted by one batched triangular solve, then inverses of
    blocks of side s are merged into blocks of side 2s, ``[[L11, 0], [L21, L22]]^-1`` having the lower-left
    block ``-L22^-1 L21 L11^-1`` (as fla's solve_tril). Each merge reads A's L21 block before writing the
    inverse's block in its place, and no earlier step wrote there, so A's memory holds the result (see
    :mod:`rotarium.ops` on allocation). Doubling replaces batched LAPACK triangular solves of whole chunks, which are
    slower on CPU than this inverse and the matmul applying it; benchmarks/ops.py times the op.
    """
    N, C, _ = A.shape
    base = INVERSE_BASE if C % INVERSE_BASE == 0 and (C // INVERSE_BASE) & (C // INVERSE_BASE - 1) == 0 else C

    def diagonal_blocks(side: int) -> torch.Tensor:
        """The diagonal ``[side, side]`` blocks of A, as a view ``[N, side, side, C / side]``."""
        return A.view(N, C // side, side, C // side, side).diagonal(dim1=1, dim2=3)

    blocks = diagonal_blocks(base).permute(0, 3, 1, 2)
    eye = torch.eye(base, dtype=A.dtype, device=A.device).expand(blocks.shape)
    blocks.copy_(torch.linalg.solve_triangular(blocks, eye, upper=False, unitriangular=True))
    side = base
    while side < C:
        pairs = diagonal_blocks(2 * side)
        lower = pairs[:, side:, :side].permute(0, 3, 1, 2)
        first, second = (pairs[:, rows, rows].permute(0, 3, 1, 2) for rows in (slice(None, side), slice(side, None)))
        lower.copy_((second @ lower @ first).neg_())
        pairs[:, :side, side:] = 0.0  # A's entries above the diagonal, before the merged block is used as an inverse
        side *= 2
    return A


class _UnitLowerInverse(torch.autograd.Function):
    """``T = (I + tril(A, -1))^-1`` with ``dA = -T^T dT T^T`` on the strict lower triangle (zero elsewhere).

    Overwrites A (a fresh matmul result that nothing else reads) with T.
    """

    @staticmethod
    def forward(ctx, A: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(A)
        _invert_unit_lower_(A.view(-1, *A.shape[-2:]))
        ctx.save_for_backward(A)
        return A

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (inverse,) = ctx.saved_tensors
        transposed = inverse.transpose(-1, -2)
        return (transposed @ grad @ transposed).neg_().tril_(-1)


def unit_lower_inverse_(A: torch.Tensor) -> torch.Tensor:
    """``(I + tril(A, -1))^-1`` for ``A`` ``[..., C, C]``, in A's memory when contiguous (the strict lower triangle
    is all that is read)."""
    return _UnitLowerInverse.apply(A.contiguous())


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor | None, beta: torch.Tensor, scale: float
) -> tuple[torch.Tensor, ...]:
    """Everything that does not depend on the state, batched over chunks ``[m, B*H, C, D]``.

    Returns ``(q_in, P, U, W, k_out, decay, state_diagonal)``: q_in ``[m, BH, C, K]``, P ``[m, BH, C, C]``,
    U ``[m, BH, C, V]``, W ``[m, BH, C, K]``, k_out ``[m, BH, C, K]``, and ``decay`` and ``state_diagonal``
    ``[m, BH, 1, 1]`` or None (1). With ``S_hat = decay * S``, the chunk's corrected values are
    ``u = U - W S_hat``, its outputs ``O = q_in S_hat + P u`` (scaled: q_in and P carry ``scale``, which costs
    nothing where q is multiplied anyway and spares the scaled products' backward a multiply each) and the next
    state ``S' = state_diagonal S_hat + k_out^T u``.
    """
    decay, state_diagonal = None, None
    if gamma is None or bool(gamma[..., -1].amin() >= -BOUND):  # no decay, or every chunk's is at most e^-BOUND
        k_beta = k * beta
        A = k_beta @ k.transpose(-1, -2)
        k_out = k
        if gamma is None:
            q_in, v_beta = q * scale, v * beta
        else:
            # A per-head decay is a scalar, so it commutes with every (I - beta k k^T): inside a chunk the gated
            # rule is the plain one run on exp(gamma_C - gamma) v (factors <= 1), each output raised by
            # exp(gamma_i - gamma_C) >= 1 (on q, so that it reaches the state's share of the output too), and the
            # state entering the chunk lowered by exp(gamma_C). A and W stay the plain rule's: one scaled [C, K]
            # copy (q's) where decays on the keys took three, and their backward.
            last = gamma[..., -1:]
            q_in = q * ((gamma - last).exp() * scale)[..., None]
            v_beta = v * (beta * (last - gamma).exp()[..., None])
            decay = last.exp()[..., None]
        P = (q_in @ k.transpose(-1, -2)).tril_()
        w_rhs = k_beta
    else:  # some chunk decays by more: exp only of non-positive differences, masked first
        decay_in = gamma.exp()[..., None]  # exp(gamma_i): decay from the chunk start to i
        C = q.shape[-2]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decays = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        A = ((k * beta) @ k.transpose(-1, -2)) * decays
        q_in = q * (decay_in * scale)
        P = ((q * scale) @ k.transpose(-1, -2)) * decays
        v_beta, w_rhs = v * beta, k * (beta * decay_in)
        k_out = k * (gamma[..., -1:, None] - gamma[..., None]).exp()  # exp(gamma_C - gamma_j): j to the chunk end
        state_diagonal = decay_in[..., -1:, :]  # exp(gamma_C)
    inverse = unit_lower_inverse_(A)
    U, W = inverse @ v_beta, inverse @ w_rhs
    return q_in, P, U, W, k_out, decay, state_diagonal


def _chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunkwise algorithm of the module docstring on float32 ``[B, T, H, D]`` inputs (g None: no decay)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = None if initial_state is None else initial_state.float().reshape(B * H, K, V)
    outputs, chunks_left = [], -(-T // CHUNK_SIZE)
    for q_b, k_b, v_b, beta_b, g_b in time_blocks(CHUNK_SIZE, q, k, v, beta, g):
        gamma_b = None if g_b is None else g_b.cumsum(-1)  # within-chunk cumulative log decay, <= 0
        q_in, P, U, W, k_out, decay, state_diagonal = _intra_chunk(q_b, k_b, v_b, gamma_b, beta_b[..., None], scale)
        decays, diagonals = ([None] * U.shape[0] if x is None else x.unbind(0) for x in (decay, state_diagonal))
        states, corrected = [], []
        # unbind and stack, not indexing: linear-cost backward, as with the blocks
        for U_c, W_c, k_c, decay_c, diagonal_c in zip(U.unbind(0), W.unbind(0), k_out.unbind(0), decays, diagonals):
            if S is None:
                states.append(q.new_zeros(B * H, K, V))
                u = U_c
            else:
                if decay_c is not None:
                    S = S * decay_c
                states.append(S)
                u = torch.baddbmm(U_c, W_c, S, alpha=-1.0)
            corrected.append(u)
            chunks_left -= 1
            if chunks_left == 0 and not output_final_state:
                break  # nothing reads the state after the last chunk
            carried = S if S is None or diagonal_c is None else S * diagonal_c
            S = k_c.transpose(-1, -2) @ u if carried is None else torch.baddbmm(carried, k_c.transpose(-1, -2), u)
        u_all = torch.stack(corrected)
        S_in = torch.stack(states)  # the (decayed) state entering each chunk
        o = (P @ u_all).flatten(0, 1).baddbmm_(q_in.flatten(0, 1), S_in.flatten(0, 1))
        outputs.append(o.view_as(u_all))
    o = join_time_blocks(outputs, B, T)
    return o, (S.view(B, H, K, V) if output_final_state else None)


@float32_internals
def chunk_gated_delta_rule_torch(
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
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch path of every delta-rule op (validated inputs; g None means no decay).

    Shapes and arguments as :func:`chunk_gated_delta_rule`.
    """
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    o, final_state = run_packed(
        _chunk_gated_delta_rule_fwd,
        cu_seqlens,
        {"q": q, "k": k, "v": v.float(), "g": None if g is None else g.float(), "beta": beta.float()},
        cu_seqlens_cpu,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o.to(v.dtype), final_state


@opaque_to_compiler(recurrent_outputs)
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,  # fla has options rotarium does not take here (use_beta_sigmoid_in_kernel, ...), before cu_seqlens
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        g: per-head log decay ``[B, T, H]``, <= 0.
        beta: ``[B, T, H]``, usually in (0, 1).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: return the final state ``[N, H, K, V]`` (float32).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head inside the op.
        cu_seqlens: int64 ``[N + 1]`` for packed inputs with B = 1.
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (fla's argument): with it neither path reads ``cu_seqlens``
            from the device, which on CUDA would synchronise.
        backend: ``"auto"``, ``"torch"`` or ``"fla"`` (see :mod:`rotarium.ops.backend`).

    Returns:
        o ``[B, T, H, V]`` with the dtype of v, and the final state or None.
    """
    if g is None:
        raise ValueError("`g` (the log decay [B, T, H]) is required; use chunk_delta_rule for no decay")
    if beta is None:
        raise ValueError("`beta` ([B, T, H]) is required")
    check_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    to_fla = use_fla(backend, q, FLA_KERNELS["chunk_gated_delta_rule"].refusal(q))
    if record_backend("chunk_gated_delta_rule", to_fla and not fla_cannot_train_gated(backend, q, k, v, g, beta,
                                                                                 initial_state)):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

        return fla_chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        )
    return chunk_gated_delta_rule_torch(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
        cu_seqlens_cpu,
    )


@opaque_to_compiler(recurrent_outputs)
def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    Shapes and arguments as :func:`chunk_gated_delta_rule`, without ``g``.
    """
    if beta is None:
        raise ValueError("`beta` ([B, T, H]) is required")
    check_delta_rule_inputs(q, k, v, None, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if record_backend("chunk_delta_rule", use_fla(backend, q, FLA_KERNELS["chunk_delta_rule"].refusal(q))):
        from fla.ops.delta_rule import chunk_delta_rule as fla_chunk_delta_rule

        return fla_chunk_delta_rule(
            q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        )
    return chunk_gated_delta_rule_torch(
        q, k, v, None, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
        cu_seqlens_cpu,
    )
