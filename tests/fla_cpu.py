"""flash-linear-attention's own layers and models, run on CPU: the oracle of the conversion tests
(tests/hub/test_convert.py) and of the GPU check's fla peers.

fla's norms, short convolution, activations and kernels are Triton, which needs a GPU. :func:`fla_on_cpu` swaps,
while it is active, exactly those leaves for PyTorch equivalents, each under the name the fla module that calls it
looks up, so that fla's own classes still decide the structure: which projections, gates, norms and normalisers,
in which order. The kernels become fla's own references (``fla/ops/*/naive.py``: GLA, the delta rule, the gated
delta rule with fla's ``naive_gdn_gate``, forgetting attention) behind fla's kernel signatures, layout
``[B, T, H, D]``, ``scale``, ``initial_state`` / ``output_final_state``, ``state_v_first`` and packed sequences
(``cu_seqlens``) included; the one kernel without a reference, forgetting attention's one-token decoding, is written
out here. The norms, the convolution (with its ``[N, D, W]`` cache) and the gated activations are their plain
formulas, computed in float32 as fla's kernels compute them.

:func:`tiny_fla_model` builds small random models of the four fla model types that run on CPU.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from fla.models import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    ForgettingTransformerConfig,
    ForgettingTransformerForCausalLM,
    GatedDeltaNetConfig,
    GatedDeltaNetForCausalLM,
    GLAConfig,
    GLAForCausalLM,
)
from fla.modules import FusedRMSNormGated, GroupNorm, RMSNorm, ShortConvolution
from fla.ops.delta_rule.naive import delta_rule_recurrence
from fla.ops.forgetting_attn.naive import naive_forgetting_attn
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.gla.naive import naive_recurrent_gla
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

# fla's l2norm_fwd, used by its kernels' `use_qk_l2norm_in_kernel`: x / sqrt(|x|^2 + eps)
L2NORM_EPS = 1e-6


def _unsupported(**options: object) -> None:
    """Raises for an option of fla's kernel signature that the four models never set and the stand-in leaves out."""
    given = [name for name, value in options.items() if value is not None and value is not False]
    if given:
        raise NotImplementedError(f"the CPU stand-in of this fla kernel does not implement {given}")


