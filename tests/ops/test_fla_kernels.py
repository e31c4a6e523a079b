"""The table of what fla can do (rotarium.ops.backend.FLA_KERNELS), and the recurrent ops, which run what they are
asked: the choice between step-wise and chunked kernels is the mixers' (tests/layers/test_kernel_choice.py)."""
import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rotarium
from rotarium import ops
from rotarium.ops.backend import FLA_KERNELS, FLA_MAX_HEAD_DIM, count_dispatches
from rotarium.ops.delta_rule import naive_delta_rule, naive_gated_delta_rule
from rotarium.ops.gla import naive_recurrent_gla
from tests.asserts import assert_close

PACKAGE = Path(rotarium.__file__).parent


def fla_kernels_imported() -> set[str]:
    """Every name rotarium imports from fla's kernels and modules (fla.utils holds flags, not kernels)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("fla.ops", "fla.modules")):
                names.update(alias.name for alias in node.names)
    return names


def test_every_fla_kernel_rotarium_calls_has_a_row():
    imported = fla_kernels_imported()
    assert imported, "no fla import found: the scan is broken"
    assert imported <= set(FLA_KERNELS), sorted(imported - set(FLA_KERNELS))


def test_rows_give_the_reasons_the_ops_report():
    big = torch.zeros(1, 1, 1, 2 * FLA_MAX_HEAD_DIM, dtype=torch.bfloat16)
    small = torch.zeros(1, 1, 1, 16)
    plain, gated = FLA_KERNELS["chunk_delta_rule"], FLA_KERNELS["chunk_gated_delta_rule"]
    assert plain.refusal(big) == f"fla's chunk_delta_rule supports head sizes up to 256, got K = {2 * FLA_MAX_HEAD_DIM}"
    assert plain.refusal(big.float()).startswith("fla's chunk_delta_rule supports head sizes")  # heads first
    assert "float32" in plain.refusal(small)
    assert plain.refusal(small.bfloat16()) is None
    assert gated.refusal(small) is None  # the gated rule takes float32
    assert "Triton" in gated.backward_refusal and gated.backward_refused is not None
    assert FLA_KERNELS["parallel_attn"].refusal(big).startswith("fla's parallel attention supports")
    assert FLA_KERNELS["chunk_gla"].refusal(big) is None


def test_rows_say_which_kernels_rotarium_trains_through():
    decoding = FLA_KERNELS["attn_decoding_one_step"]
    assert decoding.serves(1, needs_grad=False)
    assert not decoding.serves(2, needs_grad=False)
    assert not decoding.serves(1, needs_grad=True)
    assert not FLA_KERNELS["fused_recurrent_gated_delta_rule"].trains
    assert not FLA_KERNELS["fused_recurrent_delta_rule"].trains
    assert FLA_KERNELS["fused_recurrent_gla"].serves(100, needs_grad=True)
    for name, row in FLA_KERNELS.items():
        assert row.trains == (row.backward is None), name
        assert (row.backward_refused is None) == (row.backward_refusal is None), name


def recurrent_inputs(T: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    B, H, K, V = 2, 2, 8, 16
    return {"q": torch.randn(B, T, H, K), "k": F.normalize(torch.randn(B, T, H, K), dim=-1),
            "v": torch.randn(B, T, H, V), "gk": F.logsigmoid(torch.randn(B, T, H, K)),
            "g": F.logsigmoid(torch.randn(B, T, H)), "beta": torch.rand(B, T, H), "h0": torch.randn(B, H, K, V)}


CALLS = {
    "fused_recurrent_gla": (
        lambda x: ops.fused_recurrent_gla(x["q"], x["k"], x["v"], gk=x["gk"], initial_state=x["h0"],
                                          output_final_state=True),
        lambda x: naive_recurrent_gla(x["q"], x["k"], x["v"], gk=x["gk"], initial_state=x["h0"],
                                      output_final_state=True)),
    "fused_recurrent_delta_rule": (
        lambda x: ops.fused_recurrent_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h0"],
                                                 output_final_state=True),
        lambda x: naive_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h0"],
                                   output_final_state=True)),
    "fused_recurrent_gated_delta_rule": (
        lambda x: ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                       initial_state=x["h0"], output_final_state=True),
        lambda x: naive_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                         output_final_state=True)),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("T", [0, 1, 100])  # 100: past a chunk, where the op once switched kernels itself
def test_recurrent_ops_run_the_recurrence_they_are_asked_for_at_any_length(name, T):
    call, oracle = CALLS[name]
    x = recurrent_inputs(T)
    with count_dispatches() as calls:
        o, state = call(x)
    assert dict(calls) == {(name, "torch"): 1}
    o_ref, state_ref = oracle(x)
    assert o.shape == o_ref.shape and o.dtype == x["v"].dtype
    assert_close(o, o_ref, 1e-4)
    assert_close(state, state_ref, 1e-4)
