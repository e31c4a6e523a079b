"""The one RMSNorm of rotarium, and the L2 normalisation over heads' features.

RMSNorm is ``torch.nn.RMSNorm`` (same parameters and state dict) on every device. On CUDA it runs PyTorch's fused
kernel. Elsewhere ``F.rms_norm`` is a composite of five ops, and autograd's backward of it expands the mean's gradient
over the features, so a hand-written backward takes its place: the same forward arithmetic, bit for bit, and the
norm's fwd+bwd 1.4-2.4x faster on CPU. fla's fused norm would only save a few percent on CUDA and would make
checkpoints depend on where they were trained.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(torch.autograd.Function):
    """``y = x / rms(x) * w`` over the last dim, computed in at least float32 and returned in x's dtype, as
    ``F.rms_norm``'s composite computes it. Backward: ``dx = (gw - xh mean(gw xh)) / rms(x)`` with ``gw = g w``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        inverse_rms = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        normalized = xf * inverse_rms
        ctx.save_for_backward(normalized, inverse_rms, weight)
        return (normalized * weight.to(normalized.dtype)).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        normalized, inverse_rms, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad.to(normalized.dtype) * normalized).sum_to_size(weight.shape).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normalized = grad.to(normalized.dtype) * weight.to(normalized.dtype)
            dot = (grad_normalized * normalized).mean(-1, keepdim=True)
            grad_x = grad_normalized.addcmul_(normalized, dot, value=-1.0).mul_(inverse_rms).to(grad.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the per-head norms get the kernels' bf16 outputs next to a float32 weight, a pair that
        # torch.rms_norm only runs unfused (and warns about); the weight follows the input, as autocast's matmuls do.
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        if x.device.type == "cuda":
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)
        return _RMSNorm.apply(x, weight, self.eps)


L2_EPS = 1e-12  # the norm's floor, as F.normalize's


def l2_normalize_forward(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y = x / max(|x|, eps)`` over the last dim in at least float32: ``(y, 1 / max(|x|, eps), |x| < eps)``."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    clamped = norm < eps  # there the norm is the constant eps, which passes no gradient
    inverse_norm = norm.clamp_min_(eps).reciprocal_()
    return xf * inverse_norm, inverse_norm, clamped


def l2_normalize_backward(grad: torch.Tensor, y: torch.Tensor, inverse_norm: torch.Tensor,
                          clamped: torch.Tensor) -> torch.Tensor:
    """``dx = (g - y <g, y>) / max(|x|, eps)`` in y's dtype, in one fresh contiguous buffer."""
    # contiguous whatever grad's layout (an einsum's backward hands over a permuted one): callers view the result
    product = torch.mul(grad.to(y.dtype), y, out=torch.empty(y.shape, dtype=y.dtype, device=y.device))
    dot = product.sum(-1, keepdim=True).masked_fill_(clamped, 0.0)
    # product's memory is reused for the result
    return product.copy_(grad).addcmul_(y, dot, value=-1.0).mul_(inverse_norm)


class _L2Normalize(torch.autograd.Function):
    """``y = x / max(|x|, eps)`` over the last dim, computed in at least float32.

    Backward by hand (:func:`l2_normalize_backward`): two full-size tensors where autograd's graph of
    ``F.normalize`` allocates six, and on CPU every fresh tensor of a few MB costs more in page faults than its
    arithmetic.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        y, inverse_norm, clamped = l2_normalize_forward(x, eps)
        ctx.save_for_backward(y, inverse_norm, clamped)
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return l2_normalize_backward(grad, *ctx.saved_tensors).to(grad.dtype), None


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``F.normalize(x, dim=-1)`` with a cheaper backward. x ``[..., D]``; returned in x's dtype."""
    return _L2Normalize.apply(x, eps)
