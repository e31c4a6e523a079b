"""The linear-attention mixers choose between the step-wise and the chunked kernels (the ops run what they are
called as), and never train through a kernel that the table of what fla can do says cannot train."""
import pytest
import torch

from rotarium.layers.linear_attention import MAX_STEPS
from rotarium.ops.backend import FLA_KERNELS, count_dispatches
from tests.layers.helpers import HIDDEN, make_mixer, run

MIXERS = {  # name: (family, positional option, overrides, the step-wise kernel it decodes with)
    "gla": ("gla", "rope", {}, "fused_recurrent_gla"),
    "deltanet": ("deltanet", "rope", {}, "fused_recurrent_delta_rule"),
    "gated deltanet": ("deltanet", "rope", {"use_gated_delta": True}, "fused_recurrent_gated_delta_rule"),
    "deltanet, selective rope": ("deltanet", "selective_rope", {}, "fused_recurrent_gated_delta_rule"),
}


def continue_from_a_state(mixer, T: int, grad: bool) -> dict:
    """The dispatches of a ``T``-token call continuing from a cached state, recording gradients or not."""
    _, state = run(mixer, torch.randn(2, 5, HIDDEN), use_cache=True)
    x = torch.randn(2, T, HIDDEN, requires_grad=grad)
    with torch.set_grad_enabled(grad), count_dispatches() as calls:
        out, _ = run(mixer, x, state, use_cache=True)
    if grad:
        out.sum().backward()
    return {op for op, _ in calls if op.startswith(("chunk_", "fused_recurrent_"))}


@pytest.mark.parametrize("name", list(MIXERS))
def test_short_continuations_decode_step_wise_and_long_ones_run_chunked(name):
    family, pe, overrides, step_wise = MIXERS[name]
    mixer = make_mixer(family, pe, **overrides)
    chunked = step_wise.replace("fused_recurrent_", "chunk_")
    assert continue_from_a_state(mixer, 1, grad=False) == {step_wise}
    assert continue_from_a_state(mixer, MAX_STEPS, grad=False) == {step_wise}
    assert continue_from_a_state(mixer, MAX_STEPS + 1, grad=False) == {chunked}


@pytest.mark.parametrize("name", list(MIXERS))
def test_training_through_a_state_runs_only_kernels_that_train(name):
    family, pe, overrides, step_wise = MIXERS[name]
    ops = continue_from_a_state(make_mixer(family, pe, **overrides), 3, grad=True)
    assert ops == {step_wise.replace("fused_recurrent_", "chunk_")}
    assert all(FLA_KERNELS[op].trains for op in ops), ops
