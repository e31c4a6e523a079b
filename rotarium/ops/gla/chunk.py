"""Chunkwise GLA: fla's Triton kernel on CUDA, a chunked PyTorch implementation everywhere else.

PyTorch path, per chunk of 64 tokens with the within-chunk cumulative log decay b, in blocks of chunks (see
rotarium.ops.utils.time_blocks): the states at the chunk starts come from a short loop over chunks (everything
else batched), the inter-chunk output is ``(q * exp(b)) @ S`` and the intra-chunk scores are
``A_ts = sum_i q_ti k_si exp(b_ti - b_si)``. Where every chunk decays by at most e^-BOUND (usual gates), all
exponents are measured from the chunk ends (:func:`_gla_block_from_chunk_ends`); otherwise the scores are built
without ever exponentiating a large positive number (:func:`_intra_chunk_scores`).
"""
from __future__ import annotations

import torch

from rotarium.ops.backend import FLA_KERNELS, record_backend, use_fla
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
# Largest |exponent| of the single-matmul intra-chunk path. Its factors stay finite; scores above the
# diagonal may reach e^(2 BOUND) |q||k| (even inf) and are masked out before anything reads them.
BOUND = 40.0
# Decays are never taken below e^-FLOOR: anything smaller is beneath float32 resolution next to the
# terms it is added to, and subnormal floats would make every op on them many times slower.
FLOOR = 40.0


def check_gla_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor | None],
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None = None,
) -> None:
    """Shared by chunk_gla and fused_recurrent_gla; ``gates`` maps an argument name to its log decay."""
    check_tensor("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_tensor("k", k, 4, "[B, T, H, K]")
    check_dims("k", k, (B, T, H, K), "[B, T, H, K]")
    check_tensor("v", v, 4, "[B, T, H, V]")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V]")
    V = v.shape[-1]
    check_same_device("q", q, k=k, v=v, initial_state=initial_state, **gates)
    check_same_dtype(q=q, k=k, v=v)
    for name, g in gates.items():
        if g is None:
            continue
        layout = "[B, T, H, V]" if name == "gv" else "[B, T, H, K]"
        check_tensor(name, g, 4, layout)
        check_dims(name, g, (B, T, H, V if name == "gv" else K), layout)
    check_cu_seqlens(cu_seqlens, B, T, q.device, cu_seqlens_cpu)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    check_initial_state(initial_state, N, H, K, V, q.device)
    for name, g in gates.items():
        check_log_decay(name, g)


def _exp(x: torch.Tensor, floor: bool) -> torch.Tensor:
    return x.clamp(min=-FLOOR).exp() if floor else x.exp()


