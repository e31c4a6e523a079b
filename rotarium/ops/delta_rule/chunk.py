"""Chunked (gated) delta rule: fla's Triton kernels on CUDA, a chunkwise PyTorch implementation elsewhere.

Recurrence (SPEC 2.3), per head, with log decay g_t <= 0 (g = 0 for the plain delta rule):
``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

Chunkwise form (chunk C = 64, gamma = within-chunk cumulative sum of g, S the state entering the chunk).
Writing the step as ``S_t = exp(g_t) S_{t-1} + k_t u_t^T`` with ``u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)``
and unrolling inside the chunk gives the lower-triangular system (WY / UT transform)
``(I + A) u = diag(beta) (V - exp(gamma) K S)``, ``A_ij = beta_i k_i.k_j exp(gamma_i - gamma_j)`` for j < i, so
``u = U - W S`` with ``U = (I + A)^-1 diag(beta) V`` and ``W = (I + A)^-1 diag(beta) exp(gamma) K``. Then
``O = exp(gamma) Q S + P u`` with ``P = (Q K^T * exp(gamma_i - gamma_j))`` masked to j <= i, and
``S' = exp(gamma_C) S + (exp(gamma_C - gamma) K)^T u``.
Substituting u, everything but S is known before the scan:
``O = Q' S + P U`` with ``Q' = exp(gamma) Q - P W``, and ``S' = G S + N`` with
``G = exp(gamma_C) I - (exp(gamma_C - gamma) K)^T W``, ``N = (exp(gamma_C - gamma) K)^T U``.
So the sequential part is one ``[K, K] @ [K, V]`` matmul per chunk; all the rest is batched over chunks.
"""
from __future__ import annotations

import warnings

import torch

from rotarium.ops.backend import use_fla
from rotarium.ops.utils import (
    check_cu_seqlens,
    check_dims,
    check_initial_state,
    check_log_decay,
    check_same_device,
    check_same_dtype,
    check_tensor,
    pad_time,
    run_packed,
)

CHUNK_SIZE = 64
# chunk-heads per block of the PyTorch path (see _chunk_gated_delta_rule_fwd)
BLOCK_CHUNK_HEADS = 128
L2NORM_EPS = 1e-6  # fla's l2norm_fwd default, so both backends normalise alike

_warned_float32 = False


def check_delta_rule_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
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
    check_cu_seqlens(cu_seqlens, B, T, q.device)
    num_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    check_initial_state(initial_state, num_states, H, K, v.shape[-1], q.device)
    check_log_decay("g", g)


