"""parallel_forgetting_attn and forgetting_attn_with_cache against two oracles: rotarium's
per-query loop (naive.py) and fla's naive references."""
import pytest
import torch
import torch.nn.functional as F
from fla.ops.attn.naive import naive_parallel_attn as fla_naive_attn
from fla.ops.forgetting_attn.naive import naive_forgetting_attn as fla_naive_fox

from rotarium.ops.forgetting_attn import (
    forgetting_attn_with_cache,
    naive_forgetting_attn,
    naive_forgetting_attn_with_cache,
    parallel_forgetting_attn,
)
from rotarium.ops.forgetting_attn import parallel as parallel_mod
from tests.asserts import assert_close
from tests.dispatch import OpOutputs


def make_inputs(B, T, HQ, H, K=16, V=32, gate=True, dtype=torch.float32, g_low=None):
    q = torch.randn(B, T, HQ, K)
    k = torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    if g_low is None:
        g = F.logsigmoid(torch.randn(B, T, HQ) + 2.0) if gate else None
    else:
        g = torch.rand(B, T, HQ) * g_low
    ins = [q, k, v] + ([g] if g is not None else [])
    ins = [x.to(dtype).requires_grad_() for x in ins]
    return ins if g is not None else [*ins, None]


def fla_oracle(q, k, v, g, scale=None):
    q, k, v = q.float(), k.float(), v.float()
    if g is None:
        return fla_naive_attn(q, k, v, scale)[0]
    return fla_naive_fox(q, k, v, g.float(), scale)


def within_gate_rounding(actual, expected, g, atol=1e-5, what=""):
    """Whole causal attention carries the gate's bias in the fused kernel's sum, which rounds it to about float32's
    epsilon times the cumulative gate's magnitude (centred on its range, as the op does), as fla's kernel does:
    the bound grows with that magnitude and with the values compared."""
    c = g.detach().float().cumsum(1)
    half_range = ((c.amax(1) - c.amin(1)) / 2).max().item()
    rounding = torch.finfo(torch.float32).eps * half_range * expected.detach().abs().max().item()
    assert_close(actual, expected, atol=atol + rounding, what=what)


def grads(o, inputs, do):
    inputs = [x for x in inputs if x is not None]
    return torch.autograd.grad(o, inputs, do)


@pytest.fixture(autouse=True)
def _one_thread():
    """The oracles run thousands of tiny ops; with two threads each one waits on a
    thread barrier, which is very slow when other processes share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 32 queries, so short inputs cover several blocks and a ragged last one."""
    monkeypatch.setattr(parallel_mod, "BLOCK", 32)


@pytest.mark.parametrize("T", [1, 100, 130, 300])
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("HQ,H", [(2, 2), (4, 2)])
def test_parallel_matches_oracles(T, gate, HQ, H, request):
    if T in (100, 130):
        request.getfixturevalue("small_blocks")
    q, k, v, g = make_inputs(2, T, HQ, H, gate=gate)
    o = parallel_forgetting_attn(q, k, v, g)
    assert o.shape == (2, T, HQ, 32) and o.dtype == torch.float32
    do = torch.randn_like(o)
    ours = grads(o, (q, k, v, g), do)
    for oracle in (naive_forgetting_attn, fla_oracle):
        ref = oracle(q, k, v, g)
        assert_close(o, ref, atol=1e-5)
        for got, want in zip(ours, grads(ref, (q, k, v, g), do), strict=True):
            assert_close(got, want, atol=1e-4)


@pytest.mark.parametrize("gate", [True, False])
def test_parallel_scale_strided_inputs_torch_backend(gate):
    """A custom scale, inputs that are strided views of one fused projection, backend='torch'."""
    B, T, HQ, H, D = 2, 70, 4, 2, 16
    qkv = torch.randn(B, T, (HQ + 2 * H) * D + HQ)
    q, k, v, g = qkv.split([HQ * D, H * D, H * D, HQ], -1)
    q, k, v = q.unflatten(-1, (HQ, D)), k.unflatten(-1, (H, D)), v.unflatten(-1, (H, D))
    g = F.logsigmoid(g) if gate else None
    o = parallel_forgetting_attn(q, k, v, g, scale=0.3, backend="torch")
    assert_close(o, naive_forgetting_attn(q, k, v, g, scale=0.3), atol=1e-5)
    assert_close(o, fla_oracle(q, k, v, g, scale=0.3), atol=1e-5)
    c = None if g is None else g.cumsum(1)
    oc = forgetting_attn_with_cache(q[:, -5:], k, v, None if c is None else c[:, -5:], c, scale=0.3)
    assert_close(oc, o[:, -5:], atol=1e-5)


