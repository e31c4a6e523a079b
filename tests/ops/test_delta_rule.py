"""Delta-rule ops (plain and gated, chunked and recurrent) against two oracles: rotarium's step-by-step
reference and fla's naive recurrences."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from fla.ops.delta_rule.naive import delta_rule_recurrence
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

import rotarium.ops.delta_rule.chunk as chunk_module
import rotarium.ops.utils as ops_utils
from rotarium.ops import backend as backend_module
from rotarium.ops.delta_rule import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
    naive_delta_rule,
    naive_gated_delta_rule,
)
from tests.asserts import assert_close, assert_close_at_scale

GATED = {"chunk_gated_delta_rule": chunk_gated_delta_rule,
         "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule}
PLAIN = {"chunk_delta_rule": chunk_delta_rule, "fused_recurrent_delta_rule": fused_recurrent_delta_rule}
OPS = {**GATED, **PLAIN}


def call(op, x, **kwargs):
    """Runs any of the four ops (or a gated oracle with the same argument order) on the inputs dict ``x``."""
    if op in GATED.values() or op is naive_gated_delta_rule:  # fla's fused op has gk and gv before beta
        return op(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x.get("h0"), **kwargs)
    return op(x["q"], x["k"], x["v"], x["beta"], initial_state=x.get("h0"), **kwargs)


def make_inputs(B=2, T=37, H=2, K=16, V=32, gated=True, h0=True, dtype=torch.float32, g_scale=1.0, N=None):
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    x = {"q": q, "k": k, "v": torch.randn(B, T, H, V), "beta": torch.rand(B, T, H)}
    if gated:
        x["g"] = F.logsigmoid(torch.randn(B, T, H) + 2) * g_scale
    x = {n: t.to(dtype) for n, t in x.items()}
    if h0:
        x["h0"] = torch.randn(N or B, H, K, V)
    return {n: t.requires_grad_() for n, t in x.items()}


def float_copy(x):
    """Float32 leaves holding the same (possibly bf16-rounded) values."""
    return {n: t.detach().float().requires_grad_() for n, t in x.items()}


def run(fn, x):
    """Outputs, final state and the gradient of a fixed random loss for every input."""
    o, s = fn(x)
    gen = torch.Generator().manual_seed(1)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum()
    if s is not None:
        loss = loss + (s * torch.randn(s.shape, generator=gen)).sum()
    names = sorted(x)
    grads = torch.autograd.grad(loss, [x[n] for n in names])
    return o, s, dict(zip(names, grads))


def assert_runs_match(a, b, tol):
    assert_close_at_scale(a[0], b[0], tol, what="o")
    if b[1] is not None:
        assert_close_at_scale(a[1], b[1], tol, what="final state")
    for name in b[2]:
        assert_close_at_scale(a[2][name], b[2][name], tol, what=f"grad {name}")


def our_oracle(gated):
    if gated:
        return lambda x: naive_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("h0"),
                                                output_final_state=True)
    return lambda x: naive_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x.get("h0"),
                                      output_final_state=True)


def fla_oracle(gated):
    if gated:
        return lambda x: naive_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"],
                                                          initial_state=x.get("h0"), output_final_state=True)

    def plain(x):  # fla's plain recurrence uses [B, H, T, D] and returns the state only on request
        q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
        o, s = delta_rule_recurrence(q, k, v, x["beta"].transpose(1, 2), x.get("h0"), output_final_state=True)
        return o.transpose(1, 2), s
    return plain


@pytest.mark.parametrize("h0", [True, False])
@pytest.mark.parametrize("T", [1, 37, 100, 130])
@pytest.mark.parametrize("name", list(OPS))
def test_float32_matches_both_oracles(name, T, h0):
    op, gated = OPS[name], name in GATED
    x = make_inputs(T=T, gated=gated, h0=h0)
    ours = run(lambda x: call(op, x, output_final_state=True), x)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.float32
    assert_runs_match(ours, run(our_oracle(gated), x), 1e-4)
    assert_runs_match(ours, run(fla_oracle(gated), x), 1e-4)


@pytest.mark.parametrize("T", [1, 37, 130])
@pytest.mark.parametrize("name", list(OPS))
def test_bfloat16_matches_oracles_on_rounded_inputs(name, T):
    op, gated = OPS[name], name in GATED
    x = make_inputs(T=T, gated=gated, dtype=torch.bfloat16)
    ours = run(lambda x: call(op, x, output_final_state=True), x)
    assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.float32
    assert all(ours[2][n].dtype == x[n].dtype for n in x)
    assert_runs_match(ours, run(our_oracle(gated), float_copy(x)), 2e-2)
    assert_runs_match(ours, run(fla_oracle(gated), float_copy(x)), 2e-2)


@pytest.mark.parametrize("h0", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_several_blocks_of_chunks(gated, h0, monkeypatch):
    monkeypatch.setattr(ops_utils, "BLOCK_CHUNK_HEADS", 8)  # B*H = 4: blocks of 2 chunks
    op = chunk_gated_delta_rule if gated else chunk_delta_rule
    x = make_inputs(T=300, gated=gated, h0=h0)  # 5 chunks: blocks of 2, 2, 1
    ours = run(lambda x: call(op, x, output_final_state=True), x)
    assert_runs_match(ours, run(our_oracle(gated), x), 1e-4)


@pytest.mark.parametrize("T", [20, 100])
@pytest.mark.parametrize("name", list(OPS))
def test_qk_l2norm_and_scale(name, T):
    op, gated = OPS[name], name in GATED
    x = make_inputs(T=T, gated=gated)
    x["k"] = (x["k"].detach() * 3).requires_grad_()  # un-normalised, so the in-kernel norm matters
    scale = 0.3

    def oracle(x):
        y = dict(x, q=x["q"] * torch.rsqrt(x["q"].pow(2).sum(-1, keepdim=True) + 1e-6),
                 k=x["k"] * torch.rsqrt(x["k"].pow(2).sum(-1, keepdim=True) + 1e-6))
        if gated:
            return naive_gated_delta_rule(y["q"], y["k"], y["v"], y["g"], y["beta"], scale, y["h0"], True)
        return naive_delta_rule(y["q"], y["k"], y["v"], y["beta"], scale, y["h0"], True)

    ours = run(lambda x: call(op, x, scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True), x)
    assert_runs_match(ours, run(oracle, x), 1e-4)


@pytest.mark.parametrize("lengths", [[37, 64, 1, 90], [5, 1, 20]])
@pytest.mark.parametrize("name", list(OPS))
def test_packed_equals_separate(name, lengths):
    op, gated = OPS[name], name in GATED
    x = make_inputs(B=1, T=sum(lengths), gated=gated, N=len(lengths))
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    packed = run(lambda x: call(op, x, output_final_state=True, cu_seqlens=cu_seqlens), x)

    def separate(x):
        outs, states = [], []
        for i, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            xi = {n: (t[i: i + 1] if n == "h0" else t[:, a:b]) for n, t in x.items()}
            o, s = call(op, xi, output_final_state=True)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, 1), torch.cat(states, 0)

    assert packed[1].shape == (len(lengths), 2, 16, 32)
    assert_runs_match(packed, run(separate, x), 1e-5)


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("gated", [True, False])
def test_prefill_then_decode_equals_one_pass(gated, step):
    chunk = chunk_gated_delta_rule if gated else chunk_delta_rule
    recurrent = fused_recurrent_gated_delta_rule if gated else fused_recurrent_delta_rule
    P, T = 70, 82
    x = make_inputs(T=T, gated=gated)
    full, full_state = call(chunk, x, output_final_state=True)
    head = {n: (t if n == "h0" else t[:, :P]) for n, t in x.items()}
    o, state = call(chunk, head, output_final_state=True)
    outs = [o]
    for a in range(P, T, step):
        xt = {n: t[:, a: a + step] for n, t in x.items() if n != "h0"}
        xt["h0"] = state
        o, state = call(recurrent, xt, output_final_state=True)
        outs.append(o)
    assert_close_at_scale(torch.cat(outs, 1), full, 1e-5, what="o")
    assert_close_at_scale(state, full_state, 1e-5, what="final state")


def test_fused_recurrent_beta_defaults_to_ones():
    x = make_inputs(T=10)
    ones = torch.ones(2, 10, 2)
    for op, g in ((fused_recurrent_gated_delta_rule, x["g"]), (fused_recurrent_delta_rule, None)):
        args = (x["q"], x["k"], x["v"]) + ((g,) if g is not None else ())
        o, s = op(*args, initial_state=x["h0"], output_final_state=True)
        o_ref, s_ref = naive_gated_delta_rule(x["q"], x["k"], x["v"], g, ones, initial_state=x["h0"],
                                              output_final_state=True)
        assert_close_at_scale(o, o_ref, 1e-5)
        assert_close_at_scale(s, s_ref, 1e-5)
    # g None in the gated op: no decay
    o, _ = fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"])
    plain, _ = fused_recurrent_delta_rule(x["q"], x["k"], x["v"], x["beta"])
    assert_close_at_scale(o, plain, 1e-6)


def test_fused_recurrent_gated_delta_rule_takes_flas_positional_order():
    """fla's order, gk and gv before beta: a positional call written for fla's op gives what keywords give. The
    per-key and per-value gates, which rotarium's kernels do not implement, are refused by name."""
    import inspect

    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_op

    ours = list(inspect.signature(fused_recurrent_gated_delta_rule).parameters)
    assert ours[:11] == list(inspect.signature(fla_op).parameters)[:11]
    x = make_inputs(T=9)
    by_name = fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=0.3,
                                               initial_state=x["h0"], output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    positional = fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], None, None, x["beta"], 0.3, x["h0"],
                                                  True, True)
    for got, expected in zip(positional, by_name):
        assert torch.equal(got, expected)
    for name, gate in (("gk", torch.zeros(2, 9, 2, 16)), ("gv", torch.zeros(2, 9, 2, 32))):
        with pytest.raises(ValueError, match=f"`{name}`.*use `g`"):
            fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], **{name: gate})


