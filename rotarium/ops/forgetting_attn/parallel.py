"""Forgetting attention (FoX) and plain causal softmax attention, blockwise in PyTorch.

The PyTorch path never holds a T x T matrix: queries go in blocks of 128, each
block scored against the keys up to its own end (``[block, T]`` scores; packed
sequences are cut into blocks one sequence at a time, so no score crosses a
boundary), and a custom autograd function recomputes each block's probabilities
in the backward pass, so training memory is linear in T as well. A block holds
every key of its rows, so one fused softmax per block serves both passes and no
row statistics (FlashAttention's log-sum-exp) are saved. The blocks serve sliding
windows and decoding; whole causal attention, plain or with a forget gate, goes to
PyTorch's fused SDPA kernel (memory-efficient already, and faster), the gate's bias
carried by two extra feature channels (:func:`_sdpa_causal`).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from rotarium.ops.backend import FLA_KERNELS, record_backend, use_fla
from rotarium.ops.cumsum import segment_cumsum
from rotarium.ops.opaque import Output, opaque_to_compiler
from rotarium.ops.utils import (
    check_cu_seqlens,
    check_dims,
    check_log_decay,
    check_same_device,
    check_same_dtype,
    check_tensor,
    float32_internals,
)

# Query rows per block: the blocks' scores are [rows, keys], and small blocks keep them in cache (benchmarks/ops.py
# times the op); the budget (floats) bounds the memory of a block for large batch * heads * keys.
BLOCK = 128
SCORE_BUDGET = 1 << 24


def _block_size(num_rows: int, num_keys: int) -> int:
    """``num_rows`` = B * HQ score rows per query position, ``num_keys`` = keys per row."""
    n = SCORE_BUDGET // max(num_rows * num_keys, 1)
    return max(16, min(BLOCK, n // 16 * 16))


def _softmax_(S: torch.Tensor, rows_may_be_empty: bool) -> torch.Tensor:
    """Softmax over the last dim, in place: one fused pass over rows that fit in cache, where max, subtract, exp, sum
    and divide as separate ops would each stream the whole block through memory. In place is safe: the kernels write
    each element of a row only after that row's max was read. A row with no visible key (padding) gives zeros instead
    of NaNs."""
    P = torch.ops.aten._softmax.out(S, -1, False, out=S)
    return P.nan_to_num_(nan=0.0) if rows_may_be_empty else P


class _BlockAttention(torch.autograd.Function):
    """Blockwise softmax attention with an optional additive bias ``cq_i - ck_j``.

    Heads are flattened into the batch (BH = B * H) and the G query heads sharing a
    key head into the rows, so one matmul serves a whole group and k, v are never
    repeated: q ``[BH, Tq * G, K]`` (rows ordered (t, g); ``scale`` rides in the matmuls),
    k ``[BH, Tk, K]``, v ``[BH, Tk, V]``, cq ``[BH, Tq * G]``, ck ``[BH, G, Tk]``
    (float32, or both None). Query i sits at key position ``q_offset + i``.
    ``bounds`` (cu_seqlens as a list, q_offset 0) keeps blocks, and attention,
    inside each packed sequence; ``key_mask [B, Tk]`` (bool) drops keys; ``window`` (or None) keeps
    only the last ``window`` keys of each query (sliding-window attention). Returns
    o ``[BH, Tq * G, V]``; a row without a visible key gives zeros.
    """

    @staticmethod
    def _blocks(ctx, Tq):
        """(first query, end query, first key, end key) of each block."""
        segments = itertools.pairwise(ctx.bounds) if ctx.bounds is not None else [(0, Tq)]
        for a, b in segments:
            for s in range(a, b, ctx.block):
                e = min(s + ctx.block, b)
                first = a if ctx.bounds is not None else 0
                if ctx.window is not None:
                    first = max(first, ctx.q_offset + s - ctx.window + 1)
                yield s, e, first, ctx.q_offset + e

    @staticmethod
    def _scores(ws, qb, kT, cq, ck, s, e, ks, ke, ctx):
        """Masked scores of queries [s, e) (rows ``qb``) against keys [ks, ke) (``kT``), in ``ws``."""
        BH, G = qb.shape[0], ctx.G
        n, nk = e - s, ke - ks
        S = ws[: BH * n * G * nk].view(BH, n * G, nk)
        if cq is not None:
            # the bias difference is formed exactly, first: c reaches ~1e5 over long strongly
            # decaying inputs, and (q.k + c_i) - c_j would round the score away
            rows, cols = cq.view(BH, -1, G)[:, s:e, :, None], ck[:, None, :, ks:ke]
            if G == 1:  # 3-d broadcasting runs faster
                rows, cols = rows.view(BH, n, 1), cols.view(BH, 1, nk)
            torch.sub(rows, cols, out=S.view(rows.shape[:-1] + (nk,)))
            S.baddbmm_(qb, kT, alpha=ctx.scale)  # adding to S costs the matmul nothing: it is bound by writing S
        else:
            torch.baddbmm(S, qb, kT, beta=0.0, alpha=ctx.scale, out=S)  # beta 0: S's old contents are ignored
        if ctx.key_mask is None and ctx.window is None:  # causal: only the block's diagonal tile has masked keys
            S.view(BH, n, G, nk)[..., nk - n :].add_(ctx.tile[:n, :, :n])
        else:
            qpos = torch.arange(s, e, device=qb.device) + ctx.q_offset
            kpos = torch.arange(ks, ke, device=qb.device)
            invalid = (kpos[None, None, :] > qpos[None, :, None])
            if ctx.window is not None:
                invalid = invalid | (kpos[None, None, :] <= qpos[None, :, None] - ctx.window)
            if ctx.key_mask is not None:
                invalid = invalid | ~ctx.key_mask[:, None, ks:ke]
            batch = invalid.shape[0]
            S.view(batch, -1, n, G, nk).masked_fill_(invalid[:, None, :, None], float("-inf"))
        return S

    @staticmethod
    def forward(ctx, q, k, v, cq, ck, scale, bounds, key_mask, q_offset, block, G, window):
        BH, TG, _ = q.shape
        Tq, Tk = TG // G, k.shape[1]
        ctx.G, ctx.bounds, ctx.key_mask, ctx.q_offset, ctx.block = G, bounds, key_mask, q_offset, block
        ctx.scale = scale
        ctx.window = window
        nt = min(block, Tq)
        above = torch.ones(nt, nt, dtype=torch.bool, device=q.device).triu_(1)
        ctx.tile = torch.zeros(nt, 1, nt, device=q.device).masked_fill_(above[:, None], float("-inf"))
        ws = q.new_empty(BH * nt * G * Tk)  # one block's scores, reused by every block
        o = q.new_empty(BH, TG, v.shape[-1])
        kT = k.transpose(1, 2)
        for s, e, ks, ke in _BlockAttention._blocks(ctx, Tq):
            rows = slice(s * G, e * G)
            S = _BlockAttention._scores(ws, q[:, rows], kT[:, :, ks:ke], cq, ck, s, e, ks, ke, ctx)
            o[:, rows] = torch.bmm(_softmax_(S, key_mask is not None), v[:, ks:ke])
        ctx.save_for_backward(q, k, v, cq, ck, o)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, cq, ck, o = ctx.saved_tensors
        G = ctx.G
        BH, TG, _ = q.shape
        Tq, Tk = TG // G, k.shape[1]
        ws = q.new_empty(BH * min(ctx.block, Tq) * G * Tk)
        ws_ds = torch.empty_like(ws)
        do = do.contiguous()
        delta = (do * o).sum(-1, keepdim=True)  # rowsum(P * dP), as P @ V = o
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        use_c = cq is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        dcq = torch.empty_like(cq) if use_c else None
        dck = torch.zeros_like(ck) if use_c else None
        kT = k.transpose(1, 2)
        for s, e, ks, ke in _BlockAttention._blocks(ctx, Tq):
            n, nk = e - s, ke - ks
            rows = slice(s * G, e * G)
            S = _BlockAttention._scores(ws, q[:, rows], kT[:, :, ks:ke], cq, ck, s, e, ks, ke, ctx)
            P = _softmax_(S, ctx.key_mask is not None)
            do_b = do[:, rows]
            dv[:, ks:ke].baddbmm_(P.transpose(1, 2), do_b)
            dS = ws_ds[: BH * n * G * nk].view(BH, n * G, nk)
            torch.baddbmm(delta[:, rows].neg(), do_b, v[:, ks:ke].transpose(1, 2), out=dS).mul_(P)
            dq[:, rows] = torch.bmm(dS, k[:, ks:ke]).mul_(ctx.scale)
            dk[:, ks:ke].baddbmm_(dS.transpose(1, 2), q[:, rows], alpha=ctx.scale)
            if use_c:
                dcq[:, rows] = dS.sum(-1)
                dck[..., ks:ke] -= dS.view(BH, n, G, nk).sum(1)
        return dq, dk, dv, dcq, dck, None, None, None, None, None, None, None


@float32_internals
def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cumsum: torch.Tensor | None,
    k_cumsum: torch.Tensor | None,
    scale: float,
    q_offset: int = 0,
    bounds: list[int] | None = None,
    key_mask: torch.Tensor | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """Layout adapter around :class:`_BlockAttention`, differentiable in every tensor input.

    q ``[B, Tq, HQ, K]``, k ``[B, Tk, H, K]``, v ``[B, Tk, H, V]``, q_cumsum ``[B, Tq, HQ]``,
    k_cumsum ``[B, Tk, HQ]`` (or both None) -> o ``[B, Tq, HQ, V]`` float32.
    """
    B, Tq, HQ, K = q.shape
    Tk, H = k.shape[1], k.shape[2]
    G = HQ // H
    qh = q.float().reshape(B, Tq, H, G, K).transpose(1, 2).reshape(B * H, Tq * G, K).contiguous()
    kh = k.float().transpose(1, 2).reshape(B * H, Tk, K).contiguous()
    vh = v.float().transpose(1, 2).reshape(B * H, Tk, -1).contiguous()
    cq = ck = None
    if q_cumsum is not None:
        cq = q_cumsum.float().reshape(B, Tq, H, G).transpose(1, 2).reshape(B * H, Tq * G).contiguous()
        ck = k_cumsum.float().reshape(B, Tk, H, G).permute(0, 2, 3, 1).reshape(B * H, G, Tk).contiguous()
    block = _block_size(B * HQ, Tk)
    o = _BlockAttention.apply(qh, kh, vh, cq, ck, scale, bounds, key_mask, q_offset, block, G, window_size)
    return o.view(B, H, Tq, G, -1).transpose(1, 2).reshape(B, Tq, HQ, -1)


@float32_internals
def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 c: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention through PyTorch's fused kernel: q ``[B, T, HQ, K]``, k ``[B, T, H, K]``, v ``[B, T, H, V]``,
    and optionally the forget gate's cumulative log ``c [B, T, HQ]`` (float32) -> o ``[B, T, HQ, V]`` float32.

    The fused kernel takes no bias it can differentiate, so the gate's bias ``c_i - c_j`` rides in the scores
    themselves: q_i gains the channels ``(c_i, 1) / scale`` and k_j the channels ``(1, -c_j)``, so that
    ``scale * q'_i . k'_j = scale * q_i . k_j + c_i - c_j`` exactly, and the kernel's gradients of q' and k' carry
    the gate's gradient back through those channels. The bias is then rounded with the sum, to about float32's
    epsilon times ``|c|``, as fla's kernel rounds it (it adds ``c_i`` and subtracts ``c_j`` from the scaled
    scores); the blocks of :class:`_BlockAttention` subtract first, exact to the difference, and serve as the
    reference in the tests. Shifting ``c`` by a constant per head leaves every bias as it is, so ``c`` is centred
    on its range first, which halves its largest magnitude."""
    q, k, v = q.float(), k.float(), v.float()
    if c is not None:
        if q.shape[2] != k.shape[2]:  # each query head has its own gate, so its keys carry its own channels
            group = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        c = c - ((c.amax(dim=1, keepdim=True) + c.amin(dim=1, keepdim=True)) / 2).detach()
        ones = torch.ones_like(c)
        q = torch.cat([q, torch.stack([c, ones], dim=-1) / scale], dim=-1)
        k = torch.cat([k, torch.stack([ones, -c], dim=-1)], dim=-1)
    V = v.shape[-1]
    # PyTorch's CPU kernel has its fast path only where values are as wide as keys: zero channels even them out
    # (zeros add nothing to a score or an output)
    width = max(q.shape[-1], V)
    q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=True, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)[..., :V]


