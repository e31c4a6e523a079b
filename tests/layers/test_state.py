"""Each mixer hands back a typed decoding state, and every state selects batch rows field by field."""
import pytest
import torch

from rotarium.layers import (
    AttentionState,
    LinearAttentionState,
    RotaryState,
    SelectiveRoPEState,
    SoftmaxAttention,
)
from tests.layers.helpers import COMBINATIONS, HIDDEN, make_mixer, run

POSITIONAL_STATES = {"nope": type(None), "rope": RotaryState, "rove": RotaryState,
                     "selective_rope": SelectiveRoPEState}


@pytest.mark.parametrize(("family", "position_encoding"), COMBINATIONS)
def test_a_mixer_hands_back_its_typed_state_and_continues_from_selected_rows(family, position_encoding):
    mixer = make_mixer(family, position_encoding).double()
    x = torch.randn(3, 6, HIDDEN, dtype=torch.float64)
    _, state = run(mixer, x[:, :5], use_cache=True)
    expected = AttentionState if isinstance(mixer, SoftmaxAttention) else LinearAttentionState
    assert type(state) is expected
    assert type(state.positional) is POSITIONAL_STATES[position_encoding]

    rows = torch.tensor([2, 0, 2])
    continued, _ = run(mixer, x[rows, 5:], state.select_rows(rows), use_cache=True)
    alone, _ = run(mixer, x[rows], use_cache=True)
    torch.testing.assert_close(continued, alone[:, 5:], atol=1e-5, rtol=1e-5)  # angles are float32
    # the original state is untouched by the selection
    again, _ = run(mixer, x[:, 5:], state, use_cache=True)
    torch.testing.assert_close(again, run(mixer, x, use_cache=True)[0][:, 5:], atol=1e-5, rtol=1e-5)


def test_select_rows_gathers_every_tensor_field_and_keeps_none():
    state = LinearAttentionState(torch.arange(6.0).view(3, 2), conv_q=torch.arange(3.0), conv_k=None,
                                 positional=RotaryState(torch.tensor([5, 6, 7])))
    picked = state.select_rows(torch.tensor([1, 1]))
    assert picked.recurrent.tolist() == [[2.0, 3.0], [2.0, 3.0]]
    assert picked.conv_q.tolist() == [1.0, 1.0] and picked.conv_k is None and picked.conv_v is None
    assert picked.positional.offset.tolist() == [6, 6]
