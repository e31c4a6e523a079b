"""Short convolution, block pieces, sequence bookkeeping."""
import pytest
import torch
import torch.nn.functional as F

from rotarium.layers import Block, RMSNorm, SequenceInfo, ShortConvolution, SwiGLU, default_intermediate_size
from tests.layers.helpers import HIDDEN, make_mixer


def test_short_convolution_equals_causal_conv1d_and_continues_from_its_state():
    conv = ShortConvolution(6, kernel_size=4, activation=None)
    x = torch.randn(2, 11, 6)
    expected = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, groups=6).transpose(1, 2)
    full, _ = conv(x, SequenceInfo.build(x))
    assert torch.allclose(full, expected, atol=1e-6)
    first, state = conv(x[:, :5], SequenceInfo.build(x[:, :5]))
    outs = [first]
    for t in range(5, 11):
        out, state = conv(x[:, t:t + 1], SequenceInfo.build(x[:, t:t + 1]), state)
        outs.append(out)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-6)


def test_short_convolution_keeps_documents_and_padding_apart():
    conv = ShortConvolution(3, kernel_size=4)
    a, b = torch.randn(1, 2, 3), torch.randn(1, 5, 3)
    packed, _ = conv(torch.cat([a, b], 1), SequenceInfo.build(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 2, 7])))
    assert torch.allclose(packed, torch.cat([conv(a, SequenceInfo.build(a))[0], conv(b, SequenceInfo.build(b))[0]], 1))
    padded = torch.cat([torch.randn(1, 3, 3), b], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    out, _ = conv(padded, SequenceInfo.build(padded, attention_mask=mask))
    assert torch.allclose(out[:, 3:], conv(b, SequenceInfo.build(b))[0], atol=1e-6)


@pytest.mark.parametrize("with_history", [False, True])
def test_short_convolution_windows_skip_padding_between_real_tokens(with_history):
    """Padding anywhere in a row (PEFT's prompt tuning puts its virtual tokens before a left-padded prompt): each
    real token's window holds the real tokens before it, as if the padding were not there, and so does the state."""
    conv = ShortConvolution(3, kernel_size=4).double()
    real = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    history = torch.randn(2, 3, 3, dtype=torch.float64) if with_history else None
    keep = torch.tensor([[1, 0, 0, 1, 1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    holes = torch.randn(2, 10, 3, dtype=torch.float64).masked_scatter(keep[..., None].expand(-1, -1, 3), real)
    y, state = conv(holes, SequenceInfo.build(holes, attention_mask=keep.long()), history)
    expected, expected_state = conv(real, SequenceInfo.build(real), history)
    torch.testing.assert_close(y[keep].view(2, 6, 3), expected)
    torch.testing.assert_close(state, expected_state)
    upstream = torch.randn_like(expected)
    got = torch.autograd.grad((y[keep].view(2, 6, 3) * upstream).sum(), [real, conv.weight])
    want = torch.autograd.grad((expected * upstream).sum(), [real, conv.weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _reference_conv(conv, x, history, activation):
    """F.conv1d over the history followed by x: an independent formulation, differentiated by autograd."""
    W = conv.kernel_size
    extended = torch.cat([history if history is not None else x.new_zeros(x.shape[0], W - 1, x.shape[2]), x], 1)
    y = F.conv1d(extended.transpose(1, 2), conv.weight, groups=x.shape[2]).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize(("T", "with_history"), [(9, False), (9, True), (2, True), (1, False), (1, True)])
def test_short_convolution_gradients(activation, T, with_history):
    """The hand-written backward against autograd through F.conv1d: input, weight, a short input, a state, and the
    one-token decoding step."""
    conv = ShortConvolution(5, kernel_size=4, activation=activation).double()
    x = torch.randn(2, T, 5, dtype=torch.float64, requires_grad=True)
    history = torch.randn(2, 3, 5, dtype=torch.float64) if with_history else None
    y, state = conv(x, SequenceInfo.build(x), history)
    expected = _reference_conv(conv, x, history, activation)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(state, torch.cat([history if with_history else torch.zeros(2, 3, 5, dtype=torch.float64),
                                                 x.detach()], 1)[:, -3:])
    upstream = torch.randn_like(y)
    grads = torch.autograd.grad((y * upstream).sum(), [x, conv.weight])
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [x, conv.weight])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_short_convolution_gradients_stay_inside_documents():
    conv = ShortConvolution(3, kernel_size=4).double()
    a = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, 5, 3, dtype=torch.float64, requires_grad=True)
    packed = torch.cat([a, b], 1)
    y, _ = conv(packed, SequenceInfo.build(packed, cu_seqlens=torch.tensor([0, 2, 7])))
    upstream = torch.randn_like(y)
    grads = torch.autograd.grad((y * upstream).sum(), [a, b, conv.weight])
    separate = torch.cat([_reference_conv(conv, a, None, "silu"), _reference_conv(conv, b, None, "silu")], 1)
    expected = torch.autograd.grad((separate * upstream).sum(), [a, b, conv.weight])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_swiglu_width_and_rmsnorm():
    assert default_intermediate_size(1024) == 2816 and default_intermediate_size(2048) == 5632
    assert SwiGLU(64).up_proj.out_features == default_intermediate_size(64)
    x = torch.randn(3, 8)
    assert torch.allclose(RMSNorm(8)(x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rmsnorm_backward_by_hand_matches_f_rms_norm(dtype):
    """Off CUDA the norm runs its own backward: the same outputs as F.rms_norm bit for bit, the same gradients of
    the input and the weight, for the blocks' [B, T, d] and the heads' [B, T, H, D] layouts."""
    for shape in [(3, 7, 64), (2, 5, 4, 16)]:
        norm = RMSNorm(shape[-1]).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        grad = torch.randn(shape, dtype=dtype)
        out = norm(x)
        out.backward(grad)
        ours = (x.grad.clone(), norm.weight.grad.clone())
        x.grad = norm.weight.grad = None
        reference = F.rms_norm(x, (shape[-1],), norm.weight, norm.eps)
        reference.backward(grad)
        assert torch.equal(out, reference)
        tolerance = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(ours[0], x.grad, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(ours[1], norm.weight.grad, atol=tolerance, rtol=tolerance)


def test_block_is_pre_norm_residual():
    mixer = make_mixer("gla", "rope")
    block = Block(HIDDEN, mixer)
    h = torch.randn(2, 9, HIDDEN)
    seq = SequenceInfo.build(h)
    out, state = block(h, seq, use_cache=True)
    mid = h + mixer(block.mixer_norm(h), seq)[0]
    assert torch.allclose(out, mid + block.mlp(block.mlp_norm(mid)), atol=1e-6)
    assert state is not None and state.recurrent is not None


def test_positions_count_real_tokens_and_restart_per_document():
    x = torch.zeros(2, 4, 1)
    seq = SequenceInfo.build(x, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
    assert seq.token_positions(None).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    assert seq.next_offset(None, seq.token_positions(None)).tolist() == [4, 2]
    packed = SequenceInfo.build(torch.zeros(1, 5, 1), cu_seqlens=torch.tensor([0, 2, 5]))
    assert packed.token_positions(None).tolist() == [[0, 1, 0, 1, 2]]
