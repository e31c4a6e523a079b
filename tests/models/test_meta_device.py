"""The CUDA path's proxies that a CPU can run: every model on the ``meta`` device, with fla's kernels.

Meta tensors have shapes and dtypes but no values and no storage, so a forward and backward on them fails on the
two things that would break or stall a GPU run: a tensor the layers create on another device (mixing it with a meta
tensor raises), and any read of a tensor's values (``.item()``, ``.tolist()``, ``bool()``: a host-device
synchronisation on CUDA, impossible on meta). The ops are told that fla can run here, and fla's kernels are replaced
by stand-ins that bind each call to the installed kernel's signature and return outputs of the right shapes, so the
whole fast path runs: the layers, our ops' validation and dispatch, and the calls into fla.
"""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from rotarium.layers import LinearAttentionState, SequenceInfo
from rotarium.models import FAMILY_MODELS
from rotarium.ops import backend
from rotarium.ops.backend import count_dispatches
from tests.models.helpers import COMBINATIONS, tiny_config

pytest.importorskip("fla.ops")


def _linear_output(q, k, v, gate=None, beta=None, initial_state=None, output_final_state=False, **_):
    score = (q * k).sum(-1, keepdim=True)
    if gate is not None:
        score = score + (gate.sum(-1, keepdim=True) if gate.ndim == 4 else gate[..., None])
    if beta is not None:
        score = score * beta[..., None]
    o = v * score.to(v.dtype)
    state = None
    if output_final_state:
        B, _, H, K = q.shape
        state = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
        if initial_state is not None:
            state = state + initial_state
    return o, state


def _attention_output(q, k, v, g=None, **_):
    group = q.shape[2] // k.shape[2]
    o = v.repeat_interleave(group, 2) * (q * k.repeat_interleave(group, 2)).sum(-1, keepdim=True)
    if g is not None:
        o = o * g[..., None].to(o.dtype)
    return o


STAND_INS = {
    ("fla.ops.gla", "chunk_gla"): lambda **a: _linear_output(a["q"], a["k"], a["v"], a["g"], **_rest(a, "g")),
    ("fla.ops.gla", "fused_recurrent_gla"): lambda **a: _linear_output(a["q"], a["k"], a["v"], a["gk"],
                                                                         **_rest(a, "gk")),
    ("fla.ops.delta_rule", "chunk_delta_rule"): lambda **a: _linear_output(**a),
    ("fla.ops.delta_rule", "fused_recurrent_delta_rule"): lambda **a: _linear_output(**a),
    ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"): lambda **a: _linear_output(
        a["q"], a["k"], a["v"], a["g"], **_rest(a, "g")),
    ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"): lambda **a: _linear_output(
        a["q"], a["k"], a["v"], a["g"], **_rest(a, "g")),
    ("fla.ops.forgetting_attn", "parallel_forgetting_attn"): lambda **a: _attention_output(**a),
    ("fla.ops.attn", "parallel_attn"): lambda **a: _attention_output(**a),
    ("fla.modules.fused_linear_cross_entropy", "fused_linear_cross_entropy_loss"): lambda x, target, weight, **_: (
        x @ weight.t()).float().mean(),
}


def _rest(arguments: dict, *taken: str) -> dict:
    return {k: v for k, v in arguments.items() if k not in {"q", "k", "v", *taken}}


@pytest.fixture
def fla_on_meta(monkeypatch):
    """fla "runs" on meta tensors, through stand-ins checked against each installed kernel's signature."""
    monkeypatch.setattr(backend, "fla_device", lambda x: x.device.type == "meta")
    for (module_name, kernel_name), stand_in in STAND_INS.items():
        module = importlib.import_module(module_name)
        signature = inspect.signature(getattr(module, kernel_name))
        named = {p.name for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD}

        def checked(*args, _fn=stand_in, _signature=signature, _named=named, _kernel=kernel_name, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            assert set(kwargs) <= _named, f"{_kernel} names no argument {sorted(set(kwargs) - _named)}"
            return _fn(**bound.arguments)

        monkeypatch.setattr(module, kernel_name, checked)


def meta_model(family: str, position_encoding: str, **overrides):
    config = tiny_config(family, position_encoding, **overrides)
    with torch.device("meta"):
        model = FAMILY_MODELS[family].lm(config)
    # bfloat16 as on a GPU: fla's plain delta rule refuses float32, which our op would send to the PyTorch path
    return model.to(torch.bfloat16).train()


def qk_norm_overrides(family: str) -> dict:
    return {"qk_norm": True} if family in ("fox", "transformer") else {}


@pytest.mark.parametrize(("family", "position_encoding"), COMBINATIONS)
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_training_step_on_meta_runs_the_fla_path_without_reading_a_value(family, position_encoding, packed,
                                                                          fla_on_meta):
    model = meta_model(family, position_encoding, **qk_norm_overrides(family))
    if packed:
        ids = torch.zeros(1, 24, dtype=torch.long, device="meta")
        kwargs = {"cu_seqlens": torch.zeros(4, dtype=torch.long, device="meta")}
    else:
        ids = torch.zeros(2, 24, dtype=torch.long, device="meta")
        kwargs = {}
    with count_dispatches() as calls:
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
        loss.backward()
    assert loss.device.type == "meta"
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert calls, "no op was called"
    assert {ran_on for _, ran_on in calls} == {"fla"}, f"ops that left the fla path: {calls}"


@pytest.mark.parametrize("family", ["gla", "deltanet"])
def test_linear_mixers_train_through_a_state_with_the_chunked_kernel(family, fla_on_meta):
    """fla's step-wise kernels are inference-only: a short input continuing from a state with gradients on must
    take the chunked kernel, and without gradients the step-wise one."""
    model = meta_model(family, "rope", **({"use_gated_delta": True} if family == "deltanet" else {}))
    mixer = model.model.layers[0].mixer
    x = torch.zeros(2, 3, model.config.hidden_size, device="meta", dtype=torch.bfloat16, requires_grad=True)
    key = mixer.head_k_dim
    state = LinearAttentionState(torch.zeros(2, mixer.num_heads, key, mixer.head_v_dim, device="meta"))
    with count_dispatches() as calls:
        out, _ = mixer(x, SequenceInfo.build(x), state, use_cache=True)
        out.sum().backward()
    assert all(op.startswith("chunk_") for op, _ in calls), calls
    with count_dispatches() as calls, torch.no_grad():
        mixer(x.detach(), SequenceInfo.build(x), state, use_cache=True)
    assert all(op.startswith("fused_recurrent_") for op, _ in calls), calls
