"""GLA ops against two oracles: rotarium's step-by-step reference and fla's naive PyTorch reference."""
import pytest
import torch
import torch.nn.functional as F

import rotarium.ops.utils as ops_utils
from rotarium.ops.gla import chunk_gla, fused_recurrent_gla, naive_recurrent_gla
from rotarium.ops.gla.chunk import BOUND, CHUNK_SIZE
from tests.asserts import assert_close_at_scale

fla_naive = pytest.importorskip("fla.ops.gla.naive").naive_recurrent_gla


def make_inputs(B=2, T=100, H=2, K=16, V=32, dtype=torch.float32, gate_scale=1.0, gv=False):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H, K) * 2) * gate_scale
    out = {"q": q, "k": k, "v": v, "g": g}
    if gv:
        out["gv"] = F.logsigmoid(torch.randn(B, T, H, V) * 2)
    return {name: x.to(dtype) for name, x in out.items()}


def grads(o, ht, inputs, seed=1):
    """Gradients of a random linear function of (o, ht) w.r.t. the differentiable inputs."""
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum()
    if ht is not None:
        loss = loss + (ht * torch.randn(ht.shape, generator=gen)).sum()
    return torch.autograd.grad(loss, inputs)


def leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_() for x in xs]


def run_chunk(q, k, v, g, h0, final, **kw):
    return chunk_gla(q, k, v, g, initial_state=h0, output_final_state=final, **kw)


def run_fused(q, k, v, g, h0, final, **kw):
    return fused_recurrent_gla(q, k, v, gk=g, initial_state=h0, output_final_state=final, **kw)


def run_ours_naive(q, k, v, g, h0, final):
    return naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=final)


def run_fla_naive(q, k, v, g, h0, final):
    o, ht = fla_naive(q, k, v, g, initial_state=h0, output_final_state=final)
    return o, ht


OPS = {"chunk": run_chunk, "fused": run_fused}
ORACLES = {"ours": run_ours_naive, "fla": run_fla_naive}


def check_against(op, oracle, inputs, h0, final, tol):
    """Forward, final state and every gradient of ``op`` against ``oracle`` (run in float32), each within ``tol`` at
    its own scale."""
    xs = leaves(inputs["q"], inputs["k"], inputs["v"], inputs["g"], h0)
    o, ht = op(*xs, final)
    ref_xs = leaves(*(x.float() for x in xs[:4]), h0)  # same (possibly bf16-rounded) values
    o_ref, ht_ref = oracle(*ref_xs, final)
    assert o.dtype == inputs["v"].dtype and o.shape == o_ref.shape
    assert_close_at_scale(o, o_ref, tol, what="o")
    if final:
        assert ht.dtype == torch.float32
        assert_close_at_scale(ht, ht_ref, tol, what="final state")
    else:
        assert ht is None
    diff = [x for x in xs if x is not None]
    ref_diff = [x for x in ref_xs if x is not None]
    for name, a, b in zip("qkvgh", grads(o, ht, diff), grads(o_ref, ht_ref, ref_diff)):
        assert torch.isfinite(a).all(), name
        assert a.dtype == b.dtype if name == "h" else a.dtype == inputs["q"].dtype
        assert_close_at_scale(a, b, tol, what=f"grad {name}")


# (T, state): T = 1, a whole chunk, lengths that are not a multiple of 64; every initial/final combination
CASES = [(1, "none"), (1, "both"), (64, "initial"), (100, "both"), (130, "final"), (130, "none")]


# A mean log decay of about -0.09 a step keeps every chunk's decay within e^-BOUND (the chunk kernel measures
# exponents from the chunk ends); about -0.9 a step takes most chunks past it (exponents centred, or bisection).
GATE_SCALES = {"mild": 0.1, "strong": 1.0}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize(("T", "state"), CASES)
@pytest.mark.parametrize("gates", GATE_SCALES)
def test_matches_oracles_float32(op, oracle, T, state, gates):
    inputs = make_inputs(T=T, gate_scale=GATE_SCALES[gates])
    h0 = torch.randn(2, 2, 16, 32) if state in ("initial", "both") else None
    check_against(OPS[op], ORACLES[oracle], inputs, h0, state in ("final", "both"), tol=2e-4)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("gates", GATE_SCALES)