@pytest.mark.parametrize("g_value, beta_value", [(-20.0, 1e-4), (-20.0, 1 - 1e-4), (-1e-6, 1e-4), (-1e-6, 1 - 1e-4)])
@pytest.mark.parametrize("name", list(GATED))
def test_extreme_gates(name, g_value, beta_value):
    x = make_inputs(T=130)
    with torch.no_grad():
        x["g"].fill_(g_value)
        x["g"][:, ::7] = -1e-6  # mix in near-1 decays so that long and short memories meet in one chunk
        x["beta"].fill_(beta_value)
    ours = run(lambda x: call(GATED[name], x, output_final_state=True), x)
    assert_runs_match(ours, run(our_oracle(True), x), 1e-4)


@pytest.mark.parametrize("span", [0.9, 1.1])
def test_chunk_decay_just_inside_and_past_the_chunk_end_bound(span):
    """Chunks decaying by just under e^-BOUND take the rescaled path (q raised by up to e^BOUND, values lowered by
    down to e^-BOUND); just over, the masked-exponent path. Both must match the recurrence, gradients included."""
    x = make_inputs(T=130)
    with torch.no_grad():
        x["g"].fill_(-span * chunk_module.BOUND / chunk_module.CHUNK_SIZE)
    ours = run(lambda x: call(chunk_gated_delta_rule, x, output_final_state=True), x)
    assert_runs_match(ours, run(our_oracle(True), x), 1e-4)