def _bisection_scores(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor, floor: bool) -> torch.Tensor:
    """Intra-chunk scores (see :func:`_intra_chunk_scores`) for any decay, however strong.

    Bisection: at each level the chunk splits into blocks of 2h; the block's lower-left h x h quadrant
    (queries in the second half, keys in the first) factors through the anchor r = last key of the first
    half, ``exp(b_t - b_r) * exp(b_r - b_s)``, both exponents <= 0, so it is one matmul and cannot
    overflow. The diagonal quadrants come from the level below; at the bottom the diagonal is
    ``q_t . k_t``. Elementwise work is ``O(C K log C)`` per chunk, against ``O(C K S)`` for explicit
    pairwise decays over diagonal blocks of size S.
    """
    *lead, C, K = q.shape
    A = (q * k).sum(-1)[..., None, None]  # [..., C, 1, 1]: the blocks of size 1
    h = 1
    while h < C:
        # unbind rather than slicing: its backward is one stack instead of a zero-filled copy per slice
        k0, _ = k.view(*lead, C // (2 * h), 2, h, K).unbind(-3)
        _, q1 = q.view(*lead, C // (2 * h), 2, h, K).unbind(-3)
        b0, b1 = b.view(*lead, C // (2 * h), 2, h, K).unbind(-3)
        # the scores do not depend on the anchor's value, so it needs no gradient
        anchor = b0[..., -1:, :].detach()
        cross = (q1 * _exp(b1 - anchor, floor)) @ (k0 * _exp(anchor - b0, floor)).transpose(-1, -2)
        diag = A.view(*lead, C // (2 * h), 2, h, h)  # cross: [..., C/2h, h, h]
        top = torch.cat([diag[..., 0, :, :], torch.zeros_like(cross)], dim=-1)
        bottom = torch.cat([cross, diag[..., 1, :, :]], dim=-1)
        A = torch.cat([top, bottom], dim=-2)  # [..., C/2h, 2h, 2h]
        h *= 2
    return A.view(*lead, C, C)


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor, floor: bool) -> torch.Tensor:
    """``A_ts = sum_i q_ti k_si exp(b_ti - b_si)`` for ``s <= t``, 0 above the diagonal: ``[..., C, C]``.

    q, k: ``[..., C, K]``; b: the within-chunk cumulative log decay ``[..., C, K]`` (non-increasing in t).

    A chunk whose decay spans at most ``2 * BOUND`` nats in every channel (all of them, for usual gates)
    takes one matmul: ``(q * exp(b - c)) (k * exp(c - b))^T`` with c the middle of the range, so every
    exponent lies in ``[-BOUND, BOUND]``. The other chunks go through the bisection, which holds for any
    decay.
    """
    *lead, C, _ = q.shape
    first, last = b[..., :1, :].detach(), b[..., -1:, :].detach()
    fast = (first - last).amax(dim=(-2, -1)) <= 2 * BOUND  # [...]
    expo = b - (first + last) / 2  # A does not depend on the centre, so it needs no gradient
    all_fast = bool(fast.all())
    if not all_fast and not bool(fast.any()):
        return _bisection_scores(q, k, b, floor)
    if not all_fast:
        expo = expo.clamp(-BOUND, BOUND)  # keeps the discarded scores of the other chunks finite
    e = expo.exp()
    A = ((q * e) @ (k / e).transpose(-1, -2)).tril_()
    if all_fast:
        return A
    slow = (~fast).flatten().nonzero().squeeze(1)
    rows = [x.flatten(0, -3).index_select(0, slow) for x in (q, k, b)]
    return A.flatten(0, -3).index_copy(0, slow, _bisection_scores(*rows, floor)).view(*lead, C, C)


def _gla_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of m chunks ``[m, N, C, D]`` from the state entering it ``[N, K, V]``: ``(o, state after)``."""
    b = g.cumsum(-2)  # within-chunk cumulative log decay, <= 0 and decreasing
    b_last = b[..., -1:, :]
    if bool(b_last.min() >= -BOUND):  # every chunk decays by at most e^-BOUND in every channel: usual gates
        return _gla_block_from_chunk_ends(q, k, v, b, state, scale)
    floor = bool(b_last.min() < -FLOOR)  # b is monotone: no exponent below can be lower than b_last

    # Inter-chunk: the state at each chunk start; everything but the decay-and-add runs batched.
    kv = (k * _exp(b_last - b, floor)).transpose(-1, -2) @ v  # [m, N, K, V]
    decay = _exp(b_last.transpose(-1, -2), floor)  # [m, N, K, 1]
    starts = []
    for decay_c, kv_c in zip(decay.unbind(0), kv.unbind(0)):  # unbind, not indexing: linear-cost backward
        starts.append(state)
        state = decay_c * state + kv_c
    o = (q * _exp(b, floor)) @ torch.stack(starts)
    # the intra-chunk term, the sum and the scale in one call
    C, V = v.shape[-2:]
    o = torch.baddbmm(o.view(-1, C, V), _intra_chunk_scores(q, k, b, floor).view(-1, C, C), v.view(-1, C, V),
                      beta=scale, alpha=scale)
    return o.view_as(v), state


def _gla_block_from_chunk_ends(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, state: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_gla_block` for chunks whose decay ``b_last`` is at least ``-BOUND`` in every channel.

    Every exponent is measured from the chunk's end. ``k * exp(b_last - b)`` (factors <= 1) both carries each key
    to the chunk end for the state update and is the key side of the intra-chunk scores, whose query side is
    ``q * exp(b - b_last)`` (factors in ``[1, e^BOUND]``). That leaves the query's inter-chunk term
    ``q exp(b) S = (q exp(b - b_last)) (exp(b_last) S)``: the state decayed over the chunk, which the state update
    computes anyway. Two scaled copies of q and k instead of four, and no ``[C, K]`` quotient.
    """
    b_last = b[..., -1:, :]
    k_out = k * (b_last - b).exp()
    q_rise = q * (b - b_last).exp()
    kv = k_out.transpose(-1, -2) @ v  # [m, N, K, V]
    decay = b_last.transpose(-1, -2).exp()  # [m, N, K, 1]
    decayed_starts = []
    for decay_c, kv_c in zip(decay.unbind(0), kv.unbind(0)):
        decayed = decay_c * state
        decayed_starts.append(decayed)
        state = decayed + kv_c
    o = q_rise @ torch.stack(decayed_starts)
    C, V = v.shape[-2:]
    scores = (q_rise @ k_out.transpose(-1, -2)).tril_()
    o = torch.baddbmm(o.view(-1, C, V), scores.view(-1, C, C), v.view(-1, C, V), beta=scale, alpha=scale)
    return o.view_as(v), state


@float32_internals
def chunk_gla_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked PyTorch kernel on an unpacked batch; returns ``o`` in float32 ``[B, T, H, V]``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    state = (q.new_zeros(B * H, K, V, dtype=torch.float32) if initial_state is None
             else initial_state.float().reshape(B * H, K, V))
    outputs = []
    for block in time_blocks(CHUNK_SIZE, *(x.float() for x in (q, k, v, g))):  # each [m, B*H, C, D]
        o, state = _gla_block(*block, state, scale)
        outputs.append(o)
    o = join_time_blocks(outputs, B, T)
    return o, state.view(B, H, K, V) if output_final_state else None


@opaque_to_compiler(recurrent_outputs)
def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,  # fla has state_v_first here, before cu_seqlens
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention, chunkwise: ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        g: per-channel log decay ``[B, T, H, K]``, ``g <= 0``.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the state after the last token.
        cu_seqlens: int64 ``[N+1]`` cumulative lengths of sequences packed into a batch of size 1.
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (fla's argument): with it neither path reads ``cu_seqlens``
            from the device, which on CUDA would synchronise.
        backend: ``"auto"`` / ``"torch"`` / ``"fla"`` (see rotarium.ops.backend).

    Returns:
        ``o [B, T, H, V]`` (dtype of v) and the final state ``[N, H, K, V]`` (float32) or None.
    """
    check_gla_inputs(q, k, v, {"g": g}, initial_state, cu_seqlens, cu_seqlens_cpu)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if record_backend("chunk_gla", use_fla(backend, q, FLA_KERNELS["chunk_gla"].refusal(q))):
        from fla.ops.gla import chunk_gla as fla_chunk_gla

        return fla_chunk_gla(
            q=q, k=k, v=v, g=g, scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        )
    o, final_state = run_packed(
        chunk_gla_torch, cu_seqlens, {"q": q, "k": k, "v": v, "g": g}, cu_seqlens_cpu,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
    )
    return o.to(v.dtype), final_state