@pytest.mark.parametrize("gate", [True, False])
def test_parallel_bfloat16(gate):
    q, k, v, g = make_inputs(2, 150, 4, 2, gate=gate, dtype=torch.bfloat16)
    o = parallel_forgetting_attn(q, k, v, g)
    assert o.dtype == torch.bfloat16
    do = torch.randn_like(o)
    ours = grads(o, (q, k, v, g), do)
    assert all(x.dtype == torch.bfloat16 for x in ours)
    # oracles in float32 on the same bf16-rounded inputs
    f32 = [None if x is None else x.detach().float().requires_grad_() for x in (q, k, v, g)]
    for oracle in (naive_forgetting_attn, fla_oracle):
        ref = oracle(*f32)
        assert_close(o, ref, atol=3e-2, rtol=3e-2)
        for got, want in zip(ours, grads(ref, f32, do.float()), strict=True):
            assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("lengths", [[37, 64, 1, 90], [5, 200, 0, 70]])
def test_packed_equals_separate(gate, lengths, small_blocks):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T = int(cu[-1])
    q, k, v, g = make_inputs(1, T, 4, 2, gate=gate)
    o = parallel_forgetting_attn(q, k, v, g, cu_seqlens=cu)
    do = torch.randn_like(o)
    ours = grads(o, (q, k, v, g), do)
    ref = naive_forgetting_attn(q, k, v, g, cu_seqlens=cu)
    assert_close(o, ref, atol=1e-5)
    for got, want in zip(ours, grads(ref, (q, k, v, g), do), strict=True):
        assert_close(got, want, atol=1e-4)
    # each sequence alone, through the op itself and through fla's oracle
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if b == a:
            continue
        part = [None if x is None else x[:, a:b].detach().requires_grad_() for x in (q, k, v, g)]
        alone = parallel_forgetting_attn(*part)
        assert_close(o[:, a:b], alone, atol=1e-5)
        assert_close(o[:, a:b], fla_oracle(*part), atol=1e-5)
        for got, want in zip(ours, grads(alone, part, do[:, a:b]), strict=True):
            assert_close(got[:, a:b], want, atol=1e-4)


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("step", [1, 3])
def test_prefill_then_decode_equals_one_pass(gate, step):
    B, T, P = 2, 40, 17
    q, k, v, g = make_inputs(B, T, 4, 2, gate=gate)
    full = parallel_forgetting_attn(q, k, v, g)
    c = None if g is None else g.float().cumsum(1)
    outs = [parallel_forgetting_attn(q[:, :P], k[:, :P], v[:, :P], None if g is None else g[:, :P])]
    for t in range(P, T, step):
        e = min(t + step, T)
        cq, ck = (None, None) if c is None else (c[:, t:e], c[:, :e])
        outs.append(forgetting_attn_with_cache(q[:, t:e], k[:, :e], v[:, :e], cq, ck))
    assert_close(torch.cat(outs, 1), full, atol=1e-5)


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_matches_oracles(gate, dtype):
    """Several queries against a longer cache, left padding, GQA, gradients."""
    B, Tq, Tk = 2, 9, 50
    q = make_inputs(B, Tq, 4, 2, dtype=dtype)[0]
    _, k, v, g = make_inputs(B, Tk, 4, 2, gate=gate, dtype=dtype)
    ck = None if g is None else g.float().cumsum(1)  # the cache keeps c in float32
    cq = None if g is None else ck[:, -Tq:].detach().clone().requires_grad_()
    mask = torch.ones(B, Tk, dtype=torch.long)
    mask[1, :13] = 0
    o = forgetting_attn_with_cache(q, k, v, cq, ck, attention_mask=mask)
    assert o.dtype == dtype
    ref = naive_forgetting_attn_with_cache(q, k, v, cq, ck, attention_mask=mask)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert_close(o, ref, atol=tol, rtol=max(tol, 1e-4))
    do = torch.randn_like(ref)
    inputs = (q, k, v) + (() if g is None else (cq, g))
    for got, want in zip(grads(o, inputs, do.to(dtype)), grads(ref, inputs, do), strict=True):
        assert_close(got, want, atol=10 * tol, rtol=max(tol, 1e-4))
    # fla's oracle on the unpadded row 1: its keys start at position 13
    qr, kr, vr = q[1:2].detach(), k[1:2, 13:].detach(), v[1:2, 13:].detach()
    gr = None if g is None else g[1:2, 13:].detach()
    qfull = torch.cat([torch.zeros(1, Tk - 13 - Tq, 4, 16, dtype=dtype), qr], 1)
    assert_close(o[1:2], fla_oracle(qfull, kr, vr, gr)[:, -Tq:], atol=tol, rtol=max(tol, 1e-4))


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Tq", [1, 3])
def test_decoding_steps_read_a_time_major_cache_where_it_lies(gate, dtype, Tq):
    """Steps without gradients or padding (generation) go through the fused kernel on strided views of the cache, as
    KVCache keeps it ([capacity, B, H, K] with room to grow), with GQA, the gate and several queries. In float32
    nothing of the cache's size is made (the blocks copy all of it into their own layout at every step); bf16 on a
    CPU makes one float32 copy of the keys and of the values, and nothing larger."""
    B, Tk, capacity = 2, 50, 64
    q = make_inputs(B, Tq, 4, 2, dtype=dtype)[0].detach()
    # values as wide as the keys, as the models' heads (PyTorch's fused CPU kernel needs that)
    _, k, v, g = (None if x is None else x.detach() for x in make_inputs(B, Tk, 4, 2, V=16, gate=gate, dtype=dtype))
    ck = None if g is None else g.float().cumsum(1)
    cq = None if g is None else ck[:, -Tq:]
    cache_k, cache_v = k.new_empty(capacity, B, 2, 16), v.new_empty(capacity, B, 2, 16)
    cache_k[:Tk], cache_v[:Tk] = k.transpose(0, 1), v.transpose(0, 1)
    k_view, v_view = cache_k[:Tk].transpose(0, 1), cache_v[:Tk].transpose(0, 1)
    with torch.no_grad(), OpOutputs() as ops:
        o = forgetting_attn_with_cache(q, k_view, v_view, cq, ck)
    ref = naive_forgetting_attn_with_cache(q, k, v, cq, ck)
    assert o.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert_close(o, ref, atol=tol, rtol=max(tol, 1e-4))
    assert ops.shapes("_scaled_dot_product_flash_attention_for_cpu")
    if dtype == torch.float32:
        assert max(ops.new_sizes()) < k.numel(), ops.new_sizes()
    else:
        assert ops.shapes("_to_copy").count(tuple(k.shape)) == 2 and max(ops.new_sizes()) <= k.numel()


