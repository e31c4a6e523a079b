"""Causal depthwise convolution over time with a decoding state: fla's ``causal_conv1d`` in PyTorch."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from rotarium.ops.utils import document_offsets, multiply_into

ACTIVATIONS = (None, "silu")


def _lagged_terms(T: int, W: int, history: torch.Tensor | None):
    """For each lag: ((output rows fed from x, x rows), (output rows fed from the history, history rows) or None)."""
    for lag in range(W):
        in_x = (slice(lag, T), slice(0, max(T - lag, 0)))
        in_history = None
        if history is not None and lag > 0:
            rows = min(lag, T)
            in_history = (slice(0, rows), slice(W - 1 - lag, W - 1 - lag + rows))
        yield lag, in_x, in_history


def _taps(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``[C, W]`` as ``[W, C]`` rows (lag l uses row ``W - 1 - l``), contiguous: broadcasting a strided
    ``[C]`` column over ``[B, T, C]`` takes PyTorch's non-vectorised path on CPU."""
    return weight.t().to(dtype).contiguous()


class _CausalDepthwiseConv(torch.autograd.Function):
    """``z_t = sum_lag w_{W-1-lag} x_{t-lag}`` (history before the first token), ``y = silu(z)`` or ``z``.

    Forward and backward by hand: each lag is one in-place multiply-add on a slice of one output buffer, where
    autograd's version allocates a tensor per lag, and two per lag again backward (see :mod:`rotarium.ops` on
    allocation).
    """

    @staticmethod
    def forward(ctx, x, weight, history, lag_masks, silu):
        T, W = x.shape[1], weight.shape[1]
        taps = _taps(weight, x.dtype)
        z = x * taps[W - 1]  # lag 0
        for lag, (out_rows, x_rows), from_history in itertools.islice(_lagged_terms(T, W, history), 1, None):
            tap = taps[W - 1 - lag]
            if from_history is not None:
                rows, hist = from_history
                z[:, rows].addcmul_(history[:, hist], tap)
            if lag_masks is not None:
                tap = tap * lag_masks[lag][:, out_rows]  # [1, rows, C]: zero across document boundaries
            z[:, out_rows].addcmul_(x[:, x_rows], tap)
        ctx.save_for_backward(x, weight, history, z if silu else None)
        ctx.lag_masks, ctx.silu = lag_masks, silu
        return F.silu(z) if silu else z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, history, z = ctx.saved_tensors
        T, W = x.shape[1], weight.shape[1]
        dz = torch.ops.aten.silu_backward(grad, z) if ctx.silu else grad
        taps = _taps(weight, x.dtype)
        grad_x = dz * taps[W - 1] if ctx.needs_input_grad[0] else None  # lag 0
        acc = torch.promote_types(weight.dtype, torch.float32)  # bf16 sums over B * T tokens would lose digits
        grad_taps = torch.zeros(W, weight.shape[0], dtype=acc, device=weight.device)
        products = torch.empty_like(dz)  # one buffer for every lag's dz * x
        for lag, (out_rows, x_rows), from_history in _lagged_terms(T, W, history):
            d = dz[:, out_rows]
            if ctx.lag_masks is not None and lag > 0:
                d = d * ctx.lag_masks[lag][:, out_rows]
            if grad_x is not None and lag > 0:
                grad_x[:, x_rows].addcmul_(d, taps[W - 1 - lag])
            product = multiply_into(products[:, out_rows], d, x[:, x_rows])
            # over time, then batch: for lags > 0 the product is a slice, and one reduction over both dims of a
            # slice takes PyTorch's strided path on CPU
            tap_grad = product.sum(1, dtype=acc).sum(0)
            if from_history is not None:
                rows, hist = from_history
                tap_grad += (dz[:, rows] * history[:, hist]).sum(1, dtype=acc).sum(0)
            grad_taps[W - 1 - lag] = tap_grad
        return grad_x, grad_taps.t().to(weight.dtype), None, None, None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y_t = act(sum_j weight[:, j] x_{t - W + 1 + j})`` per channel, over a window of W tokens.

    Args:
        x: ``[B, T, C]``.
        weight: ``[C, W]``; tap ``W - 1`` meets the current token.
        initial_state: ``[B, W - 1, C]``, the inputs before x, oldest first (zeros when None); not differentiated.
            Not with ``cu_seqlens``.
        activation: one of :data:`ACTIVATIONS`.
        cu_seqlens: int ``[N + 1]`` boundaries of sequences packed into a batch of size 1: no window reaches across.

    Returns:
        y ``[B, T, C]`` in x's dtype, and the state after x ``[B, W - 1, C]`` (its last inputs, detached): prepending
        it continues the sequence exactly; with ``cu_seqlens``, the last packed sequence.
    """
    B, T, C = x.shape
    W = weight.shape[1]
    if initial_state is not None and cu_seqlens is not None:
        # one state [1, W - 1, C] would run on into every packed sequence shorter than the window
        raise ValueError("`initial_state` cannot be combined with `cu_seqlens`: packed sequences start without a "
                         "state; run a sequence that continues a state unpacked")
    history = initial_state.detach().to(x.dtype) if initial_state is not None else None
    if T == 1 and history is not None and cu_seqlens is None:
        # One decoding step is one dot product with the window, a few ops where the general path takes many, and
        # decoding is bound by the number of ops it launches.
        window = torch.cat([history, x], 1)  # [B, W, C], oldest first: tap j meets window[:, j]
        z = (window * weight.t().to(x.dtype)).sum(1, keepdim=True)
        return (F.silu(z) if activation == "silu" else z), window[:, 1:].detach()
    # lag_masks[lag]: [1, T, 1], 0 where the token lag steps back lies in an earlier packed document
    lag_masks = None
    if cu_seqlens is not None:
        offsets = document_offsets(cu_seqlens, T)
        lag_masks = [None] + [(offsets >= lag).unsqueeze(-1).to(x.dtype) for lag in range(1, W)]
    y = _CausalDepthwiseConv.apply(x, weight, history, lag_masks, activation == "silu")
    if W == 1:
        return y, x.new_zeros(B, 0, C)
    tail = x[:, max(T - (W - 1), 0):].detach()
    if T < W - 1:  # a short input keeps part of the old window
        old = history if history is not None else x.new_zeros(B, W - 1, C)
        tail = torch.cat([old[:, T:], tail], 1)
    if cu_seqlens is not None:
        # the state continues the last sequence, which starts with no history: inputs of the sequences before it
        # are not part of its window (compared on the device, so that nothing is read back to the host)
        positions = torch.arange(T - (W - 1), T, device=x.device)
        tail = tail * (positions >= cu_seqlens[-2]).to(tail.dtype)[None, :, None]
    return y, tail
