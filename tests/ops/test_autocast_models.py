"""Every family x positional option under bfloat16 autocast (accelerate's mixed precision), on CPU.

On a GPU the mixers hand q, k and v to fla's kernels, which need one dtype for the three (the autocast dtype, as fla's
own layers give them) and float32 gates; a float32 tensor beside bfloat16 ones fails there or silently runs the
slow path. So the test records what each op receives, and checks that the model's loss and gradients under autocast
stay within bfloat16 rounding of the float32 ones.

What bfloat16's 8 bits of mantissa cannot hold stays float32 under autocast, as in fla's kernels: the recurrent
state, the cumulative decays and phases (sums over thousands of tokens), softmax statistics and norms. The test
records the dtype of every exponential, logarithm, cumulative sum, softmax and norm statistic the forward and backward
run, and of the decoding states the mixers hand back.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rotarium.layers import attention, linear_attention
from rotarium.layers.state import DecodingState, KVCache
from rotarium.models import FAMILY_MODELS
from tests.models.helpers import COMBINATIONS, tiny_config

OPS = {
    linear_attention: ("chunk_gla", "fused_recurrent_gla", "chunk_delta_rule", "chunk_gated_delta_rule",
                       "fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule"),
    attention: ("parallel_forgetting_attn", "forgetting_attn_with_cache"),
}
GATES = ("g", "gk", "beta")
# aten ops whose results bfloat16 would round past use: exponentials and logarithms of gates and scores, cumulative
# sums, softmax and its statistics, and the statistics of norms
PRECISE = ("exp", "exp_", "log", "log_", "log_sigmoid_forward", "softplus", "cumsum", "cumsum_", "logcumsumexp",
           "_softmax", "_log_softmax", "logsumexp", "rsqrt", "rsqrt_", "pow", "mean", "sin", "cos")


class PreciseOps(TorchDispatchMode):
    """Counts the calls of :data:`PRECISE` ops by the dtypes of their floating-point inputs (below autocast, so
    what each op actually runs in)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[tuple[str, tuple[torch.dtype, ...]]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRECISE:
            dtypes = tuple(sorted({a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()},
                                  key=str))
            self.calls[name, dtypes] += 1
        return func(*args, **(kwargs or {}))


def state_tensors(value, name: str = "state") -> dict[str, torch.Tensor]:
    """Every tensor of a decoding state (:mod:`rotarium.layers.state`) by its path."""
    if isinstance(value, torch.Tensor):
        return {name: value}
    if isinstance(value, KVCache):
        fields = {"keys": value.keys, "values": value.values, "log_decay_cumsum": value.log_decay_cumsum}
    elif isinstance(value, DecodingState):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        return {}
    return {path: t for key, field in fields.items() for path, t in state_tensors(field, f"{name}.{key}").items()}


# the fields of the decoding states that accumulate over the sequence
ACCUMULATED = ("recurrent", "theta", "log_decay_cumsum")


@pytest.fixture
def received(monkeypatch) -> list[tuple[str, dict[str, torch.dtype]]]:
    """The dtypes of the tensors each mixer op is called with, in call order."""
    calls: list[tuple[str, dict[str, torch.dtype]]] = []
    for module, names in OPS.items():
        for name in names:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _recording(getattr(module, name), name, calls))
    return calls


def _recording(op, name: str, calls: list):
    # the gates that follow q, k, v positionally, per op
    positional = ("g", "beta") if name.endswith("gated_delta_rule") else (
        ("beta",) if "delta_rule" in name else ("g",))

    @functools.wraps(op)
    def recording(*args, **kwargs):
        dtypes = dict(zip(("q", "k", "v"), (a.dtype for a in args[:3])))
        dtypes.update({n: a.dtype for n, a in zip(positional, args[3:]) if isinstance(a, torch.Tensor)})
        dtypes.update({k: v.dtype for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        calls.append((name, dtypes))
        return op(*args, **kwargs)

    return recording


def model_for(family: str, position_encoding: str):
    overrides = {"qk_norm": True} if family in ("fox", "transformer") else {}
    torch.manual_seed(0)
    return FAMILY_MODELS[family].lm(tiny_config(family, position_encoding, **overrides)).train()


def loss_and_grads(model, ids, autocast: bool):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def autocast_states(model, ids) -> dict[str, torch.Tensor]:
    """The decoding states of every layer after a forward of ``ids`` under bfloat16 autocast."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model(input_ids=ids, use_cache=True).past_key_values
    return {f"layer {i}.{path}": t for i, layer in enumerate(cache.layers)
            for path, t in state_tensors(layer.state).items()}


@pytest.mark.parametrize(("family", "position_encoding"), COMBINATIONS)
def test_bf16_autocast_hands_the_ops_one_dtype_and_stays_close_to_float32(family, position_encoding, received):
    model = model_for(family, position_encoding)
    ids = torch.randint(2, 61, (2, 40), generator=torch.Generator().manual_seed(1))
    loss_fp32, grads_fp32 = loss_and_grads(model, ids, autocast=False)
    received.clear()
    with PreciseOps() as precise:
        loss_bf16, grads_bf16 = loss_and_grads(model, ids, autocast=True)

    assert precise.calls, "no exponential, cumulative sum or norm was recorded"
    in_bf16 = {call: n for call, n in precise.calls.items() if torch.bfloat16 in call[1]}
    assert not in_bf16, f"ran in bfloat16 under autocast: {in_bf16}"
    states = autocast_states(model, ids)
    accumulated = {path: t.dtype for path, t in states.items() if path.rsplit(".", 1)[-1] in ACCUMULATED}
    assert all(dtype == torch.float32 for dtype in accumulated.values()), accumulated
    if family in ("gla", "deltanet"):
        assert any(path.endswith(".recurrent") for path in accumulated), states.keys()
    if position_encoding == "selective_rope":
        assert any(path.endswith(".theta") for path in accumulated), states.keys()

    assert received, "no mixer op was called"
    for op, dtypes in received:
        assert dtypes["q"] == dtypes["k"] == dtypes["v"] == torch.bfloat16, (op, dtypes)
        for gate in GATES:
            if gate in dtypes:
                assert dtypes[gate] == torch.float32, (op, gate, dtypes)
    assert abs(loss_bf16 - loss_fp32) <= 2e-2 * loss_fp32
    assert grads_bf16.keys() == grads_fp32.keys()
    total = torch.cat([g.flatten() for g in grads_fp32.values()])
    difference = torch.cat([(grads_bf16[n] - g).flatten() for n, g in grads_fp32.items()])
    assert difference.norm() <= 0.1 * total.norm()