def test_cache_single_token():
    """T = 1: one query, one key: the output is that key's value for each query head."""
    q, k, v, g = (x.detach() for x in make_inputs(2, 1, 4, 2))
    c = g.cumsum(1)
    o = forgetting_attn_with_cache(q, k, v, c, c)
    assert_close(o, v.repeat_interleave(2, dim=2), atol=1e-6)
    assert_close(parallel_forgetting_attn(q, k, v, g), o, atol=1e-6)


@pytest.mark.parametrize("gate", [True, False])
def test_left_padding_equals_unpadded(gate):
    lengths, Tmax = [23, 11], 23
    B = len(lengths)
    q, k, v, g = (None if x is None else x.detach() for x in make_inputs(B, Tmax, 2, 1, gate=gate))
    mask = torch.zeros(B, Tmax, dtype=torch.long)
    for b, L in enumerate(lengths):
        mask[b, Tmax - L :] = 1
    # garbage in the padding must not matter; a gate there only shifts c by a constant
    c = None if g is None else g.cumsum(1)
    o = forgetting_attn_with_cache(q, k, v, c, c, attention_mask=mask)
    for b, L in enumerate(lengths):
        sl = slice(Tmax - L, Tmax)
        alone = parallel_forgetting_attn(q[b : b + 1, sl], k[b : b + 1, sl], v[b : b + 1, sl],
                                         None if g is None else g[b : b + 1, sl])
        assert_close(o[b : b + 1, sl], alone, atol=1e-5)
        assert torch.equal(o[b, : Tmax - L], torch.zeros_like(o[b, : Tmax - L]))  # no visible key


def test_fully_masked_row_gives_zeros():
    q, k, v, g = make_inputs(2, 6, 2, 2)
    c = g.cumsum(1)
    mask = torch.ones(2, 6)
    mask[0] = 0
    o = forgetting_attn_with_cache(q[:, -1:], k, v, c[:, -1:], c, attention_mask=mask)
    assert torch.isfinite(o).all()
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    assert_close(o[1:], naive_forgetting_attn_with_cache(q[1:, -1:], k[1:], v[1:], c[1:, -1:], c[1:]), atol=1e-5)
    gq, gk, gv, gg = torch.autograd.grad(o.sum(), (q, k, v, g))
    assert all(torch.isfinite(x).all() for x in (gq, gk, gv, gg))
    assert torch.equal(gv[0], torch.zeros_like(gv[0]))


