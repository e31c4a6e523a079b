"""The softmax mixers' KV cache: decoding equals the full forward, appends in place, never syncs with the device;
and the fla decoding path, run on the CPU with fla's own reference of its kernel standing in for the kernel."""
import importlib
import inspect
import math

import pytest
import torch

from rotarium.layers import POSITION_ENCODINGS, SequenceInfo, SoftmaxAttention
from rotarium.layers.attention import KVCache
from rotarium.models import MIXERS
from rotarium.models.cache import RotariumCache
from rotarium.ops import backend as backend_module
from rotarium.ops import forgetting_attn_with_cache
from rotarium.ops.backend import count_dispatches
from tests.asserts import assert_close
from tests.layers.helpers import HIDDEN, make_mixer, run

FAMILIES = tuple(family for family, mixer in MIXERS.items() if issubclass(mixer, SoftmaxAttention))
ATTENTION = [(f, p) for f in FAMILIES for p in POSITION_ENCODINGS]


@pytest.fixture
def fla_stand_in(monkeypatch):
    """Makes ``forgetting_attn_with_cache`` (only) believe fla runs here, and replaces fla's decoding kernel by
    fla's PyTorch reference of it (``naive_attn_decoding``), called through the kernel's own signature; returns the
    list of the calls' keyword arguments."""
    decoding = pytest.importorskip("fla.ops.attn.decoding")
    reference = getattr(importlib.import_module("fla.ops.attn.naive"), "naive_attn_decoding", None)
    if reference is None:
        pytest.skip("this fla has no reference of its decoding kernel (fla.ops.attn.naive.naive_attn_decoding)")
    signature = inspect.signature(decoding.attn_decoding_one_step)
    calls = []

    def stand_in(*args, **kwargs):
        signature.bind(*args, **kwargs)  # a TypeError on an argument the installed kernel does not take
        calls.append(kwargs)
        return reference(*args, **kwargs)

    def use_fla(*args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(backend_module, "fla_device", lambda x: True)
            return backend_module.use_fla(*args, **kwargs)

    monkeypatch.setattr(importlib.import_module("rotarium.ops.forgetting_attn.decoding"), "use_fla", use_fla)
    monkeypatch.setattr(decoding, "attn_decoding_one_step", stand_in)
    return calls


def decode(mixer, x, mask, prefix, reorder_at=None, index=None, fresh=None):
    """Prefill ``x[:, :prefix]`` (padding ``mask``), then one token a step; at step ``reorder_at`` the rows are
    reordered by ``index`` through RotariumCache (beam search) and continue with the tokens ``fresh``.
    Returns the outputs of every position, ``[B, T, d]``."""
    outs = []
    out, state = run(mixer, x[:, :prefix], use_cache=True, attention_mask=mask[:, :prefix])
    outs.append(out)
    for t in range(prefix, x.shape[1]):
        if t == reorder_at:
            cache = RotariumCache(1)
            cache.layers[0].state = state
            cache.reorder_cache(index)
            state, x = cache.layers[0].state, torch.cat([x[index, :t], fresh[:, t:]], 1)
            outs = [o[index] for o in outs]
        out, state = run(mixer, x[:, t:t + 1], state, use_cache=True, attention_mask=mask[:, :t + 1])
        outs.append(out)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("path", ["torch", "fla"])
@pytest.mark.parametrize("family,pe", ATTENTION)
def test_decoding_with_the_kv_cache_equals_the_full_forward(family, pe, path, padded, request):
    calls = request.getfixturevalue("fla_stand_in") if path == "fla" else None
    mixer = make_mixer(family, pe, num_kv_heads=2)  # grouped-query heads in both families
    B, T, prefix, reorder_at = 3, 24, 7, 13
    x, fresh = torch.randn(B, T, HIDDEN), torch.randn(B, T, HIDDEN)
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
        mask[2, :2] = 0
    index = torch.tensor([2, 0, 0])  # a beam dropped, another doubled
    with torch.no_grad():
        with count_dispatches() as dispatched:
            decoded = decode(mixer, x, mask, prefix, reorder_at, index, fresh)
        mask = torch.cat([mask[index, :reorder_at], mask[:, reorder_at:]], 1)
        history = torch.cat([x[index, :reorder_at], fresh[:, reorder_at:]], 1)
        full, _ = run(mixer, history, attention_mask=mask)
    real = mask.bool()
    assert_close(decoded[real], full[real], atol=1e-5, what=f"{family}/{pe}/{path}")
    if path == "fla":  # every step; the padded prefill (several queries) takes the PyTorch path
        assert dispatched[("forgetting_attn_with_cache", "fla")] == len(calls) == T - prefix
    else:
        assert dispatched[("forgetting_attn_with_cache", "fla")] == 0


def test_the_cache_appends_in_place_and_doubles_its_capacity():
    mixer = make_mixer("fox", "rope")
    prefix, steps = 3, 61
    x = torch.randn(2, prefix + steps, HIDDEN)
    with torch.no_grad():
        _, state = run(mixer, x[:, :prefix], use_cache=True)
        storage, capacity, moves = state.kv.keys.data_ptr(), state.kv.capacity, 0
        for t in range(prefix, prefix + steps):
            _, state = run(mixer, x[:, t:t + 1], state, use_cache=True)
            cache = state.kv
            if cache.keys.data_ptr() != storage:
                moves += 1
                assert cache.length > capacity, f"step {t}: moved though {cache.length} fit into {capacity}"
                assert cache.capacity == 2 * capacity
            storage, capacity = cache.keys.data_ptr(), cache.capacity
    assert cache.length == prefix + steps and cache.keys.shape == (2, prefix + steps, 4, HIDDEN // 4)
    assert moves == math.ceil(math.log2((prefix + steps) / prefix))


def test_reordering_keeps_the_spare_room():
    mixer = make_mixer("transformer", "nope")
    x = torch.randn(2, 12, HIDDEN)
    with torch.no_grad():
        _, state = run(mixer, x[:, :4], use_cache=True)
        _, state = run(mixer, x[:, 4:5], state, use_cache=True)  # capacity 8
        cache = RotariumCache(1)
        cache.layers[0].state = state
        cache.reorder_cache(torch.tensor([1, 1]))
        reordered = cache.layers[0].state.kv
        assert reordered.capacity == 8 and reordered.keys.shape[:2] == (2, 5)
        _, state = run(mixer, x[:, 5:6], cache.layers[0].state, use_cache=True)
    assert state.kv.keys.data_ptr() == reordered.keys.data_ptr()


def test_a_state_continued_twice_stays_valid():
    mixer = make_mixer("fox", "rove")
    x, other = torch.randn(1, 10, HIDDEN), torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        _, state = run(mixer, x[:, :6], use_cache=True)
        _, state = run(mixer, x[:, 6:7], state, use_cache=True)  # spare room from here on
        _, first = run(mixer, x[:, 7:8], state, use_cache=True)
        _, second = run(mixer, other, state, use_cache=True)  # the same position, another token
        out, _ = run(mixer, x[:, 8:9], first, use_cache=True)
        full, _ = run(mixer, x[:, :9])
    assert_close(out, full[:, 8:9], atol=1e-5)
    assert second.kv.keys.data_ptr() != first.kv.keys.data_ptr()


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_through_decoding_equal_the_full_forward(family):
    mixer = make_mixer(family, "rope")
    x = torch.randn(2, 9, HIDDEN)
    full, _ = run(mixer, x)
    expected = torch.autograd.grad(full[:, 5:].square().sum(), list(mixer.parameters()), allow_unused=True)
    _, state = run(mixer, x[:, :5], use_cache=True)
    outs = []
    for t in range(5, 9):
        out, state = run(mixer, x[:, t:t + 1], state, use_cache=True)
        outs.append(out)
    got = torch.autograd.grad(torch.cat(outs, 1).square().sum(), list(mixer.parameters()), allow_unused=True)
    for (name, _), a, b in zip(mixer.named_parameters(), got, expected):
        if b is not None:
            assert_close(a, b, atol=1e-5, what=name)


@pytest.mark.parametrize("family,pe", ATTENTION)
def test_training_forward_and_decoding_never_read_the_device(family, pe):
    """Meta tensors have no values: any read (``bool``, ``.item()``, ``.tolist()``) raises."""
    mixer = make_mixer(family, pe).to("meta")
    meta = torch.device("meta")
    x = torch.randn(2, 9, HIDDEN, device=meta)
    out, _ = mixer(x, SequenceInfo.build(x), None, False)
    assert out.shape == x.shape
    mask = torch.ones(2, 9, dtype=torch.bool, device=meta)  # built by hand: building reads a mask once per forward
    with torch.no_grad():
        _, state = mixer(x, SequenceInfo(2, 9, mask=mask, device=meta), None, True)
        for _ in range(3):
            y = torch.randn(2, 1, HIDDEN, device=meta)
            _, state = mixer(y, SequenceInfo.build(y), state, True)
    assert state.kv.length == 12


def reference_inputs(B=3, Tk=11, HQ=4, H=2, K=8, V=6, decays=True):
    q = torch.randn(B, 1, HQ, K)
    k, v = torch.randn(B, Tk, H, K), torch.randn(B, Tk, H, V)
    c = torch.nn.functional.logsigmoid(torch.randn(B, Tk, HQ)).cumsum(1) if decays else None
    return q, k, v, c


@pytest.mark.parametrize("decays", [True, False], ids=["forget_gate", "plain"])
@pytest.mark.parametrize("layout", ["batch_major", "time_major", "padded", "padding_with_holes"])
def test_fla_decoding_computes_what_the_pytorch_path_computes(layout, decays, fla_stand_in):
    q, k, v, c = reference_inputs(decays=decays)
    mask = None
    if layout == "time_major":
        cache = KVCache.start(k[:, :1], v[:, :1], None if c is None else c[:, :1])
        for t in range(1, k.shape[1]):
            cache = cache.append(k[:, t:t + 1], v[:, t:t + 1], None if c is None else c[:, t:t + 1])
        k, v, c = cache.keys, cache.values, cache.log_decay_cumsum
        assert k.transpose(0, 1).is_contiguous() and not k.is_contiguous()
    elif layout.startswith("padding"):
        mask = torch.ones(3, 11, dtype=torch.long)
        mask[0, :4] = 0
        mask[2, :10] = 0  # only the query's own key left
        if layout == "padding_with_holes":
            mask[1, 3:6] = 0
    cq = None if c is None else c[:, -1:] + 0.5  # a bias shared by the query's scores changes nothing
    with count_dispatches() as dispatched:
        fla = forgetting_attn_with_cache(q, k, v, cq, c, attention_mask=mask)
    torch_path = forgetting_attn_with_cache(q, k, v, cq, c, attention_mask=mask, backend="torch")
    assert dispatched[("forgetting_attn_with_cache", "fla")] == 1
    assert len(fla_stand_in) == 1
    assert_close(fla, torch_path, atol=1e-5)


def test_fla_decoding_leaves_prefill_and_gradients_to_the_pytorch_path(fla_stand_in):
    q, k, v, c = reference_inputs()
    with count_dispatches() as dispatched:
        forgetting_attn_with_cache(q.expand(-1, 2, -1, -1), k, v, c[:, -2:], c)  # two queries
        forgetting_attn_with_cache(q.requires_grad_(), k, v, c[:, -1:], c)
    assert dispatched[("forgetting_attn_with_cache", "torch")] == 2 and not fla_stand_in