def fla_rejects(q: torch.Tensor) -> bool:
    """fla's chunked delta-rule kernels assert on float32 inputs; those calls run our PyTorch path instead."""
    global _warned_float32
    if q.dtype != torch.float32:
        return False
    if not _warned_float32:
        # Warn once: the PyTorch path is correct on CUDA but slower than a Triton kernel, and a float32
        # model silently losing speed is worth knowing about (cast to bfloat16 to get fla's kernels).
        warnings.warn(
            "fla's chunked delta-rule kernels do not support float32 inputs; running rotarium's PyTorch "
            "implementation instead (cast q, k, v to bfloat16 or float16 to use fla's Triton kernels)",
            stacklevel=3,
        )
        _warned_float32 = True
    return True


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor | None, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything that does not depend on the state, batched over chunks ``[m, B*H, C, D]``.

    Returns G ``[m, BH, K, K]``, N ``[m, BH, K, V]`` (state map ``S' = G S + N``) and Q_state ``[m, BH, C, K]``,
    O_intra ``[m, BH, C, V]`` (outputs ``O = Q_state S + O_intra``, unscaled).
    """
    C, K, V = q.shape[-2], k.shape[-1], v.shape[-1]
    kt = k.transpose(-1, -2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta
    if gamma is not None:
        # exp only of non-positive differences: mask the upper triangle to -inf before exp
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        decay_in = gamma.exp()[..., None]  # exp(gamma_i): decay from the chunk start to i
        A = (k_beta @ kt) * decay
        P = (q @ kt) * decay
        rhs = torch.cat([v * beta, k_beta * decay_in], -1)
        k_out = k * decay[..., -1, :, None]  # exp(gamma_C - gamma_j): decay from j to the chunk end
        q_in = q * decay_in
    else:
        A = k_beta @ kt
        P = (q @ kt).masked_fill(~causal, 0.0)
        rhs = torch.cat([v * beta, k_beta], -1)
        k_out, q_in = k, q
    # unitriangular: the solver reads only the strict lower triangle of A and its unit diagonal
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [m, BH, C, V + K]
    O_intra, PW = (P @ UW).split([V, K], -1)
    N, KW = (k_out.transpose(-1, -2) @ UW).split([V, K], -1)
    Q_state = q_in - PW
    G = -KW
    # G = exp(gamma_C) I - KW: the diagonal is a view of a fresh tensor, so autograd follows the in-place add
    G.diagonal(dim1=-2, dim2=-1).add_(1.0 if gamma is None else decay_in[..., -1, :])
    return G, N, Q_state, O_intra


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
    C = CHUNK_SIZE
    n = max(-(-T // C), 1)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, *D] -> chunk-major [n, B*H, C, *D], contiguous
        x = pad_time(x, C) if T > 0 else x.new_zeros(B, C, *x.shape[2:])
        x = x.view(B, n, C, H, *x.shape[3:]).transpose(2, 3).transpose(0, 1)
        return x.reshape(n, B * H, C, *x.shape[4:]).contiguous()

    q, k, v, beta = chunks(q), chunks(k), chunks(v), chunks(beta)[..., None]
    gamma = None if g is None else chunks(g).cumsum(-1)  # within-chunk cumulative log decay, <= 0

    # Blocks of chunks: a block's state-free work stays in cache until its part of the scan consumes
    # it, which keeps the time linear in T. split, not slicing: autograd then joins the blocks'
    # gradients with one cat instead of a zero-filled full-size gradient per block.
    block = max(1, BLOCK_CHUNK_HEADS // (B * H))
    blocks = [x.split(block) if n > block else [x] for x in (q, k, v, beta)]
    blocks.append([None] * len(blocks[0]) if gamma is None else (gamma.split(block) if n > block else [gamma]))

    S = None if initial_state is None else initial_state.float().reshape(B * H, K, V)
    outputs = []
    for q_b, k_b, v_b, beta_b, gamma_b in zip(*blocks):
        G, N, Q_state, O_intra = _intra_chunk(q_b, k_b, v_b, gamma_b, beta_b)
        states = []
        # unbind and stack, not indexing, for the same reason as split above
        for G_c, N_c in zip(G.unbind(0), N.unbind(0)):
            states.append(q.new_zeros(B * H, K, V) if S is None else S)
            S = N_c if S is None else torch.baddbmm(N_c, G_c, S)
        S_in = torch.stack(states)  # the state entering each chunk
        o = torch.baddbmm(O_intra.flatten(0, 1), Q_state.flatten(0, 1), S_in.flatten(0, 1), beta=scale, alpha=scale)
        outputs.append(o)
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    o = o.view(n, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, V)
    return (o if n * C == T else o[:, :T]), (S.view(B, H, K, V) if output_final_state else None)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch path of every delta-rule op (validated inputs; g None means no decay)."""
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    o, final_state = run_packed(
        _chunk_gated_delta_rule_fwd,
        cu_seqlens,
        {"q": q, "k": k, "v": v.float(), "g": None if g is None else g.float(), "beta": beta.float()},
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o.to(v.dtype), final_state


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
    cu_seqlens: torch.LongTensor | None = None,
    *,
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
        backend: ``"auto"``, ``"torch"`` or ``"fla"`` (see :mod:`rotarium.ops.backend`).

    Returns:
        o ``[B, T, H, V]`` with the dtype of v, and the final state or None.
    """
    if g is None:
        raise ValueError("`g` (the log decay [B, T, H]) is required; use chunk_delta_rule for no decay")
    if beta is None:
        raise ValueError("`beta` ([B, T, H]) is required")
    check_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_fla(backend, q) and not fla_rejects(q):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

        return fla_chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )
    return chunk_gated_delta_rule_torch(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )


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
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    Shapes and arguments as :func:`chunk_gated_delta_rule`, without ``g``.
    """
    if beta is None:
        raise ValueError("`beta` ([B, T, H]) is required")
    check_delta_rule_inputs(q, k, v, None, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_fla(backend, q) and not fla_rejects(q):
        from fla.ops.delta_rule import chunk_delta_rule as fla_chunk_delta_rule

        return fla_chunk_delta_rule(
            q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )
    return chunk_gated_delta_rule_torch(
        q, k, v, None, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )
