"""The chunked linear cross-entropy against the plain one (full logits, F.cross_entropy): loss and gradients, and
the memory it holds."""
import collections
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rotarium.ops.linear_cross_entropy import fused_linear_cross_entropy_loss
from tests.asserts import assert_close, assert_close_at_scale
from tests.dispatch import OpOutputs

N, D, V = 37, 16, 50


def plain(x, target, weight, bias=None, ignore_index=-100, label_smoothing=0.0, logit_scale=1.0,
          logit_softcapping=None, reduction="mean"):
    logits = F.linear(x, weight, bias).float() * logit_scale
    if logit_softcapping is not None:
        logits = logit_softcapping * torch.tanh(logits / logit_softcapping)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)


def leaves(dtype=torch.float32, bias=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(V, D, generator=generator, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=generator, dtype=dtype).requires_grad_() if bias else None
    target = torch.randint(0, V, (N,), generator=generator)
    target[::5] = -100
    return x, target, weight, b


def loss_and_grads(fn, x, target, weight, bias, **kwargs):
    for t in (x, weight, bias):
        if t is not None:
            t.grad = None
    loss = fn(x, target, weight, bias, **kwargs)
    (loss * 1.7).backward()  # a gradient other than 1 reaches the backward
    return loss.detach(), [t.grad.clone() for t in (x, weight, bias) if t is not None]


@pytest.mark.parametrize("options", [
    {},
    {"reduction": "sum"},
    {"label_smoothing": 0.1},
    {"logit_scale": 0.5, "logit_softcapping": 3.0},
    {"bias": True, "num_chunks": 3},
    {"num_chunks": 100},  # more chunks than tokens
], ids=lambda o: ",".join(o) or "default")
def test_same_loss_and_gradients_as_the_full_logits(options):
    options = dict(options)
    x, target, weight, bias = leaves(bias=options.pop("bias", False))
    num_chunks = options.pop("num_chunks", 4)
    loss, grads = loss_and_grads(fused_linear_cross_entropy_loss, x, target, weight, bias, num_chunks=num_chunks,
                                 **options)
    loss_ref, grads_ref = loss_and_grads(plain, x, target, weight, bias, **options)
    assert loss.dtype == torch.float32
    assert_close_at_scale(loss, loss_ref, 1e-5)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        assert_close(grad, grad_ref, 1e-5 * grad_ref.abs().max(), rtol=0)


def test_every_token_ignored_gives_zero_loss_and_gradients():
    x, target, weight, _ = leaves()
    loss, grads = loss_and_grads(fused_linear_cross_entropy_loss, x, torch.full_like(target, -100), weight, None)
    assert loss == 0 and all(bool((g == 0).all()) for g in grads)


def test_no_gradients_computed_when_none_are_needed():
    x, target, weight, _ = leaves()
    with torch.no_grad():
        loss = fused_linear_cross_entropy_loss(x, target, weight)
    assert not loss.requires_grad
    assert_close_at_scale(loss, plain(x, target, weight).detach(), 1e-5)


class Matmuls(TorchDispatchMode):
    """The dtypes of the matmuls' factors, and the shapes (sorted: a transposed tensor counts as itself) of the
    tensors cast to another dtype: into a new tensor (``casts``) or into an existing one (``casts_into``)."""

    def __init__(self):
        super().__init__()
        self.factors, self.casts, self.casts_into = [], collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_", "matmul", "bmm"):
            self.factors.append((name, *(a.dtype for a in args[-2:])))
        if name == "_to_copy":
            self.casts[tuple(sorted(args[0].shape))] += 1
        if name == "copy_" and args[0].dtype != args[1].dtype:  # a cast into a buffer
            self.casts_into[tuple(sorted(args[1].shape))] += 1
        return func(*args, **(kwargs or {}))


def test_under_bf16_autocast_every_product_is_bf16_and_the_sums_float32():
    """accelerate's bf16 mixed precision on the LM head: the logits, the input's and the weight's gradients are
    bf16 products (as autocast makes a linear layer's), the weight cast once for all chunks, each chunk's input once
    and its logits twice (to float32, and their gradient back); the softmax, the loss and the weight gradient's sum
    over chunks stay float32, so the results keep to bf16's rounding of the float32 ones."""
    x, target, weight, bias = leaves(bias=True)
    loss_ref, grads_ref = loss_and_grads(plain, x, target, weight, bias)
    with Matmuls() as matmuls, torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(fused_linear_cross_entropy_loss, x, target, weight, bias, num_chunks=4)
    assert len(matmuls.factors) == 4 * 3
    assert all(factors[1:] == (torch.bfloat16, torch.bfloat16) for factors in matmuls.factors), matmuls.factors
    chunk = -(-N // 4)
    assert matmuls.casts[D, V] == 1
    logit_casts = matmuls.casts + matmuls.casts_into
    assert logit_casts[chunk, V] == 2 * (N // chunk) and logit_casts[N % chunk, V] == 2, logit_casts
    assert matmuls.casts[chunk, D] == N // chunk and matmuls.casts[N % chunk, D] == 1, matmuls.casts
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 3
    assert_close_at_scale(loss, loss_ref, 2e-2)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        assert_close(grad, grad_ref, 2e-2 * grad_ref.abs().max(), rtol=0)


FILLS = ("zeros", "fill_", "zero_", "new_zeros", "zeros_like")  # ops that fill a tensor with a constant


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_the_weight_gradient_is_written_by_the_first_chunk_not_zeroed_first(autocast):
    """A [V, D] pass of zeros is as long as a chunk's softmax: the first chunk's product writes the gradient."""
    x, target, weight, _ = leaves()
    _, grads_ref = loss_and_grads(plain, x, target, weight, None)
    with OpOutputs() as ops, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, grads = loss_and_grads(fused_linear_cross_entropy_loss, x, target, weight, None, num_chunks=3)
    assert (V, D) not in ops.shapes(*FILLS), ops.shapes(*FILLS)
    bound = 2e-2 if autocast else 1e-5
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        assert_close(grad, grad_ref, bound * grad_ref.abs().max(), rtol=0)


def test_loss_backward_takes_the_forwards_gradients_without_a_pass_over_the_weight():
    """`loss.backward()` passes exactly 1: scaling the [V, D] weight gradient by it would be a pass as long as a
    chunk's softmax, and a fresh buffer for its result."""
    x, target, weight, _ = leaves()
    reference = plain(x, target, weight)
    expected = torch.autograd.grad(reference, (x, weight))
    loss = fused_linear_cross_entropy_loss(x, target, weight, num_chunks=3)
    with OpOutputs() as ops:
        loss.backward()
    assert not [op for op in ops.outputs if op[1] == (V, D) and op[0] != "detach"], ops.outputs
    for grad, grad_ref in zip((x.grad, weight.grad), expected, strict=True):
        assert_close(grad, grad_ref, 1e-5 * grad_ref.abs().max(), rtol=0)


class PeakLiveBytes(TorchDispatchMode):
    """The most bytes the tensors created inside the mode hold at once, seen after every op: a storage counts while
    any tensor on it is alive, once however many views share it."""

    def __init__(self):
        super().__init__()
        self.tensors: dict[int, tuple[int, list[weakref.ref]]] = {}  # data_ptr -> (bytes, tensors on it)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views of tensors made before the mode (the inputs, the weights) are not new memory
        made_before = {key for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                       and not self.alive(key := a.untyped_storage().data_ptr())}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in made_before:
                continue
            if not self.alive(key):  # a new storage, perhaps where a freed one was
                self.tensors[key] = (storage.nbytes(), [])
            self.tensors[key][1].append(weakref.ref(t))
        self.peak = max(self.peak, sum(self.tensors[key][0] for key in self.tensors if self.alive(key)))
        return out

    def alive(self, key: int) -> bool:
        return any(ref() is not None for ref in self.tensors.get(key, (0, []))[1])


def test_holds_one_chunk_of_logits_at_a_time():
    """Beside the gradients it returns, the forward holds one chunk's float32 logits, and not even a temporary
    copy of them (torch.logsumexp makes two): a second copy would set the peak of a checkpointed training step."""
    tokens, width, vocab, chunks = 64, 8, 4096, 4
    x = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    with PeakLiveBytes() as tracker:
        fused_linear_cross_entropy_loss(x, target, weight, num_chunks=chunks)
    returned_gradients = (tokens + vocab) * width * 4
    chunk_logits = tokens // chunks * vocab * 4
    assert tracker.peak < returned_gradients + 1.25 * chunk_logits, (tracker.peak - returned_gradients) / chunk_logits


def test_bad_arguments_name_the_argument():
    x, target, weight, _ = leaves()
    with pytest.raises(ValueError, match="`target`"):
        fused_linear_cross_entropy_loss(x, target[:-1], weight)
    with pytest.raises(ValueError, match="`reduction`"):
        fused_linear_cross_entropy_loss(x, target, weight, reduction="none")
    with pytest.raises(ValueError, match="`weight`"):
        fused_linear_cross_entropy_loss(x, target, weight[:, :-1])