def test_bfloat16_inputs(op, oracle, gates):
    inputs = make_inputs(T=130, dtype=torch.bfloat16, gate_scale=GATE_SCALES[gates])
    check_against(OPS[op], ORACLES[oracle], inputs, torch.randn(2, 2, 16, 32), True, tol=3e-2)


def test_custom_scale():
    x = make_inputs(T=100)
    for op in (chunk_gla, fused_recurrent_gla):
        o, ht = op(x["q"], x["k"], x["v"], x["g"], scale=0.3, output_final_state=True)
        o_ref, ht_ref = naive_recurrent_gla(x["q"], x["k"], x["v"], x["g"], scale=0.3, output_final_state=True)
        assert_close_at_scale(o, o_ref, 1e-4)
        assert_close_at_scale(ht, ht_ref, 1e-4)


@pytest.mark.parametrize("T", [3, 80])  # the step loop, and (gk only) the chunked path for a long input
@pytest.mark.parametrize("gates", ["gk", "gv", "gk+gv", "none"])
@pytest.mark.parametrize("reverse", [False, True])
def test_fused_recurrent_gates_and_reverse(T, gates, reverse):
    x = make_inputs(T=T, gv=True)
    gk = x["g"] if "gk" in gates else None
    gv = x["gv"] if "gv" in gates else None
    xs = leaves(x["q"], x["k"], x["v"], gk, gv, torch.randn(2, 2, 16, 32))
    kw = {"initial_state": xs[5], "output_final_state": True, "reverse": reverse}
    o, ht = fused_recurrent_gla(*xs[:5], **kw)
    o_ref, ht_ref = naive_recurrent_gla(*xs[:5], **kw)
    assert_close_at_scale(o, o_ref, 2e-4)
    assert_close_at_scale(ht, ht_ref, 2e-4)
    diff = [x for x in xs if x is not None]
    for a, b in zip(grads(o, ht, diff), grads(o_ref, ht_ref, diff)):
        assert_close_at_scale(a, b, 1e-3)
    if gv is None:  # fla's oracle has no value gate; reverse is the forward recurrence on flipped time
        flip = (lambda t: t.flip(1)) if reverse else (lambda t: t)
        g = gk if gk is not None else torch.zeros_like(x["k"])
        o_fla, ht_fla = fla_naive(*(flip(t) for t in (xs[0], xs[1], xs[2], g)), initial_state=xs[5],
                                  output_final_state=True)
        assert_close_at_scale(o, flip(o_fla), 2e-4)
        assert_close_at_scale(ht, ht_fla, 2e-4)


@pytest.mark.parametrize("op", ["chunk", "fused", "fused_gv"])
@pytest.mark.parametrize("with_h0", [False, True])
def test_packed_equals_separate(op, with_h0):
    lengths = [37, 64, 1, 90]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs(B=1, T=sum(lengths), gv=True)
    h0 = torch.randn(len(lengths), 2, 16, 32) if with_h0 else None
    xs = leaves(x["q"], x["k"], x["v"], x["g"], x["gv"], h0)

    def call(q, k, v, g, gv, h0, cu_seqlens=None):
        if op == "chunk":
            return chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
        return fused_recurrent_gla(q, k, v, g, gv if op == "fused_gv" else None, initial_state=h0,
                                   output_final_state=True, cu_seqlens=cu_seqlens)

    o, ht = call(*xs, cu_seqlens=cu)
    outs, finals = [], []
    for i, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, ht_i = call(*(t[:, bos:eos] for t in xs[:5]), None if h0 is None else xs[5][i:i + 1])
        outs.append(o_i)
        finals.append(ht_i)
    o_sep, ht_sep = torch.cat(outs, 1), torch.cat(finals)
    assert_close_at_scale(o, o_sep, 1e-4)
    assert_close_at_scale(ht, ht_sep, 1e-4)
    diff = [t for i, t in enumerate(xs) if t is not None and (i != 4 or op == "fused_gv")]
    for a, b in zip(grads(o, ht, diff), grads(o_sep, ht_sep, diff)):
        assert_close_at_scale(a, b, 5e-4)