@pytest.mark.parametrize("kind", ["strong", "near0", "near1"])
def test_robust_gates(kind):
    """Decays down to -20 a step, gates near 0 (g -> -20) and near 1 (g -> 0), multi-block."""
    B, T, HQ, H = 1, 600, 2, 1
    q, k, v, _ = make_inputs(B, T, HQ, H)
    if kind == "strong":
        g = torch.rand(B, T, HQ) * -20.0
    elif kind == "near0":
        g = F.logsigmoid(torch.full((B, T, HQ), -20.0) + torch.randn(B, T, HQ) * 0.1)
    else:
        g = F.logsigmoid(torch.full((B, T, HQ), 15.0) + torch.randn(B, T, HQ))
    g.requires_grad_()
    o = parallel_forgetting_attn(q, k, v, g)
    do = torch.randn_like(o)
    ours = grads(o, (q, k, v, g), do)
    assert torch.isfinite(o).all() and all(torch.isfinite(x).all() for x in ours)
    ref = naive_forgetting_attn(q, k, v, g)
    within_gate_rounding(o, ref, g)
    for got, want, name in zip(ours, grads(ref, (q, k, v, g), do), "qkvg", strict=True):
        within_gate_rounding(got, want, g, atol=1e-4, what=f"d{name}")
    # fla's oracle forms (q.k + c_i) - c_j as well
    within_gate_rounding(o, fla_oracle(q, k, v, g), g)


@pytest.mark.slow
def test_long_sequence_16k():
    """T = 16384: finite, and matching the per-query oracle on a spread of rows."""
    T, HQ, H, D = 16384, 2, 1, 8
    q, k, v = torch.randn(1, T, HQ, D), torch.randn(1, T, H, D), torch.randn(1, T, H, D)
    g = torch.rand(1, T, HQ) * -20.0
    g[:, T // 2 :] *= 1e-4  # second half: gates near 1, so rows there attend far back
    g.requires_grad_()
    for x in (q, k, v):
        x.requires_grad_()
    o = parallel_forgetting_attn(q, k, v, g)
    assert torch.isfinite(o).all()
    o.backward(torch.randn_like(o))
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, g))
    c = g.detach().cumsum(1)
    rows = [0, 1, 127, 128, 5000, T // 2, T // 2 + 1, 12345, T - 1]
    for i in rows:
        ref = naive_forgetting_attn_with_cache(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1],
                                               c[:, i : i + 1], c[:, : i + 1])
        within_gate_rounding(o[:, i : i + 1], ref, g)
    # plain attention on the same long input
    o0 = parallel_forgetting_attn(q, k, v)
    assert torch.isfinite(o0).all()
    ref = naive_forgetting_attn_with_cache(q[:, -1:], k, v)
    assert_close(o0[:, -1:], ref, atol=1e-5)


