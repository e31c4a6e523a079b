"""The fla fast path's wiring, checked without a GPU.

Each op is told that fla's kernels can run here; fla's kernel is then replaced by a stand-in that binds the call to
the installed kernel's real signature. So every op must import its kernel from the installed fla under the name it
uses, pass only arguments that kernel names (its ``**kwargs`` would swallow a misspelt one silently), leave none of
its required ones out, and hand fla's result back unchanged: a drop-in. What the kernels compute is checked on a GPU
by ``benchmarks/gpu_check.py``.
"""
import importlib
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

from rotarium import ops
from rotarium.ops import backend as backend_module

pytest.importorskip("fla.ops")

B, T, H, K, V = 2, 8, 2, 16, 16


def inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(B, T, H, K, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype),
        "v": torch.randn(B, T, H, V, dtype=dtype),
        "g_channel": F.logsigmoid(torch.randn(B, T, H, K)).to(dtype),
        "g_head": F.logsigmoid(torch.randn(B, T, H)).to(dtype),
        "beta": torch.rand(B, T, H, dtype=dtype),
        "h0": torch.randn(B, H, K, V),
    }


# (fla's module and kernel, the call; bf16 because fla's plain chunked delta rule rejects float32, which our op
# routes to PyTorch instead)
CASES = {
    "chunk_gla": ("fla.ops.gla", "chunk_gla",
                  lambda x: ops.chunk_gla(x["q"], x["k"], x["v"], x["g_channel"], scale=0.5, initial_state=x["h0"],
                                          output_final_state=True)),
    "fused_recurrent_gla": ("fla.ops.gla", "fused_recurrent_gla",
                            lambda x: ops.fused_recurrent_gla(x["q"], x["k"], x["v"], gk=x["g_channel"],
                                                              initial_state=x["h0"], output_final_state=True)),
    "chunk_delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule",
                         lambda x: ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h0"],
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)),
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                               lambda x: ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g_head"], x["beta"],
                                                                    initial_state=x["h0"], output_final_state=True)),
    "fused_recurrent_delta_rule": ("fla.ops.delta_rule",
                                   "fused_recurrent_delta_rule",
                                   lambda x: ops.fused_recurrent_delta_rule(x["q"], x["k"], x["v"], x["beta"],
                                                                            initial_state=x["h0"],
                                                                            output_final_state=True)),
    "fused_recurrent_gated_delta_rule": ("fla.ops.gated_delta_rule",
                                         "fused_recurrent_gated_delta_rule",
                                         lambda x: ops.fused_recurrent_gated_delta_rule(
                                             x["q"], x["k"], x["v"], x["g_head"], beta=x["beta"],
                                             initial_state=x["h0"],
                                             output_final_state=True)),
    "parallel_forgetting_attn": ("fla.ops.forgetting_attn",
                                 "parallel_forgetting_attn",
                                 lambda x: ops.parallel_forgetting_attn(x["q"], x["k"], x["v"], x["g_head"])),
    "parallel_attn (g None)": ("fla.ops.attn", "parallel_attn",
                               lambda x: ops.parallel_forgetting_attn(x["q"], x["k"], x["v"], window_size=4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_op_calls_the_installed_fla_kernel_with_its_own_signature(name, monkeypatch):
    fla_module_name, kernel_name, call = CASES[name]
    monkeypatch.setattr(backend_module, "fla_device", lambda x: True)
    fla_module = importlib.import_module(fla_module_name)
    kernel = getattr(fla_module, kernel_name)
    signature = inspect.signature(kernel)
    named = {p.name for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    calls, result = [], object()

    def stand_in(*args, **kwargs):
        signature.bind(*args, **kwargs)  # TypeError on a missing required argument or a surplus positional one
        assert set(kwargs) <= named, f"{kernel_name} names no argument {sorted(set(kwargs) - named)}"
        calls.append(kwargs)
        return result

    monkeypatch.setattr(fla_module, kernel_name, stand_in)
    assert call(inputs(torch.bfloat16)) is result
    assert len(calls) == 1
    if "initial_state" in calls[0]:  # fla keeps states in float32, [N, H, K, V]
        assert calls[0]["initial_state"].dtype == torch.float32
        assert calls[0]["initial_state"].shape == (B, H, K, V)


# Each op of rotarium.ops and fla's kernel of the same name.
FLA_NAMESAKES = {**{name: case[:2] for name, case in CASES.items() if hasattr(ops, name)},
                 "fused_linear_cross_entropy_loss": ("fla.modules.fused_linear_cross_entropy",
                                                     "fused_linear_cross_entropy_loss")}


def positional_names(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]


@pytest.mark.parametrize("name", list(FLA_NAMESAKES))
def test_op_takes_positional_arguments_in_flas_order(name):
    """A positional call written for fla's kernel binds the same arguments in ours or is refused (too many
    positional arguments): our positional parameters are fla's first ones, in its order, and the rest keyword-only
    (fla puts options rotarium does not have, such as state_v_first, before cu_seqlens)."""
    module, kernel = FLA_NAMESAKES[name]
    ours = positional_names(getattr(ops, name))
    assert ours == positional_names(getattr(importlib.import_module(module), kernel))[:len(ours)]


@pytest.mark.parametrize(("backend", "requires_grad", "grad_enabled", "to_torch"), [
    ("auto", True, True, True),    # training where fla would refuse the backward: our kernel instead
    ("auto", False, True, False),  # inference keeps fla's forward, which fla runs correctly
    ("auto", True, False, False),
    ("fla", True, True, False),    # forced: fla's own error reaches the user
])
def test_gated_delta_rule_avoids_a_backward_fla_refuses(backend, requires_grad, grad_enabled, to_torch,
                                                        monkeypatch):
    chunk = importlib.import_module("rotarium.ops.delta_rule.chunk")
    monkeypatch.setattr(backend_module, "fla_device", lambda x: True)
    monkeypatch.setattr(chunk, "fla_gated_backward_refused", lambda: True)
    fla_module = importlib.import_module("fla.ops.gated_delta_rule")
    monkeypatch.setattr(fla_module, "chunk_gated_delta_rule", lambda **kwargs: ("fla", None))
    x = inputs(torch.bfloat16)
    x["q"].requires_grad_(requires_grad)
    with torch.set_grad_enabled(grad_enabled), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, _ = ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g_head"], x["beta"], backend=backend)
    assert isinstance(o, torch.Tensor) is to_torch
    assert any("Triton" in str(w.message) for w in caught) is to_torch


@pytest.mark.parametrize("name", ["chunk_delta_rule", "chunk_gated_delta_rule", "parallel_forgetting_attn"])
def test_heads_larger_than_fla_takes_run_pytorch_on_auto_and_fail_clearly_when_forced(name, monkeypatch):
    fla_module_name, kernel_name, _ = CASES[name]
    monkeypatch.setattr(backend_module, "fla_device", lambda x: True)
    monkeypatch.setattr(importlib.import_module(fla_module_name), kernel_name, lambda **kwargs: "fla")
    backend_module._warn_once.cache_clear()
    big = 2 * backend_module.FLA_MAX_HEAD_DIM
    q = torch.randn(1, 4, 1, big, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(1, 4, 1, big), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, 4, 1, 8, dtype=torch.bfloat16)
    g, beta = F.logsigmoid(torch.randn(1, 4, 1)), torch.rand(1, 4, 1, dtype=torch.bfloat16)
    call = {
        "chunk_delta_rule": lambda be: ops.chunk_delta_rule(q, k, v, beta, backend=be)[0],
        "chunk_gated_delta_rule": lambda be: ops.chunk_gated_delta_rule(q, k, v, g, beta, backend=be)[0],
        "parallel_forgetting_attn": lambda be: ops.parallel_forgetting_attn(q, k, v, g, backend=be),
    }[name]
    with pytest.warns(UserWarning, match="head sizes up to 256"):
        o = call("auto")
    assert isinstance(o, torch.Tensor) and o.shape == (1, 4, 1, 8)
    with pytest.raises(ValueError, match="head sizes up to 256"):
        call("fla")


def test_linear_cross_entropy_calls_fla_with_its_own_signature(monkeypatch):
    from rotarium.ops.linear_cross_entropy import fused_linear_cross_entropy_loss

    fla_module = importlib.import_module("fla.modules.fused_linear_cross_entropy")
    signature = inspect.signature(fla_module.fused_linear_cross_entropy_loss)
    result = object()

    def stand_in(*args, **kwargs):
        signature.bind(*args, **kwargs)
        return result

    monkeypatch.setattr(backend_module, "fla_device", lambda x: True)
    monkeypatch.setattr(fla_module, "fused_linear_cross_entropy_loss", stand_in)
    x, weight = torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(10, 4, dtype=torch.bfloat16)
    assert fused_linear_cross_entropy_loss(x, torch.zeros(6, dtype=torch.long), weight, reduction="sum") is result