def test_packed_matches_naive_reverse():
    cu = torch.tensor([0, 37, 101, 102, 192])
    x = make_inputs(B=1, T=192)
    h0 = torch.randn(4, 2, 16, 32)
    for reverse in (False, True):
        o, ht = fused_recurrent_gla(x["q"], x["k"], x["v"], x["g"], initial_state=h0, output_final_state=True,
                                    reverse=reverse, cu_seqlens=cu)
        o_ref, ht_ref = naive_recurrent_gla(x["q"], x["k"], x["v"], x["g"], initial_state=h0,
                                            output_final_state=True, reverse=reverse, cu_seqlens=cu)
        assert_close_at_scale(o, o_ref, 2e-4)
        assert_close_at_scale(ht, ht_ref, 2e-4)


@pytest.mark.parametrize("step", [1, 3])
def test_prefill_then_decode(step):
    x = make_inputs(T=130)
    o_full, ht_full = chunk_gla(x["q"], x["k"], x["v"], x["g"], output_final_state=True)
    P = 100
    o_pre, state = chunk_gla(*(t[:, :P] for t in x.values()), output_final_state=True)
    outs = [o_pre]
    for t in range(P, 130, step):
        o_t, state = fused_recurrent_gla(*(u[:, t:t + step] for u in x.values()), initial_state=state,
                                         output_final_state=True)
        outs.append(o_t)
    assert_close_at_scale(torch.cat(outs, 1), o_full, 1e-4)
    assert_close_at_scale(state, ht_full, 1e-4)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("regime", ["strong", "near_zero", "near_one", "mixed", "by_chunk"])