def test_errors():
    q, k, v, g = (x.detach() for x in make_inputs(1, 8, 4, 2))
    with pytest.raises(ValueError, match="`k`"):
        parallel_forgetting_attn(q, k[:, :7], v, g)
    with pytest.raises(ValueError, match="`v`"):
        parallel_forgetting_attn(q, k, v[:, :, :1], g)
    with pytest.raises(ValueError, match="`g`"):
        parallel_forgetting_attn(q, k, v, g[..., :3])
    with pytest.raises(ValueError, match="heads"):
        parallel_forgetting_attn(q[:, :, :3], k, v, g[..., :3])
    with pytest.raises(ValueError, match="`q`"):
        parallel_forgetting_attn(q[0], k, v, g)
    with pytest.raises(ValueError, match="`k`"):
        parallel_forgetting_attn(q, k.double(), v, g)
    with pytest.raises(ValueError, match="`v`"):
        parallel_forgetting_attn(q, k, v.to("meta"), g)
    with pytest.raises(ValueError, match="`g`"):
        parallel_forgetting_attn(q, k, v, g.abs() + 0.1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        parallel_forgetting_attn(q, k, v, g, cu_seqlens=torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        parallel_forgetting_attn(q, k, v, g, cu_seqlens=torch.tensor([0, 5, 3, 8]))
    q2, k2, v2, g2 = (torch.cat([x, x]) for x in (q, k, v, g))
    with pytest.raises(ValueError, match="cu_seqlens"):
        parallel_forgetting_attn(q2, k2, v2, g2, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="fla"):
        parallel_forgetting_attn(q, k, v, g, backend="fla")
    with pytest.raises(ValueError, match="backend"):
        parallel_forgetting_attn(q, k, v, g, backend="triton")


def test_cache_errors():
    q, k, v, g = (x.detach() for x in make_inputs(1, 8, 4, 2))
    c = g.cumsum(1)
    with pytest.raises(ValueError, match="`k`"):
        forgetting_attn_with_cache(q, k[:, :5], v[:, :5])  # fewer keys than queries
    with pytest.raises(ValueError, match="`v`"):
        forgetting_attn_with_cache(q, k, v[:, :7])
    with pytest.raises(ValueError, match="k_log_decay_cumsum"):
        forgetting_attn_with_cache(q, k, v, c)
    with pytest.raises(ValueError, match="q_log_decay_cumsum"):
        forgetting_attn_with_cache(q, k, v, c[:, :3], c)
    with pytest.raises(ValueError, match="k_log_decay_cumsum"):
        forgetting_attn_with_cache(q, k, v, c, c[..., :2])
    with pytest.raises(ValueError, match="attention_mask"):
        forgetting_attn_with_cache(q, k, v, c, c, attention_mask=torch.ones(1, 7))
    with pytest.raises(ValueError, match="heads"):
        forgetting_attn_with_cache(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="`k`"):
        forgetting_attn_with_cache(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="`v`"):
        forgetting_attn_with_cache(q, k, v.to("meta"))
    with pytest.raises(ValueError, match="fla"):
        forgetting_attn_with_cache(q, k, v, backend="fla")
    o = forgetting_attn_with_cache(q, k, v, c, c, backend="torch")
    assert_close(o, parallel_forgetting_attn(q, k, v, g), atol=1e-5)


@pytest.mark.parametrize("with_gate", [True, False])
@pytest.mark.parametrize("window", [1, 7, 200])
def test_sliding_window_matches_fla_oracle_forward_and_backward(with_gate, window):
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn as fla_naive

    torch.manual_seed(3)
    B, T, HQ, H, D = 2, 150, 4, 2, 16
    q, k, v = torch.randn(B, T, HQ, D), torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HQ) + 2) if with_gate else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = parallel_forgetting_attn(*leaves, g, window_size=window, backend="torch")
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = fla_naive(*ref_leaves, g if g is not None else torch.zeros(B, T, HQ), window_size=window)
    assert (ours - ref).abs().max() < 1e-4
    ours.square().sum().backward()
    ref.square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert (a.grad - b.grad).abs().max() < 1e-3


def test_window_size_must_be_positive():
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="window_size"):
        parallel_forgetting_attn(q, q, q, window_size=0)


@pytest.mark.parametrize("HQ,H", [(2, 2), (4, 2)])
def test_whole_causal_attention_runs_in_the_fused_kernel_with_the_gate_in_two_channels(HQ, H, monkeypatch):
    """Training's path (no window, no cache) never goes through the blocks: PyTorch's fused kernel computes the
    gated scores exactly as the blocks do, packed sequences one by one."""
    q, k, v, g = make_inputs(1, 96, HQ, H)
    blocks = parallel_mod.block_attention(q, k, v, g.cumsum(1), g.cumsum(1), 16 ** -0.5)

    def refuse(*args, **kwargs):
        raise AssertionError("whole causal attention went through the blocks")

    monkeypatch.setattr(parallel_mod._BlockAttention, "apply", refuse)
    do = torch.randn_like(blocks)
    o = parallel_forgetting_attn(q, k, v, g)
    within_gate_rounding(o, blocks, g)
    for got, want in zip(grads(o, (q, k, v, g), do), grads(blocks, (q, k, v, g), do), strict=True):
        within_gate_rounding(got, want, g, atol=1e-4)
    packed = parallel_forgetting_attn(q, k, v, g, cu_seqlens=torch.tensor([0, 40, 96]))
    for a, b in ((0, 40), (40, 96)):
        alone = parallel_forgetting_attn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b])
        within_gate_rounding(packed[:, a:b], alone, g)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("gate", [True, False])
def test_parallel_empty_input_gives_an_empty_output(gate, window, packed):
    """T = 0, as the recurrent ops take it: an empty output, not an error from inside the kernels."""
    q, k, v, g = make_inputs(1 if packed else 2, 0, 4, 2, gate=gate)
    cu_seqlens = torch.tensor([0, 0]) if packed else None
    o = parallel_forgetting_attn(q, k, v, g, window_size=window, cu_seqlens=cu_seqlens)
    assert o.shape == (q.shape[0], 0, 4, v.shape[-1]) and o.dtype == v.dtype
