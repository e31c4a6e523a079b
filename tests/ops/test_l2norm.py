"""L2 normalisation: fla's function (eps under the root) with a hand-written backward, alone and fused with a linear
map of the same input."""
import torch
import torch.nn.functional as F

from rotarium.ops.l2norm import EPS, head_l2norm_and_linear, l2norm


def fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm as written in its kernels and transformers' PyTorch reference, differentiated by autograd."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def test_eps_is_fla_s():
    assert EPS == 1e-6


def test_l2norm_matches_fla_s_definition_with_its_gradients():
    x = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    x[0, 0, 0] = 0.0  # a zero vector: eps keeps the result finite and the gradient defined
    x[0, 1, 0] = 1e-14
    ours = x.clone().requires_grad_()
    reference = x.clone().requires_grad_()
    grad = torch.randn_like(x)
    l2norm(ours).backward(grad)
    fla_l2norm(reference).backward(grad)
    assert torch.allclose(l2norm(x), fla_l2norm(x), atol=1e-15)
    assert torch.allclose(ours.grad, reference.grad, rtol=1e-10)
    assert torch.autograd.gradcheck(l2norm, (torch.randn(4, 3, dtype=torch.float64, requires_grad=True),))
    half = torch.randn(2, 8, dtype=torch.bfloat16)
    assert l2norm(half).dtype == torch.bfloat16


def test_head_l2norm_and_linear_matches_its_definition_with_gradients():
    """Selective RoPE's fused read of the layer input: per-head L2 normalisation and the decay logits, with every
    gradient, against finite differences."""
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: head_l2norm_and_linear(a[0], 3, *a[1:]), (x, weight, bias))
    assert torch.autograd.gradcheck(lambda *a: head_l2norm_and_linear(a[0], 3, *a[1:])[1], (x, weight, bias))
    xh, logits = head_l2norm_and_linear(x, 3, weight, bias)
    torch.testing.assert_close(xh, l2norm(x.view(2, 5, 3, 4)), rtol=0, atol=0)
    torch.testing.assert_close(logits, F.linear(x, weight, bias), rtol=0, atol=0)
    assert head_l2norm_and_linear(x, 3)[1] is None
    # only the parameters: no gradient is formed for x
    leaf = x.detach()
    head_l2norm_and_linear(leaf, 3, weight, bias)[1].sum().backward()
    assert leaf.grad is None and weight.grad is not None
    half = [t.detach().bfloat16().requires_grad_() for t in (x, weight, bias)]
    xh, logits = head_l2norm_and_linear(half[0], 3, *half[1:])
    (xh.float().sum() + logits.float().sum()).backward()
    assert xh.dtype == logits.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in half)
