"""Every family x positional option under bfloat16 autocast (accelerate's mixed precision), on CPU.

On a GPU the mixers hand q, k and v to fla's kernels, which need one dtype for the three (the autocast dtype, as fla's
own layers give them) and float32 gates; a float32 tensor beside bfloat16 ones fails there or silently runs the
slow path. So the test records what each op receives, and checks that the model's loss and gradients under autocast
stay within bfloat16 rounding of the float32 ones.
"""
from __future__ import annotations

import functools

import pytest
import torch

from rotarium.layers import attention, linear_attention
from rotarium.models import FAMILY_MODELS
from tests.models.helpers import COMBINATIONS, tiny_config

OPS = {
    linear_attention: ("chunk_gla", "fused_recurrent_gla", "chunk_delta_rule", "chunk_gated_delta_rule",
                       "fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule"),
    attention: ("parallel_forgetting_attn", "forgetting_attn_with_cache"),
}
GATES = ("g", "gk", "beta")


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


@pytest.mark.parametrize(("family", "position_encoding"), COMBINATIONS)
def test_bf16_autocast_hands_the_ops_one_dtype_and_stays_close_to_float32(family, position_encoding, received):
    model = model_for(family, position_encoding)
    ids = torch.randint(2, 61, (2, 40), generator=torch.Generator().manual_seed(1))
    loss_fp32, grads_fp32 = loss_and_grads(model, ids, autocast=False)
    received.clear()
    loss_bf16, grads_bf16 = loss_and_grads(model, ids, autocast=True)

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
