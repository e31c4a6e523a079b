"""Rotations of feature pairs, the kernels of the positional encodings (fla keeps its own in ``modules/rotary.py``).

q and k turn on pairs ``(i, i + R/2)`` of the first ``R`` features of a head (the rotate-half / GPT-NeoX pairing, as
transformers' Llama), by angles that may be learned (Selective RoPE). Values turn on adjacent pairs ``(2i, 2i + 1)``
(Meta's original LLaMA pairing): RoVE rotates them in and back out inside the mixer, so their pairing is internal, and
adjacent pairs make each rotation a single complex product instead of four kernels and their backward.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rotarium.ops.utils import multiply_into


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
            heads_major: bool = False) -> torch.Tensor:
    """x ``[B, T, H, D]`` with its pairs ``(i, i + R/2)``, ``R = 2 * cos.shape[-1]``, rotated by the angle (minus it
    with ``inverse``); cos, sin ``[B or 1, T, H or 1, R/2]``.

    Computed in cos's dtype, returned in x's, laid out ``[B, H, T, D]`` in memory with ``heads_major``. Each half is
    written in place into one output buffer, so the rotation allocates nothing else (see :mod:`rotarium.ops` on
    allocation).
    """
    half = cos.shape[-1]
    if heads_major:
        B, T, H, D = x.shape
        out = torch.empty(B, H, T, D, dtype=cos.dtype, device=x.device).transpose(1, 2)
    else:
        out = torch.empty(x.shape, dtype=cos.dtype, device=x.device)
    x1, x2, out1, out2 = x[..., :half], x[..., half:2 * half], out[..., :half], out[..., half:2 * half]
    sign = 1.0 if inverse else -1.0
    multiply_into(out1, x1, cos).addcmul_(x2, sin, value=sign)
    multiply_into(out2, x2, cos).addcmul_(x1, sin, value=-sign)
    if x.shape[-1] > 2 * half:  # partial rotary: the rest passes through
        out[..., 2 * half:] = x[..., 2 * half:]
    return out.to(x.dtype)


def _per_head(cos: torch.Tensor, sin: torch.Tensor, xs: Sequence[torch.Tensor | None],
              heads_major: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) for each head count among xs, copied out per head when they broadcast over the heads (RoPE's angles
    do) and the rotation is written token-major: a stride-0 head dim between time and features cuts PyTorch's
    innermost CPU loops to R/2 elements, and one copy, made once for q and k alike, costs less than it saves
    (benchmarks/layers.py checks the positional layer's cost). Head-major outputs loop over time innermost and gain
    nothing from it."""
    layouts = {}
    for heads in {x.shape[2] for x in xs if x is not None}:
        if heads_major or cos.shape[2] != 1 or heads == 1:
            layouts[heads] = (cos, sin)
        else:
            shape = (*cos.shape[:2], heads, cos.shape[3])
            layouts[heads] = (cos.expand(shape).contiguous(), sin.expand(shape).contiguous())
    return layouts


def _rotated_half(angles: torch.Tensor, heads_major: bool, scale: float, xs: tuple[torch.Tensor, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(cos, sin, rotated xs)``: the arithmetic of :func:`rotate_half_pairs`."""
    compute = torch.promote_types(xs[0].dtype, torch.float32)  # bf16 would lose the angle's precision
    cos, sin = angles.cos().to(compute), angles.sin().to(compute)
    if scale != 1.0:  # the map stays linear in x, and d out / d angle = (-out2, out1) still holds
        cos, sin = cos.mul_(scale), sin.mul_(scale)
    layouts = _per_head(cos, sin, xs, heads_major)
    return cos, sin, tuple(_rotate(x, *layouts[x.shape[2]], heads_major=heads_major) for x in xs)


class _RotateHalf(torch.autograd.Function):
    """Forward and backward by hand, for tensors sharing one set of angles (q and k): cos and sin are computed once,
    the backward of a rotation is the rotation by minus the angle, and the angle's gradient comes from the outputs,
    ``d(out1, out2)/d angle = (-out2, out1)``, accumulated in place, where autograd's graph of the same computation
    passes over q and k several times more."""

    @staticmethod
    def forward(ctx, angles: torch.Tensor, heads_major: bool, scale: float, *xs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        cos, sin, outs = _rotated_half(angles, heads_major, scale, xs)
        ctx.angles_shape = angles.shape
        ctx.save_for_backward(cos, sin, *(outs if ctx.needs_input_grad[0] else ()))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        cos, sin, *outs = ctx.saved_tensors
        # token-major: the gradients go on to the projections' matmuls, which read [B * T, H * D]
        layouts = _per_head(cos, sin, grads, heads_major=False)
        grad_xs = [None if g is None or not needed else _rotate(g, *layouts[g.shape[2]], inverse=True)
                   for g, needed in zip(grads, ctx.needs_input_grad[3:])]
        grad_angles = None
        if ctx.needs_input_grad[0]:
            half = sin.shape[-1]
            for g, out in zip(grads, outs):
                if g is None:
                    continue
                g1, g2 = g[..., :half].to(sin.dtype), g[..., half:2 * half].to(sin.dtype)
                out1, out2 = out[..., :half].to(sin.dtype), out[..., half:2 * half].to(sin.dtype)
                if grad_angles is None or grad_angles.shape != g1.shape:
                    term = torch.mul(g2, out1).addcmul_(g1, out2, value=-1.0).sum_to_size(ctx.angles_shape)
                    grad_angles = term if grad_angles is None else grad_angles.add_(term)
                else:  # same shape as the first: accumulate in place
                    grad_angles.addcmul_(g2, out1).addcmul_(g1, out2, value=-1.0)
        return grad_angles, None, None, *grad_xs


def rotate_half_pairs(angles: torch.Tensor, *xs: torch.Tensor, heads_major: bool = False,
                      scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """Rotates pairs ``(i, i + R/2)`` of the first ``R = 2 * angles.shape[-1]`` features of each x by ``angles``.

    xs: ``[B, T, H, D]`` each (q and k: the heads may differ when angles broadcast over them); angles:
    ``[B or 1, T, H or 1, R/2]`` float32 (differentiable: Selective RoPE learns them). Computed in at least float32,
    returned in each x's dtype; features past ``R`` pass through untouched. With ``heads_major`` the outputs are
    ``[B, T, H, D]`` views of ``[B, H, T, D]`` memory, which spares a kernel that reads each head as one ``[T, D]``
    matrix (blockwise attention, SDPA) a copy. ``scale`` multiplies the rotated features (cos and sin, as
    transformers applies a RoPE scaling's attention factor), never the features past ``R``.
    """
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (angles, *xs)):
        # Nothing to differentiate (evaluation, decoding): the arithmetic alone. torch.compile cannot trace this
        # Function's variadic forward without gradients, and would run a compiled block's code piece by piece.
        return _rotated_half(angles, heads_major, float(scale), xs)[2]
    return _RotateHalf.apply(angles, heads_major, float(scale), *xs)


def rotate_adjacent_pairs(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotates feature pairs ``(2i, 2i + 1)`` of x ``[B, T, H, D]`` by unit complex numbers
    ``[B or 1, T, H or 1, D/2]``.

    Computed in at least float32 (complex64), returned in x's dtype.
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32)).contiguous()
    rotated = torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * rotation
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)