def check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    HQ, H = q.shape[2], k.shape[2]
    if H == 0 or HQ % H != 0:
        raise ValueError(
            f"the number of query heads of `q` ({HQ}) must be a multiple of the number of key/value heads "
            f"of `k` and `v` ({H})"
        )



def _attention_output(q: torch.Tensor, v: torch.Tensor, **_) -> Output:
    """What :func:`parallel_forgetting_attn` returns: ``[B, T, HQ, V]`` in v's dtype."""
    return Output((*q.shape[:3], v.shape[-1]), v.dtype)


@opaque_to_compiler(_attention_output)
def parallel_forgetting_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal softmax attention with a forget gate: ``o_i = sum_{j<=i} softmax_j(scale q_i.k_j + c_i - c_j) v_j``.

    Args:
        q: queries ``[B, T, HQ, K]``.
        k: keys ``[B, T, H, K]``; HQ must be a multiple of H (grouped-query attention).
        v: values ``[B, T, H, V]``.
        g: log forget gates ``[B, T, HQ]`` (<= 0), ``c = cumsum(g)`` in float32;
            None gives plain causal softmax attention.
        scale: score scale, default ``K ** -0.5``.
        window_size: if given, query i attends only to keys ``[i - window_size + 1, i]``.
        cu_seqlens: ``[N+1]`` cumulative lengths of sequences packed in a batch of size 1;
            attention stays within a sequence and the cumulative gate restarts at each.
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (rotarium's addition: fla's kernel takes none): the PyTorch
            path reads the boundaries from it instead of synchronising with the device.
        backend: ``"auto"``, ``"torch"`` or ``"fla"`` (see :mod:`rotarium.ops.backend`).

    Returns:
        o ``[B, T, HQ, V]`` in the dtype of ``v``.
    """
    check_tensor("q", q, 4, "[B, T, HQ, K]")
    check_tensor("k", k, 4, "[B, T, H, K]")
    check_tensor("v", v, 4, "[B, T, H, V]")
    B, T, HQ, K = q.shape
    check_dims("k", k, (B, T, None, K), "[B, T, H, K]")
    check_dims("v", v, (B, T, k.shape[2], None), "[B, T, H, V]")
    check_heads(q, k)
    if g is not None:
        check_tensor("g", g, 3, "[B, T, HQ]")
        check_dims("g", g, (B, T, HQ), "[B, T, HQ]")
    check_same_device("q", q, k=k, v=v, g=g)
    check_same_dtype(q=q, k=k, v=v)
    check_cu_seqlens(cu_seqlens, B, T, q.device, cu_seqlens_cpu)
    check_log_decay("g", g)
    if window_size is not None and (not isinstance(window_size, int) or window_size < 1):
        raise ValueError(f"`window_size` must be a positive int or None, got {window_size!r}")
    if scale is None:
        scale = K ** -0.5

    kernel = FLA_KERNELS["parallel_forgetting_attn" if g is not None else "parallel_attn"]
    if record_backend("parallel_forgetting_attn", use_fla(backend, q, kernel.refusal(q))):
        if g is None:
            from fla.ops.attn import parallel_attn

            return parallel_attn(q=q, k=k, v=v, g=None, scale=scale, window_size=window_size, cu_seqlens=cu_seqlens)
        from fla.ops.forgetting_attn import parallel_forgetting_attn as fla_parallel_forgetting_attn

        return fla_parallel_forgetting_attn(q=q, k=k, v=v, g=g, scale=scale, window_size=window_size,
                                            cu_seqlens=cu_seqlens)

    if T == 0:  # an empty output, as the recurrent ops give: neither the fused kernel nor the blocks take no tokens
        return v.new_zeros(B, 0, HQ, v.shape[-1])
    bounds = None if cu_seqlens is None else (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    c = None if g is None else segment_cumsum(g.float(), cu_seqlens)
    if window_size is None:
        # PyTorch's fused kernel (memory-efficient in both passes) is faster than blocks of matmuls; packed
        # sequences go through it one by one (the cumulative gate restarts at each)
        if bounds is None:
            return _sdpa_causal(q, k, v, scale, c).to(v.dtype)
        parts = [_sdpa_causal(q[:, a:b], k[:, a:b], v[:, a:b], scale, None if c is None else c[:, a:b])
                 for a, b in itertools.pairwise(bounds) if b > a]
        return torch.cat(parts, dim=1).to(v.dtype)
    return block_attention(q, k, v, c, c, scale, bounds=bounds, window_size=window_size).to(v.dtype)
