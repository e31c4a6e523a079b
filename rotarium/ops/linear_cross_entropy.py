"""Cross-entropy through the output projection, a chunk of tokens at a time: fla's ``fused_linear_cross_entropy_loss``.

A causal LM's loss needs the ``[tokens, vocab]`` logits only long enough to turn them into a loss and a gradient. So
each chunk of tokens is projected, reduced to its loss, and its logits' gradient is turned straight away into the
gradients of the input and of the projection; the chunk's logits are then dropped. Nothing of size
``[tokens, vocab]`` is ever held, at the price of computing the gradients during the forward (the backward only
scales them by the incoming gradient), which is why this runs only where gradients are wanted or when asked.
On CUDA with fla it runs fla's Triton kernel of the same signature.

Under autocast (accelerate's bf16 mixed precision) the three products of each chunk run in the autocast dtype, the
weight cast once for all of them, and the weight's gradient sums the chunks' products in float32: the products
autocast would give a linear layer, while the softmax, the loss and the sums stay float32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rotarium.ops.backend import FLA_KERNELS, record_backend, use_fla
from rotarium.ops.utils import _autocast_enabled

REDUCTIONS = ("mean", "sum")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, weight, bias, ignore_index, label_smoothing, logit_scale, logit_softcapping,
                num_chunks, reduction):
        N, V = x.shape[0], weight.shape[0]
        needs_x, _, needs_weight, needs_bias = ctx.needs_input_grad[:4]
        valid = target != ignore_index
        # mean over the scored tokens, as F.cross_entropy (a tensor: counting them needs no host read)
        loss_scale = valid.sum().clamp_min(1).reciprocal().float() if reduction == "mean" else None
        grad_x = torch.empty_like(x) if needs_x else None
        grad_weight = None
        if needs_weight:  # the first chunk's product writes it, the others add to it: no pass to zero [V, D] first
            grad_weight = (torch.empty if N else torch.zeros)(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = torch.zeros(V, dtype=torch.float32, device=weight.device) if needs_bias else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        chunk = max(1, math.ceil(N / num_chunks))
        low = torch.get_autocast_dtype(x.device.type) if _autocast_enabled(x.device.type) else None
        # without autocast the weight gradient is summed in place, with no [V, D] temporary per chunk; under it, each
        # chunk's product goes through one low-precision [V, D] buffer (PyTorch's CPU matmul of bf16 factors cannot
        # add into a float32 sum)
        product = (torch.empty(weight.shape, dtype=low, device=weight.device)
                   if low is not None and needs_weight else None)
        w = weight if low is None else weight.to(low)
        # Every chunk's float32 logits are written into one buffer: a fresh [chunk, V] tensor per chunk is, at a
        # large vocabulary, memory the allocator maps anew each time (glibc maps blocks this large on their own), so
        # each chunk would first wait for its pages to be zeroed.
        logits = torch.empty(min(chunk, N), V, dtype=torch.float32, device=x.device)
        for start in range(0, N, chunk):
            end = min(start + chunk, N)
            x_chunk, chunk_valid = x[start:end], valid[start:end]
            if low is not None:
                x_chunk = x_chunk.to(low)  # once for the logits and the weight's gradient
            chunk_target = target[start:end].masked_fill(~chunk_valid, 0)
            # the previous chunk's other full-size temporaries are freed before this chunk's exist, not after
            z, grad_z, capped = logits[: end - start], None, None
            if w.dtype == torch.float32 and x_chunk.dtype == torch.float32:
                if bias is None:
                    torch.mm(x_chunk, w.t(), out=z)
                else:
                    torch.addmm(bias.float(), x_chunk, w.t(), out=z)
            else:
                z.copy_(F.linear(x_chunk, w, bias))
            if logit_scale != 1.0:
                z.mul_(logit_scale)
            if logit_softcapping is not None:
                capped = z.div_(logit_softcapping).tanh_()
                z = capped * logit_softcapping
            target_logit = z.gather(1, chunk_target[:, None]).squeeze(1)
            mean_logit = z.mean(-1) if label_smoothing else None
            # logsumexp in place: torch.logsumexp allocates two temporaries of the chunk's logits' size, which would
            # set the peak memory of a checkpointed training step. z becomes exp(z - max), then the softmax.
            max_logit = z.amax(-1, keepdim=True)
            sum_exp = z.sub_(max_logit).exp_().sum(-1)
            lse = sum_exp.log() + max_logit.squeeze(1)
            per_token = lse - target_logit
            if label_smoothing:
                per_token = (1 - label_smoothing) * per_token + label_smoothing * (lse - mean_logit)
            loss += per_token.masked_fill(~chunk_valid, 0).sum()
            if grad_x is None and grad_weight is None and grad_bias is None:
                continue
            # d loss / d z = softmax(z) - (1 - s) onehot(target) - s / V, zero on ignored tokens
            grad_z = z.div_(sum_exp[:, None])
            grad_z[torch.arange(end - start, device=z.device), chunk_target] -= 1 - label_smoothing
            if label_smoothing:
                grad_z.sub_(label_smoothing / V)
            grad_z.mul_(chunk_valid[:, None])
            if loss_scale is not None:
                grad_z.mul_(loss_scale)
            if capped is not None:
                grad_z.mul_(1 - capped.square())
            if logit_scale != 1.0:
                grad_z.mul_(logit_scale)
            if grad_bias is not None:
                grad_bias += grad_z.sum(0)
            if low is not None:
                grad_z = grad_z.to(low)  # once for both products
                if grad_x is not None:
                    grad_x[start:end] = grad_z @ w
                if product is not None:
                    torch.mm(grad_z.t(), x_chunk, out=product)
                    if start == 0:
                        grad_weight.copy_(product)
                    else:
                        grad_weight.add_(product)
                continue
            if grad_x is not None:
                if grad_x.dtype == w.dtype == torch.float32:
                    torch.mm(grad_z, w, out=grad_x[start:end])
                else:
                    grad_x[start:end] = grad_z.to(w.dtype) @ w
            if grad_weight is not None:
                x_chunk = x_chunk.to(grad_z.dtype)
                if start == 0:
                    torch.mm(grad_z.t(), x_chunk, out=grad_weight)
                else:
                    grad_weight.addmm_(grad_z.t(), x_chunk)
        if loss_scale is not None:
            loss = loss * loss_scale
        ctx.save_for_backward(grad_x, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        # `loss.backward()` passes exactly 1: the gradients are then returned as they are, sparing a pass over the
        # [V, D] weight gradient and a fresh buffer for it (reading the value is free on a CPU; it would make a GPU
        # wait, and break a compiled graph, so there every gradient is scaled)
        if (not torch.compiler.is_compiling() and grad_loss.device.type == "cpu"
                and grad_loss.item() == 1.0):
            return (grad_x, None, None if grad_weight is None else grad_weight.to(weight_dtype),
                    None if grad_bias is None else grad_bias.to(bias_dtype), None, None, None, None, None, None)
        scale = grad_loss.float()
        return (
            None if grad_x is None else (grad_x * scale.to(grad_x.dtype)),
            None,
            None if grad_weight is None else (grad_weight * scale).to(weight_dtype),
            None if grad_bias is None else (grad_bias * scale).to(bias_dtype),
            None, None, None, None, None, None,
        )


def fused_linear_cross_entropy_loss(
    x: torch.Tensor,
    target: torch.LongTensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    logit_softcapping: float | None = None,
    num_chunks: int = 8,
    reduction: str = "mean",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``cross_entropy(logit_scale * (x @ weight.T + bias), target)`` without materialising the logits.

    Args:
        x: ``[N, D]`` inputs of the projection (e.g. a causal LM's final hidden states, flattened).
        target: ``[N]`` int64 classes in ``[0, V)``, or ``ignore_index`` for tokens that do not count.
        weight: ``[V, D]``; bias: ``[V]`` or None.
        label_smoothing: mass spread uniformly over the V classes, as ``F.cross_entropy``'s.
        logit_scale: multiplies the logits; logit_softcapping: if given, logits become ``c * tanh(logits / c)``.
        num_chunks: the tokens are processed in this many chunks (only one chunk's ``[N / num_chunks, V]`` logits
            exist at a time).
        reduction: ``"mean"`` over the tokens that count, or ``"sum"``.
        backend: ``"auto"``, ``"torch"`` or ``"fla"`` (see :mod:`rotarium.ops.backend`).

    Returns:
        the scalar loss, float32.
    """
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"`x` must be [N, D] and `weight` [V, D] with the same D, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if target.shape != x.shape[:1] or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"`target` must be an integer tensor of shape [N] = [{x.shape[0]}], got "
                         f"{tuple(target.shape)} {target.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"`bias` must have shape [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"`label_smoothing` must be in [0, 1), got {label_smoothing}")
    if logit_softcapping is not None and not logit_softcapping > 0:
        raise ValueError(f"`logit_softcapping` must be positive or None, got {logit_softcapping}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"`num_chunks` must be a positive int, got {num_chunks!r}")
    kernel = FLA_KERNELS["fused_linear_cross_entropy_loss"]
    if record_backend("fused_linear_cross_entropy_loss", use_fla(backend, x, kernel.refusal(x))):
        from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss as fla_loss

        return fla_loss(x, target, weight, bias=bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
                        logit_scale=logit_scale, logit_softcapping=logit_softcapping, num_chunks=num_chunks,
                        reduction=reduction)
    return _LinearCrossEntropy.apply(x, target, weight, bias, ignore_index, label_smoothing, logit_scale,
                                     logit_softcapping, num_chunks, reduction)
