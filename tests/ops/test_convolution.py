"""The causal depthwise convolution op on packed documents: its state belongs to the last document alone."""
import pytest
import torch

from rotarium.ops.convolution import causal_conv1d
from tests.asserts import assert_close


@pytest.mark.parametrize("lengths", [[5, 2], [2, 1], [5, 2, 0], [6]])
def test_packed_state_is_the_last_documents_own(lengths):
    """The state after a packed row continues its last document: inputs of earlier documents are not part of it."""
    torch.manual_seed(0)
    x = torch.randn(1, sum(lengths), 3)
    weight = torch.randn(3, 4)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    _, state = causal_conv1d(x, weight, None, "silu", cu_seqlens)
    _, expected = causal_conv1d(x[:, int(cu_seqlens[-2]):], weight, None, "silu")
    assert state.shape == expected.shape
    assert_close(state, expected, 0.0)


def test_a_state_cannot_enter_packed_documents():
    x = torch.randn(1, 3, 2)
    with pytest.raises(ValueError, match="`initial_state`.*`cu_seqlens`"):
        causal_conv1d(x, torch.randn(2, 4), torch.randn(1, 3, 2), None, torch.tensor([0, 1, 3]))