def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(n, bos, eos)`` of each sequence packed along time (FlashAttention's ``cu_seqlens``)."""
    bounds = cu_seqlens.tolist()
    return [(n, bos, eos) for n, (bos, eos) in enumerate(itertools.pairwise(bounds))]


def _per_sequence(kernel: Callable, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None,
                  output_final_state: bool, **tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs a recurrent ``kernel`` on each packed sequence of the ``[1, T, ...]`` token tensors, each from its own
    initial state ``[N, ...]``: ``(outputs packed again [1, T, ...], final states [N, ...] or None)``."""
    outputs, states = [], []
    for n, bos, eos in _segments(cu_seqlens):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, ht = kernel(initial_state=h0, output_final_state=output_final_state,
                       **{name: None if x is None else x[:, bos:eos] for name, x in tokens.items()})
        outputs.append(o)
        states.append(ht)
    return torch.cat(outputs, 1), torch.cat(states) if output_final_state else None


def _rescale_queries(q: torch.Tensor, scale: float | None) -> torch.Tensor:
    """fla's references fix the scale at ``K ** -0.5``: a kernel's other ``scale`` is folded into q."""
    return q if scale is None else q * (scale * q.shape[-1] ** 0.5)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def _swap_state(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """fla's ``state_v_first`` states are ``[N, H, V, K]``; the references keep ``[N, H, K, V]``."""
    return state.transpose(-1, -2).contiguous() if state is not None and state_v_first else state


# ----------------------------------------------------------------------------------------------- kernels: GLA

def _gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, scale: float | None,
         initial_state: torch.Tensor | None, output_final_state: bool, state_v_first: bool,
         cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``S_t = diag(exp(gk_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``; q, k, gk ``[B, T, H, K]``."""
    if cu_seqlens is not None:
        return _per_sequence(lambda **x: _gla(**x, scale=scale, state_v_first=state_v_first, cu_seqlens=None),
                             cu_seqlens, initial_state, output_final_state, q=q, k=k, v=v, gk=gk)
    o, ht = naive_recurrent_gla(_rescale_queries(q, scale), k, v, gk, _swap_state(initial_state, state_v_first),
                                output_final_state)
    return o, _swap_state(ht, state_v_first)


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None):
    return _gla(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
    _unsupported(gv=gv, reverse=reverse)
    gk = torch.zeros_like(q) if gk is None else gk
    return _gla(q, k, v, gk, scale, initial_state, output_final_state, state_v_first, cu_seqlens)


# -------------------------------------------------------------------------------------- kernels: delta rules

def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float | None,
                initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``; beta ``[B, T, H]``."""
    if cu_seqlens is not None:
        return _per_sequence(
            lambda **x: _delta_rule(**x, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                    cu_seqlens=None),
            cu_seqlens, initial_state, output_final_state, q=q, k=k, v=v, beta=beta)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    beta = torch.ones_like(q[..., 0]) if beta is None else beta
    # the reference reads [B, H, T, ...]
    o, ht = delta_rule_recurrence(*(x.transpose(1, 2) for x in (_rescale_queries(q, scale), k, v, beta)),
                                  initial_state=initial_state, output_final_state=output_final_state)
    return o.transpose(1, 2), ht


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    return _delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    return _delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                      beta: torch.Tensor | None, scale: float | None, initial_state: torch.Tensor | None,
                      output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                      allow_neg_eigval: bool, state_v_first: bool, use_gate_in_kernel: bool,
                      A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with ``HV`` a multiple of ``H`` (value head ``j`` reads q/k head
    ``j // (HV / H)``); g, beta ``[B, T, HV]``, raw (gate ``-exp(A_log) softplus(g + dt_bias)``, ``sigmoid(beta)``,
    doubled with ``allow_neg_eigval``) when the kernel applies them.
    """
    if cu_seqlens is not None:
        return _per_sequence(
            lambda **x: _gated_delta_rule(
                **x, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                state_v_first=state_v_first, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                cu_seqlens=None),
            cu_seqlens, initial_state, output_final_state, q=q, k=k, v=v, g=g, beta=beta)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    g = torch.zeros_like(v[..., 0], dtype=torch.float32) if g is None else g
    beta = torch.ones_like(v[..., 0]) if beta is None else beta
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    group = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (_rescale_queries(q, scale), k))
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=_swap_state(initial_state, state_v_first),
                                             output_final_state=output_final_state)
    return o.to(v.dtype), _swap_state(ht, state_v_first)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, use_gate_in_kernel=False, A_log=None, dt_bias=None, **kwargs):
    _unsupported(cp_context=cp_context)
    return _gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, use_gate_in_kernel, A_log,
                             dt_bias, cu_seqlens)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, **kwargs):
    _unsupported(gk=gk, gv=gv)
    return _gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, use_gate_in_kernel, A_log,
                             dt_bias, cu_seqlens)


# ------------------------------------------------------------------------------ kernels: forgetting attention

def parallel_forgetting_attn(q, k, v, g, scale=None, window_size=None, cu_seqlens=None):
    """``o_i = sum_{j<=i} softmax_j(scale q_i.k_j + c_i - c_j) v_j``, ``c = cumsum(g)``; g ``[B, T, HQ]``."""
    if cu_seqlens is None:
        return naive_forgetting_attn(q, k, v, g, scale, window_size).to(q.dtype)
    return torch.cat([naive_forgetting_attn(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], g[:, bos:eos], scale,
                                            window_size).to(q.dtype)
                      for _, bos, eos in _segments(cu_seqlens)], 1)


def attn_decoding_one_step(q, k, v, g=None, scale=None, cu_seqlens=None, do_gate_scale=False, *, window_size=None,
                           sink_bias=None):
    """One query per packed key sequence, at its end: q ``[1, N, HQ, K]``, k / v ``[1, T, H, ...]`` packed by
    ``cu_seqlens`` (the keys' lengths), g ``[1, T, HQ]`` the keys' log forget gates. fla has no reference for it,
    so it is written out: ``o_n = sum_j softmax_j(scale q_n.k_j + c_last - c_j) v_j`` over the sequence's keys."""
    _unsupported(do_gate_scale=do_gate_scale, window_size=window_size, sink_bias=sink_bias)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    outputs = []
    for n, bos, eos in _segments(cu_seqlens):
        keys, values = (x[0, bos:eos].float().repeat_interleave(group, dim=1) for x in (k, v))  # [S, HQ, D]
        logits = torch.einsum("hd,shd->hs", q[0, n].float() * scale, keys)
        if g is not None:
            c = g[0, bos:eos].float().cumsum(0)  # [S, HQ]
            logits = logits + (c[-1] - c).t()
        outputs.append(torch.einsum("hs,shd->hd", logits.softmax(-1), values))
    return torch.stack(outputs)[None].to(q.dtype)


# ------------------------------------------------------------------------------------- short convolution

def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    """Causal depthwise convolution: ``y_t = act(sum_w weight[:, w] x_{t-W+1+w} + bias) + residual``.

    x ``[B, T, D]``, weight ``[D, W]``. The state is ``[N, D, W]``: the last W inputs, newest last, of which the
    next call reads the W - 1 newest as the inputs before its first token.
    """
    _unsupported(cp_context=cp_context)
    if cu_seqlens is not None:
        return _per_sequence(
            lambda **a: causal_conv1d(**a, weight=weight, bias=bias, activation=activation),
            cu_seqlens, initial_state, output_final_state, x=x, residual=residual)
    B, T, D = x.shape
    W = weight.shape[1]
    history = x.new_zeros(B, D, W) if initial_state is None else initial_state
    window = torch.cat([history.float(), x.float().transpose(1, 2)], -1)  # [B, D, W + T]; x_t at W + t
    y = sum(window[..., 1 + w:1 + w + T] * weight[:, w, None].float() for w in range(W)).transpose(1, 2)
    if bias is not None:
        y = y + bias.float()
    if activation in ("silu", "swish"):
        y = F.silu(y)
    if residual is not None:
        y = y + residual.float()
    final_state = window[..., -W:].to(x.dtype).contiguous() if output_final_state else None
    return y.to(x.dtype), final_state


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """One token per sequence (x ``[N, 1, D]``, ``[1, N, D]`` or ``[N, D]``); updates ``cache`` ``[N, D, W]`` in
    place, as fla's kernel does, and returns ``(y in x's shape, cache)``."""
    D = x.shape[-1]
    window = torch.cat([cache[..., 1:].float(), x.reshape(-1, D, 1).float()], -1)
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation in ("silu", "swish"):
        y = F.silu(y)
    if residual is not None:
        y = y + residual.reshape(-1, D).float()
    cache.copy_(window)
    return y.view(x.shape).to(x.dtype), cache


# ------------------------------------------------------------------------------------------------------ norms

def _normalized(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None,
                eps: float, residual_in_fp32: bool, num_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS normalisation over groups of the last dim, in float32, after adding the residual: ``(y in float32, the
    sum x + residual in the dtype fla's kernels store it)``."""
    summed = x.float() if residual is None else x.float() + residual.float()
    groups = summed.unflatten(-1, (num_groups, -1))
    y = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    stored = residual.dtype if residual is not None else torch.float32 if residual_in_fp32 else x.dtype
    return y, summed.to(stored)


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    y, summed = _normalized(x, weight, bias, residual, eps, residual_in_fp32)
    return (y.to(x.dtype), summed) if prenorm else y.to(x.dtype)


def group_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False,
               num_groups=1):
    if not is_rms_norm:
        raise NotImplementedError("the CPU stand-in of fla's group_norm implements its RMS form only")
    y, summed = _normalized(x, weight, bias, residual, eps, residual_in_fp32, num_groups)
    return (y.to(x.dtype), summed) if prenorm else y.to(x.dtype)


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):
    """``RMSNorm(x) * silu(g)`` (``swish`` / ``silu``) or ``* sigmoid(g)``."""
    y, summed = _normalized(x, weight, bias, residual, eps, residual_in_fp32)
    gate = g.float()
    y = y * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))
    return (y.to(x.dtype), summed) if prenorm else y.to(x.dtype)


# -------------------------------------------------------------------------------------------- activations

def swiglu(x, y):
    return F.silu(x) * y


def swiglu_linear(x, y, weight, bias):
    return F.linear(F.silu(x) * y, weight, bias)


def elu_p1(x):
    return F.elu(x) + 1


# ACT2FN's swish and sigmoid are autograd Functions whose forward and backward call these Triton helpers.
def swish_fwd(x, output_contiguous=False):
    return F.silu(x)


def swish_bwd(x, dy, output_contiguous=False):
    s = torch.sigmoid(x)
    return dy * s * (1 + x * (1 - s))


def sigmoid_fwd(x, output_contiguous=False):
    return torch.sigmoid(x)


def sigmoid_bwd(x, dy, output_contiguous=False):
    s = torch.sigmoid(x)
    return dy * s * (1 - s)


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """fla's fused loss as fla's models build it (no label smoothing, no z-loss): PyTorch's loss."""

    def __init__(self, inplace_backward: bool = False, reduction: str = "mean"):
        super().__init__(reduction=reduction)


# fla module -> {the name it looks a Triton leaf up by: the stand-in}
LEAVES: dict[str, dict[str, Callable]] = {
    "fla.layers.gla": {"chunk_gla": chunk_gla, "fused_recurrent_gla": fused_recurrent_gla},
    "fla.layers.delta_net": {"chunk_delta_rule": chunk_delta_rule,
                             "fused_recurrent_delta_rule": fused_recurrent_delta_rule, "elu_p1": elu_p1},
    # causal_conv1d: its one convolution over the concatenated q, k, v when no cache is involved
    "fla.layers.gated_deltanet": {"chunk_gated_delta_rule": chunk_gated_delta_rule,
                                  "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
                                  "causal_conv1d": causal_conv1d},
    "fla.layers.forgetting_attn": {"parallel_forgetting_attn": parallel_forgetting_attn,
                                   "attn_decoding_one_step": attn_decoding_one_step},
    # RMSNorm.forward and GroupNorm.forward
    "fla.modules.norm.layernorm": {"rms_norm": rms_norm, "group_norm": group_norm},
    # FusedRMSNormGated.forward
    "fla.modules.norm.fused_norm_gate": {"rms_norm_gated": rms_norm_gated},
    # ShortConvolution.forward and ShortConvolution.step
    "fla.modules.causal_conv1d.ops": {"causal_conv1d": causal_conv1d, "causal_conv1d_update": causal_conv1d_update},
    # GatedMLP
    "fla.modules.mlp": {"swiglu": swiglu, "swiglu_linear": swiglu_linear},
    # ACT2FN["swish"] / ["silu"] / ["sigmoid"]: GLA's unfused output gate and its feature maps
    "fla.modules.activations.ops": {"swish_fwd": swish_fwd, "swish_bwd": swish_bwd, "sigmoid_fwd": sigmoid_fwd,
                                    "sigmoid_bwd": sigmoid_bwd},
    # the loss of FLAForCausalLM when labels are given
    "fla.models.modeling_utils": {"FusedCrossEntropyLoss": CrossEntropyLoss},
}


@contextlib.contextmanager
def fla_on_cpu() -> Iterator[None]:
    """While active, fla's GLA, DeltaNet, Gated DeltaNet and Forgetting Transformer run on CPU (see the module's
    docstring); every name is restored on exit. A name missing from fla (another fla version) raises."""
    with contextlib.ExitStack() as stack:
        for module_name, replacements in LEAVES.items():
            module = importlib.import_module(module_name)
            for name, replacement in replacements.items():
                stack.enter_context(mock.patch.object(module, name, replacement))
        yield


# ----------------------------------------------------------------------------------------------- tiny models

MODEL_TYPES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "gla": (GLAConfig, GLAForCausalLM),
    "delta_net": (DeltaNetConfig, DeltaNetForCausalLM),
    "gated_deltanet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM),
    "forgetting_transformer": (ForgettingTransformerConfig, ForgettingTransformerForCausalLM),
}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 128}
# Gated DeltaNet sizes its heads by `head_dim` (fla's default 256), not by hidden_size / num_heads.
TINY_OVERRIDES = {"gated_deltanet": {"head_dim": 16}}
NORMS = (RMSNorm, GroupNorm, FusedRMSNormGated, nn.RMSNorm)


def tiny_fla_config(model_type: str, **overrides) -> PretrainedConfig:
    """fla's config of ``model_type`` (a key of :data:`MODEL_TYPES`) at the tiny size, fla's defaults otherwise."""
    config_class, _ = MODEL_TYPES[model_type]
    return config_class(**{**TINY, **TINY_OVERRIDES.get(model_type, {}), **overrides})


def spread_parameters(model: nn.Module, seed: int) -> None:
    """Redraws every parameter so that each one shapes the output: at fla's init (std 0.02, unit norm weights, zero
    biases) gates and norms sit near constants, and a conversion that mishandled them would still match. Linear and
    convolution weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ U(0.5, 1.5), biases ~ N(0, 0.5^2).
    Gated DeltaNet's ``A_log`` and ``dt_bias`` keep fla's own random init, which is already spread over heads."""
    generator = torch.Generator().manual_seed(seed)

    def draw(p: nn.Parameter, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=generator) * std)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, ShortConvolution)):
                draw(module.weight, module.weight[0].numel() ** -0.5)
            elif isinstance(module, nn.Embedding):
                draw(module.weight, 1.0)
            elif isinstance(module, NORMS) and module.weight is not None:
                module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
            if getattr(module, "bias", None) is not None:
                draw(module.bias, 0.5)


def tiny_fla_model(model_type: str, seed: int = 0, spread: bool = True, **overrides) -> PreTrainedModel:
    """A float32 fla causal LM of ``model_type`` (hidden 64, 2 layers, 4 heads, vocab 128 unless overridden) with
    deterministic random parameters, in eval mode; it runs on CPU inside :func:`fla_on_cpu`.

    ``spread`` redraws the parameters (:func:`spread_parameters`) so that gates and norm weights matter; without it
    the model keeps fla's own initialisation, whose small q and k expose normalisers' epsilons (the delta rule's L2
    norm) that spread parameters hide. An equivalence test needs both.
    """
    config = tiny_fla_config(model_type, **overrides)
    _, model_class = MODEL_TYPES[model_type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    if spread:
        spread_parameters(model, seed)
    return model.float().eval()
