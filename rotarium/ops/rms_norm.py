"""RMSNorm over the last dim, ``y = x / sqrt(mean(x^2) + eps) * w``: fla's ``rms_norm`` without bias or residual.

On CUDA it runs PyTorch's fused kernel. Elsewhere ``F.rms_norm`` is a composite of five ops whose autograd backward
expands the mean's gradient over the features, so a hand-written backward takes its place, after the same forward
arithmetic. fla's fused norm is not used: it would save little on CUDA and make the numbers of a checkpoint depend on
where it was trained.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    """Computed in at least float32 and returned in x's dtype, as ``F.rms_norm``'s composite computes it. Backward:
    ``dx = (gw - xh mean(gw xh)) / rms(x)`` with ``gw = g w``."""

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


def fused_kernel_available(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x ``[..., D]`` normalised by its root mean square over D and scaled by weight ``[D]``; in x's dtype."""
    if fused_kernel_available(x):
        # CUDA autocast runs F.rms_norm in float32 and returns float32: normalised bfloat16 queries and keys would
        # then meet bfloat16 values in one op, which needs one dtype
        return F.rms_norm(x, weight.shape, weight, eps).to(x.dtype)
    return _RMSNorm.apply(x, weight, eps)
