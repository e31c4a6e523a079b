"""L2 normalisation over the last dim, fla's ``l2norm``: ``y = x / sqrt(sum(x^2) + eps)``.

One function serves the DeltaNet layer's q and k, the delta-rule ops' ``use_qk_l2norm_in_kernel`` and Selective RoPE's
per-head input. Its eps is fla's, 1e-6 added under the root: fla's delta-rule kernels normalise with it, and a
checkpoint converted from fla must compute the same function on every backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-6


def l2norm_fwd(x: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., D]`` -> ``(y, rstd)`` in at least float32: y ``[..., D]`` and ``rstd = 1 / sqrt(sum(x^2) + eps)``
    ``[..., 1]``."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = xf.square().sum(-1, keepdim=True).add_(eps).rsqrt_()
    return xf * rstd, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``dx = (dy - y <dy, y>) rstd`` in y's dtype, in one fresh contiguous buffer ``[..., D]`` whatever dy's layout
    (an einsum's backward hands over a permuted one), so that callers can view it."""
    product = torch.mul(dy.to(y.dtype), y, out=torch.empty(y.shape, dtype=y.dtype, device=y.device))
    dot = product.sum(-1, keepdim=True)
    # product's memory is reused for the result
    return product.copy_(dy).addcmul_(y, dot, value=-1.0).mul_(rstd)


class L2NormFunction(torch.autograd.Function):
    """Backward by hand (:func:`l2norm_bwd`): two full-size tensors where autograd's graph of the formula allocates
    several more (see :mod:`rotarium.ops` on allocation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = l2norm_fwd(x, eps)
        ctx.save_for_backward(y, rstd)
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return l2norm_bwd(*ctx.saved_tensors, dy).to(dy.dtype), None


def l2norm(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """x ``[..., D]`` L2-normalised over D, computed in at least float32 and returned in x's dtype."""
    # float(): under torch.compile with dynamic shapes a float read from a name (this default) would enter the graph
    # as a symbolic input, which dynamo cannot hand to an autograd.Function called twice in one graph (q and k)
    return L2NormFunction.apply(x, float(eps))


class _HeadL2NormAndLinear(torch.autograd.Function):
    """Two reads of one input with one backward: the linear map's share of x's gradient is added in place to the
    normalisation's, where autograd would allocate each share and then their sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, heads: int, weight: torch.Tensor | None, bias: torch.Tensor | None):
        B, T, d = x.shape
        y, rstd = l2norm_fwd(x.reshape(B, T, heads, d // heads))
        ctx.save_for_backward(x, weight, y, rstd)
        ctx.has_bias = bias is not None
        return y.to(x.dtype), None if weight is None else F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_xh: torch.Tensor | None, grad_out: torch.Tensor | None):
        x, weight, y, rstd = ctx.saved_tensors
        B, T, d = x.shape
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # contiguous either way (as l2norm_bwd's result), so that it views as [B * T, d]
            grad_x = (l2norm_bwd(y, rstd, grad_xh) if grad_xh is not None else y.new_zeros(y.shape)).view(B * T, d)
        if grad_out is not None:
            grad_out = grad_out.reshape(B * T, -1).to(y.dtype)
            if grad_x is not None:
                grad_x.addmm_(grad_out, weight.to(y.dtype))
            if ctx.needs_input_grad[2]:
                grad_weight = (grad_out.t() @ x.reshape(B * T, d).to(y.dtype)).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[3]:
                grad_bias = grad_out.sum(0).to(weight.dtype)
        return None if grad_x is None else grad_x.view(B, T, d).to(x.dtype), None, grad_weight, grad_bias


def head_l2norm_and_linear(x: torch.Tensor, heads: int, weight: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x ``[B, T, d]`` cut into ``heads`` chunks, each L2-normalised (:func:`l2norm`): ``[B, T, heads, d / heads]``;
    and ``F.linear(x, weight, bias)`` ``[B, T, out]`` (None without a weight). Both in x's dtype, differentiable."""
    return _HeadL2NormAndLinear.apply(x, heads, weight, bias)
