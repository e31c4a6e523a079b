"""The positional rotations against rotation matrices and finite differences."""
import pytest
import torch

from rotarium.ops.rotary import rotate_adjacent_pairs, rotate_half_pairs


def rotation_matrix(angles: torch.Tensor) -> torch.Tensor:
    """[P] angles -> [2P, 2P] block rotation acting on pairs (i, i + P)."""
    P = angles.numel()
    R = torch.zeros(2 * P, 2 * P, dtype=torch.float64)
    idx = torch.arange(P)
    R[idx, idx], R[idx, idx + P] = angles.cos(), -angles.sin()
    R[idx + P, idx], R[idx + P, idx + P] = angles.sin(), angles.cos()
    return R


@pytest.mark.parametrize("heads_major", [False, True])
@pytest.mark.parametrize(("heads", "rotary_pairs"), [(1, 4), (3, 4), (3, 2)])  # broadcast over heads; partial rotary
def test_rotation_gradients(heads, rotary_pairs, heads_major):
    """The hand-written backward of the q/k rotation against finite differences, the angles' gradient included."""
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1 if heads == 1 else 3, 8, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(2, 5, heads, rotary_pairs, dtype=torch.float64, requires_grad=True)

    def rotate(a, q, k):
        return rotate_half_pairs(a, q, k, heads_major=heads_major)

    assert torch.autograd.gradcheck(rotate, (angles, q, k))
    assert torch.autograd.gradcheck(lambda a, q, k: rotate(a, q, k)[0], (angles, q, k))  # k's unused
    rotated_q, _ = rotate(angles, q, k)
    assert rotated_q.transpose(1, 2).is_contiguous() == heads_major
    torch.testing.assert_close(rotated_q, rotate_half_pairs(angles, q, k)[0], rtol=0, atol=0)


def test_rotation_matches_the_rotation_matrix():
    x = torch.randn(5, 8, dtype=torch.float64)
    angles = torch.randn(5, 4, dtype=torch.float64)
    expected = torch.stack([rotation_matrix(a) @ row for a, row in zip(angles, x)])
    (rotated,) = rotate_half_pairs(angles[None, :, None], x[None, :, None])
    rotated = rotated[0, :, 0]
    torch.testing.assert_close(rotated, expected)


def test_adjacent_pairs_turn_as_complex_numbers_and_back():
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    angles = torch.randn(2, 5, 1, 4, dtype=torch.float64)
    rotation = torch.polar(torch.ones_like(angles), angles)
    rotated = rotate_adjacent_pairs(x, rotation)
    pairs = x.unflatten(-1, (4, 2))
    torch.testing.assert_close(rotated[..., 0::2], pairs[..., 0] * angles.cos() - pairs[..., 1] * angles.sin())
    torch.testing.assert_close(rotated[..., 1::2], pairs[..., 0] * angles.sin() + pairs[..., 1] * angles.cos())
    torch.testing.assert_close(rotate_adjacent_pairs(rotated, rotation.conj()), x)