def test_long_sequence_is_finite_and_matches_oracle():
    x = make_inputs(B=1, T=16384, H=1, K=8, V=8)
    with torch.no_grad():
        x["g"][:, 5000:5100] = -20.0
    o, s = call(chunk_gated_delta_rule, x, output_final_state=True)
    (o.sum() + s.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in x.values())
    with torch.no_grad():
        o_ref, s_ref = call(naive_gated_delta_rule, x, output_final_state=True)
    assert_close_at_scale(o, o_ref, 1e-4, what="o")
    assert_close_at_scale(s, s_ref, 1e-4, what="final state")


@pytest.mark.parametrize("use_l2norm", [False, True])
def test_matches_transformers_reference(use_l2norm):
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    reference = getattr(qwen3_next.torch_chunk_gated_delta_rule, "__wrapped__", qwen3_next.torch_chunk_gated_delta_rule)
    x = make_inputs(T=150)
    o_ref, s_ref = reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                             use_qk_l2norm_in_kernel=use_l2norm)
    o, s = call(chunk_gated_delta_rule, x, output_final_state=True, use_qk_l2norm_in_kernel=use_l2norm)
    assert_close_at_scale(o, o_ref, 1e-5, what="o")
    assert_close_at_scale(s, s_ref, 1e-5, what="final state")