def test_extreme_decays(op, regime):
    x = make_inputs(T=130)
    shape = x["g"].shape
    x["g"] = {
        "strong": torch.full(shape, -20.0),  # a gate of e^-20 every step: cumulative -2600 over a chunk
        "near_zero": -20.0 * torch.rand(shape),
        "near_one": -1e-4 * torch.rand(shape),
        "mixed": torch.where(torch.rand(shape) < 0.5, -20.0, -1e-4 * torch.rand(shape)),
        # some chunks with strong decay, some mild: the chunk kernel takes two paths in one call
        "by_chunk": torch.where((torch.arange(130) // 64 % 2 == 0)[:, None, None], -20.0, -0.05 * torch.rand(shape)),
    }[regime]
    for oracle in ORACLES.values():
        check_against(OPS[op], oracle, x, torch.randn(2, 2, 16, 32), True, tol=2e-4)


@pytest.mark.parametrize("regime", ["usual", "by_chunk"])
def test_several_blocks_of_chunks(regime, monkeypatch):
    monkeypatch.setattr(ops_utils, "BLOCK_CHUNK_HEADS", 8)  # B*H = 4: blocks of 2 chunks
    x = make_inputs(T=300, gate_scale=GATE_SCALES["mild"] if regime == "usual" else 1.0)  # 5 chunks: blocks of 2, 2, 1
    if regime == "by_chunk":  # blocks differ in whether their exponents need the floor
        strong = (torch.arange(300) // 128 % 2 == 0)[:, None, None]
        x["g"] = torch.where(strong, -20.0, -0.05 * torch.rand(x["g"].shape))
    for oracle in ORACLES.values():
        check_against(run_chunk, oracle, x, torch.randn(2, 2, 16, 32), True, tol=2e-4)


@pytest.mark.parametrize("span", [0.9, 1.1])
def test_chunk_decay_just_inside_and_past_the_chunk_end_bound(span):
    """A chunk decaying by just under e^-BOUND has queries scaled by up to e^BOUND; just over, the other path."""
    x = make_inputs(T=130)
    x["g"] = torch.full(x["g"].shape, -span * BOUND / CHUNK_SIZE)
    for oracle in ORACLES.values():
        check_against(run_chunk, oracle, x, torch.randn(2, 2, 16, 32), True, tol=2e-4)


def test_long_sequence():
    T = 16384
    x = make_inputs(B=1, T=T, H=1, K=8, V=8, gate_scale=0.05)
    x["g"][0, 5000:5100] = -20.0  # a burst of strong decay in the middle
    xs = leaves(*x.values())
    o, ht = chunk_gla(*xs, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    for grad in grads(o, ht, xs):
        assert torch.isfinite(grad).all()
    with torch.no_grad():
        o_ref, ht_ref = naive_recurrent_gla(*x.values(), output_final_state=True)
    assert_close_at_scale(o, o_ref, 1e-3)
    assert_close_at_scale(ht, ht_ref, 1e-3)


def test_backend_choice():
    x = make_inputs(T=10)
    for op in (chunk_gla, fused_recurrent_gla):
        o, _ = op(x["q"], x["k"], x["v"], x["g"], backend="torch")
        assert o.shape == x["v"].shape
        with pytest.raises(ValueError, match="fla"):
            op(x["q"], x["k"], x["v"], x["g"], backend="fla")
        with pytest.raises(ValueError, match="backend"):
            op(x["q"], x["k"], x["v"], x["g"], backend="triton")


def _bad_inputs():
    x = make_inputs(B=2, T=10)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    cu = torch.tensor([0, 4, 10])
    one = {name: t[:1] for name, t in x.items()}
    return [
        ("k", {"q": q, "k": k[:, :9], "v": v, "g": g}),
        ("v", {"q": q, "k": k, "v": v[:, :, :1], "g": g}),
        ("q", {"q": q[0], "k": k, "v": v, "g": g}),
        ("GATE", {"q": q, "k": k, "v": v, "g": g[..., :3]}),
        ("GATE", {"q": q, "k": k, "v": v, "g": g.abs() + 0.1}),
        ("k", {"q": q, "k": k.double(), "v": v, "g": g}),
        ("v", {"q": q, "k": k, "v": v.half(), "g": g}),
        ("k", {"q": q, "k": k.to("meta"), "v": v, "g": g}),
        ("initial_state", {"q": q, "k": k, "v": v, "g": g, "initial_state": torch.zeros(3, 2, 16, 32)}),
        ("initial_state", {"q": q, "k": k, "v": v, "g": g, "initial_state": torch.zeros(2, 2, 16, 32, device="meta")}),
        ("cu_seqlens", {"q": q, "k": k, "v": v, "g": g, "cu_seqlens": cu}),  # batch size 2
        ("cu_seqlens", dict(**one, cu_seqlens=torch.tensor([1, 4, 10]))),
        ("cu_seqlens", dict(**one, cu_seqlens=torch.tensor([0, 6, 4, 10]))),
        ("cu_seqlens", dict(**one, cu_seqlens=torch.tensor([0, 4, 9]))),
        ("initial_state", dict(**one, cu_seqlens=cu, initial_state=torch.zeros(1, 2, 16, 32))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
@pytest.mark.parametrize("op", ["chunk", "fused"])
def test_bad_input_raises(case, op):
    name, kwargs = _bad_inputs()[case]
    if op == "chunk":
        fn = chunk_gla
        name = "g" if name == "GATE" else name
    else:
        fn = fused_recurrent_gla
        kwargs["gk"] = kwargs.pop("g")
        name = "gk" if name == "GATE" else name
    with pytest.raises(ValueError, match=f"`{name}`"):
        fn(**kwargs)


def test_bad_value_gate_raises():
    x = make_inputs(T=10, gv=True)
    with pytest.raises(ValueError, match="`gv`"):
        fused_recurrent_gla(x["q"], x["k"], x["v"], gv=x["gv"][..., :3])
    with pytest.raises(ValueError, match="`gv`"):
        fused_recurrent_gla(x["q"], x["k"], x["v"], gv=-x["gv"] + 0.1)
