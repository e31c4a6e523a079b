"""The cumulative sum that restarts at packed sequences, shared by FoX and Selective RoPE."""
import torch

from rotarium.ops.cumsum import segment_cumsum
from tests.asserts import assert_close


def test_packed_sums_restart_at_every_sequence_with_their_gradients():
    lengths = [3, 0, 5, 1]
    x = torch.randn(1, sum(lengths), 2, 4, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = segment_cumsum(x, cu_seqlens)
    separate = torch.cat([part.cumsum(1) for part in x.split(lengths, dim=1)], 1)
    assert packed.dtype == x.dtype
    assert_close(packed, separate, 1e-6)
    upstream = torch.randn_like(packed)
    (grad,) = torch.autograd.grad((packed * upstream).sum(), x)
    (expected,) = torch.autograd.grad((separate * upstream).sum(), x)
    assert_close(grad, expected, 1e-6)
    torch.testing.assert_close(segment_cumsum(x), x.cumsum(1), rtol=0, atol=0)