def test_final_state_only_on_request():
    x = make_inputs(T=5)
    for op in OPS.values():
        assert call(op, x)[1] is None


def _bad(x, **changes):
    return {**{n: t.detach() for n, t in x.items()}, **changes}


@pytest.mark.parametrize("name", list(OPS))
def test_bad_inputs_raise(name):
    op, gated = OPS[name], name in GATED
    x = make_inputs(B=2, T=8, gated=gated)
    cases = [
        ("k", _bad(x, k=x["k"][:, :, :, :8])),
        ("v", _bad(x, v=x["v"][:1])),
        ("beta", _bad(x, beta=x["beta"][:, :4])),
        ("k", _bad(x, k=x["k"].detach().double())),
        ("v", _bad(x, v=x["v"].detach().to(torch.bfloat16))),
        ("k", _bad(x, k=torch.empty(x["k"].shape, device="meta"))),
        ("initial_state", _bad(x, h0=x["h0"][:, :1])),
    ]
    if gated:
        cases += [("g", _bad(x, g=x["g"].detach().abs() + 0.1)), ("g", _bad(x, g=x["g"][..., None]))]
    for argname, bad in cases:
        with pytest.raises(ValueError, match=argname):
            call(op, bad)

    packed = make_inputs(B=1, T=8, gated=gated, h0=False)
    for cu in ([1, 4, 8], [0, 6, 4, 8], [0, 4, 7]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            call(op, packed, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(op, _bad(x, h0=None), cu_seqlens=torch.tensor([0, 4, 8]))  # batch size 2


@pytest.mark.parametrize("name", list(OPS))
def test_backend_choice(name):
    op, gated = OPS[name], name in GATED
    x = make_inputs(T=8, gated=gated)
    with pytest.raises(ValueError, match="fla"):
        call(op, x, backend="fla")
    with pytest.raises(ValueError, match="backend"):
        call(op, x, backend="cuda")
    o, _ = call(op, x, backend="torch")
    o_ref, _ = our_oracle(gated)(x)
    assert_close_at_scale(o, o_ref, 1e-5)


def test_float32_plain_delta_rule_runs_pytorch_with_one_warning_and_the_gated_one_goes_to_fla(monkeypatch):
    # fla's plain chunked delta rule asserts on float32; its gated one takes float32, so only the plain one stays here
    monkeypatch.setattr(backend_module, "fla_device", lambda x: True)  # pretend CUDA and fla
    backend_module._warn_once.cache_clear()
    x = make_inputs(T=8, gated=False)
    with pytest.warns(UserWarning, match="float32"):
        o, _ = call(chunk_delta_rule, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o_again, _ = call(chunk_delta_rule, x)
    assert_close(o, o_again, 0, rtol=0)
    fla_module = pytest.importorskip("fla.ops.gated_delta_rule")
    monkeypatch.setattr(fla_module, "chunk_gated_delta_rule", lambda **kwargs: ("fla", None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call(chunk_gated_delta_rule, make_inputs(T=8, gated=True))[0] == "fla"


@pytest.mark.parametrize("C", [64, 128, 48, 16])
def test_unit_lower_inverse_reads_only_the_strict_lower_triangle(C):
    torch.manual_seed(0)
    A = torch.randn(3, 2, C, C, dtype=torch.float64) * 0.3
    A_with_garbage = A.tril(-1) + torch.randn_like(A).triu() * 1e6  # diagonal and above: never read
    expected = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.tril(-1))
    assert torch.allclose(chunk_module.unit_lower_inverse_(A_with_garbage), expected, atol=1e-10)
    leaf = (torch.randn(2, C, C, dtype=torch.float64) * 0.1).requires_grad_()
    # gradcheck on a copy: the op overwrites its input
    assert torch.autograd.gradcheck(lambda a: chunk_module.unit_lower_inverse_(a.clone()), (leaf,), fast_mode=True)


@pytest.mark.parametrize("T", [0, 3])
def test_naive_oracle_returns_the_dtype_of_v(T):
    x = make_inputs(T=T, dtype=torch.bfloat16)
    o, _ = naive_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert o.dtype == torch.bfloat16 and o.shape == x["v"].shape
