"""The positional layer's defining properties, each against an independent formulation."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from rotarium.layers import MixerSpec, PositionalSettings, SequenceInfo, build_positional
from rotarium.layers.positional import (
    POSITION_ENCODINGS,
    ROPE_FREQUENCY_ENCODINGS,
    NoPE,
    PositionalEncoding,
    RoPE,
)
from rotarium.layers.state import SelectiveRoPEState
from rotarium.models import build_mixer
from rotarium.ops import chunk_gla
from rotarium.ops.cumsum import segment_cumsum
from rotarium.synthetic.runner import POSITIONS as RUN_POSITIONS
from rotarium.training.config import ModelSection
from tests.layers.helpers import FAMILIES, HIDDEN, make_mixer, run
from tests.ops.test_rotary import rotation_matrix

T = 24


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pe", ["rope", "rove"])
def test_shifting_positions_leaves_output_unchanged(family, pe):
    mixer = make_mixer(family, pe)
    x = torch.randn(2, T, HIDDEN)
    positions = torch.arange(T).expand(2, T)
    base, _ = run(mixer, x, position_ids=positions)
    shifted, _ = run(mixer, x, position_ids=positions + 1234)
    assert (base - shifted).abs().max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_rove_differs_from_rope_on_the_same_weights(family):
    rope, rove = make_mixer(family, "rope"), make_mixer(family, "rove")
    rove.load_state_dict(rope.state_dict())
    x = torch.randn(1, T, HIDDEN)
    assert (run(rope, x)[0] - run(rove, x)[0]).abs().max() > 1e-3


def adjacent_rotation_matrix(angles: torch.Tensor) -> torch.Tensor:
    """[P] angles -> [2P, 2P] block rotation acting on adjacent pairs (2i, 2i + 1): RoVE's value pairing."""
    blocks = [torch.tensor([[a.cos(), -a.sin()], [a.sin(), a.cos()]], dtype=torch.float64) for a in angles]
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("family", ["transformer", "fox"])
def test_rove_equals_the_explicit_attentive_convolution(family):
    """y_i = sum_j A_ij R_{j-i} W_V x_j, with A the softmax attention of the RoPE-rotated q and k (for FoX, with the
    forget gate's c_i - c_j added to the logits, c the running sum of the log forget gates)."""
    overrides = {"num_kv_heads": 4} if family == "transformer" else {"qk_norm": False, "output_gate": False}
    mixer = make_mixer(family, "rove", **overrides).double()
    x = torch.randn(1, T, HIDDEN, dtype=torch.float64)
    out, _ = run(mixer, x)
    H, D = mixer.num_heads, mixer.head_dim
    q = mixer.q_proj(x).view(T, H, D)
    k = mixer.k_proj(x).view(T, H, D)
    v = mixer.v_proj(x).view(T, H, D)
    c = F.logsigmoid(mixer.fgate_proj(x)[0]).cumsum(0) if family == "fox" else torch.zeros(T, H, dtype=torch.float64)
    base = mixer.positional.settings.rope_theta
    qk_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    v_freq = qk_freq  # the value head size equals the key head size here
    rot = [rotation_matrix(t * qk_freq) for t in range(T)]
    y = torch.zeros(T, H, D, dtype=torch.float64)
    for h in range(H):
        logits = torch.stack([torch.stack([(rot[i] @ q[i, h]) @ (rot[j] @ k[j, h]) * D ** -0.5 + c[i, h] - c[j, h]
                                           for j in range(T)]) for i in range(T)])
        A = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        for i in range(T):
            y[i, h] = sum(A[i, j] * (adjacent_rotation_matrix((j - i) * v_freq) @ v[j, h]) for j in range(i + 1))
    expected = mixer.o_proj(y.reshape(1, T, H * D))
    assert (out - expected).abs().max() <= 1e-5  # the ops compute in float32


def test_rove_on_linear_attention_is_the_attentive_convolution():
    """RoVE on a decaying linear kernel, built from the paper's equation rather than from our layer:
    y_i = sum_{j<=i} A_ij R_{j-i} v_j with A_ij = scale * exp(c_i - c_j) * (R_i q_i) . (R_j k_j): each value turns in
    at its key's position and back out at the query's (Garcia-Castellanos et al., "Rotary Value Embeddings")."""
    B, H, K, V = 1, 2, 8, 6
    layer = build_positional(PositionalSettings(position_encoding="rove", rope_theta=50.0),
                             MixerSpec(HIDDEN, H, H, K, V, has_decay=True))
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64) for D in (K, K, V))
    log_decay = F.logsigmoid(torch.randn(B, T, H, dtype=torch.float64) + 2)
    x = torch.randn(B, T, HIDDEN, dtype=torch.float64)
    enc = layer(q, k, v, x, SequenceInfo.build(x), None)
    o, _ = chunk_gla(enc.q, enc.k, enc.v, log_decay[..., None].expand(B, T, H, K), backend="torch")
    ours = enc.restore(o)

    qk_freq = 50.0 ** (-torch.arange(0, K, 2, dtype=torch.float64) / K)
    v_freq = 50.0 ** (-torch.arange(0, V, 2, dtype=torch.float64) / V)
    c = log_decay[0].cumsum(0)  # [T, H]
    expected = torch.zeros(T, H, V, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            qi = rotation_matrix(i * qk_freq) @ q[0, i, h]
            for j in range(i + 1):
                score = K ** -0.5 * torch.exp(c[i, h] - c[j, h]) * (qi @ (rotation_matrix(j * qk_freq) @ k[0, j, h]))
                expected[i, h] += score * (adjacent_rotation_matrix((j - i) * v_freq) @ v[0, j, h])
    assert (ours[0].double() - expected).abs().max() <= 1e-5


def selective(family_dims: MixerSpec, **options) -> torch.nn.Module:
    settings = PositionalSettings(position_encoding="selective_rope", **options)
    torch.manual_seed(1)
    layer = build_positional(settings, family_dims).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer


@pytest.mark.parametrize("options", [{}, {"selective_rope_bias": True, "selective_rope_phase_gate": True},
                                     {"selective_rope_rank": None, "selective_rope_activation": None},
                                     {"selective_rope_spectrum": "rfa"}, {"selective_rope_skip_conv": True},
                                     {"selective_rope_rank": None, "selective_rope_gain_per_head": True}])
def test_selective_rope_equals_the_complex_recurrence(options):
    """Linear kernel on rotated q, k == S_t = lambda_t diag(exp(-i tau omega_t)) S_{t-1} + kc_t v_t^T."""
    B, H, K, V = 2, 2, 8, 4
    layer = selective(MixerSpec(HIDDEN, H, H, K, V, has_decay=True), **options)
    x = torch.randn(B, T, HIDDEN, dtype=torch.float64)
    q, k, v = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64), \
        torch.randn(B, T, H, V, dtype=torch.float64)
    log_lambda = F.logsigmoid(torch.randn(B, T, H, dtype=torch.float64) + 2)
    seq = SequenceInfo.build(x)
    enc = layer(q, k, v, x, seq, None)
    ours, _ = chunk_gla(enc.q, enc.k, enc.v, log_lambda[..., None].expand(B, T, H, K), backend="torch")

    omega, _, _ = layer.angle_rates(x, seq, None)  # [B, T, H, K/2]
    step_angle = omega.double() * layer.tau.double()
    qc = torch.complex(q[..., :K // 2], q[..., K // 2:])
    kc = torch.complex(k[..., :K // 2], k[..., K // 2:])
    S = torch.zeros(B, H, K // 2, V, dtype=torch.complex128)
    expected = torch.zeros(B, T, H, V, dtype=torch.float64)
    for t in range(T):
        transition = log_lambda[:, t].exp()[..., None] * torch.exp(-1j * step_angle[:, t])  # [B, H, K/2]
        S = transition[..., None] * S + kc[:, t, :, :, None] * v[:, t, :, None, :].to(S.dtype)
        expected[:, t] = K ** -0.5 * torch.einsum("bhk,bhkv->bhv", qc[:, t].conj(), S).real
    assert (ours.double() - expected).abs().max() <= 1e-5


def test_softmax_logits_depend_only_on_angle_differences():
    B, H, K = 1, 2, 8
    layer = selective(MixerSpec(HIDDEN, H, H, K, K, has_decay=False))
    x = torch.randn(B, T, HIDDEN, dtype=torch.float64)
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.float64) for _ in range(3))
    seq = SequenceInfo.build(x)
    enc = layer(q, k, v, x, seq, None)
    shifted = layer(q, k, v, x, seq, SelectiveRoPEState(torch.full((B, H, K // 2), 17.3, dtype=torch.float64), None))
    logits = torch.einsum("bihk,bjhk->bhij", enc.q, enc.k)
    assert (logits - torch.einsum("bihk,bjhk->bhij", shifted.q, shifted.k)).abs().max() <= 1e-5  # angles are float32
    # and explicitly: q_t^T R(theta_s - theta_t) k_s
    omega, _, _ = layer.angle_rates(x, seq, None)
    theta = omega.double().cumsum(1) * layer.tau.double()
    i, j = 9, 4
    diff = theta[0, j, 0] - theta[0, i, 0]
    assert torch.allclose(logits[0, 0, i, j], q[0, i, 0] @ rotation_matrix(diff) @ k[0, j, 0], atol=1e-5)


def test_zero_angle_projection_reduces_to_nope_with_the_same_decay():
    sel = make_mixer("transformer", "selective_rope")
    with torch.no_grad():
        sel.positional.phi_up.weight.zero_()
    # FoX with NoPE is the same attention with the decay as its forget gate
    fox = build_mixer("fox", hidden_size=HIDDEN, num_heads=4, num_kv_heads=2,
                      positional=PositionalSettings(position_encoding="nope"))
    state = {k: v for k, v in sel.state_dict().items() if not k.startswith("positional")}
    state["fgate_proj.weight"] = sel.positional.decay_proj.weight
    state["fgate_proj.bias"] = sel.positional.decay_proj.bias
    fox.load_state_dict(state)
    x = torch.randn(2, T, HIDDEN)
    assert (run(sel, x)[0] - run(fox, x)[0]).abs().max() <= 1e-6
    # on a mixer with its own decay, zero angles are exactly NoPE
    gla_sel, gla_nope = make_mixer("gla", "selective_rope"), make_mixer("gla", "nope")
    with torch.no_grad():
        gla_sel.positional.phi_up.weight.zero_()
    state = {k: v for k, v in gla_sel.state_dict().items() if not k.startswith("positional")}
    for name in ("gk_proj.1.weight", "gk_proj.1.bias"):  # the tied pair gate, written out per channel
        per_pair = state[name].view(gla_sel.num_heads, gla_sel.head_k_dim // 2, -1)
        state[name] = torch.cat([per_pair, per_pair], 1).reshape(-1, *state[name].shape[1:])
    gla_nope.load_state_dict(state)
    assert (run(gla_sel, x)[0] - run(gla_nope, x)[0]).abs().max() <= 1e-6


def test_gla_with_a_gate_per_key_feature_is_the_reference_construction():
    """``rotary_gate_per_pair=False``: fla's GLA (one decay per key feature) on q and k turned by RoPE before the
    kernel, as the Selective RoPE reference builds it; checked against the NoPE mixer with the same weights whose
    q and k are rotated by RoPE's definition."""
    untied = make_mixer("gla", "rope", rotary_gate_per_pair=False)
    nope = make_mixer("gla", "nope")
    assert untied.gk_proj[1].out_features == untied.num_heads * untied.head_k_dim  # one gate per key feature
    nope.load_state_dict(untied.state_dict())
    K = untied.head_k_dim
    freq = 10000 ** (-torch.arange(0, K, 2, dtype=torch.float64) / K)
    rotations = torch.stack([rotation_matrix(t * freq) for t in range(T)]).float()  # [T, K, K]

    def rotated(q, k, v, x, seq, state):
        enc = type(nope.positional).forward(nope.positional, q, k, v, x, seq, state)
        turn = lambda y: torch.einsum("tij,bthj->bthi", rotations, y)
        return type(enc)(turn(enc.q), turn(enc.k), enc.v, enc.log_decay, enc.state)

    nope.positional.forward = rotated
    x = torch.randn(2, T, HIDDEN)
    assert (run(untied, x)[0] - run(nope, x)[0]).abs().max() <= 1e-5
    # the default ties each rotated pair's decay: fewer gate outputs, another function
    assert make_mixer("gla", "rope").gk_proj[1].out_features == untied.num_heads * K // 2


def test_selective_decay_is_on_only_for_mixers_without_one():
    assert make_mixer("transformer", "selective_rope").positional.adds_decay
    assert make_mixer("deltanet", "selective_rope").positional.adds_decay
    assert not make_mixer("deltanet", "selective_rope", use_gated_delta=True).positional.adds_decay
    assert not make_mixer("gla", "selective_rope").positional.adds_decay
    assert not make_mixer("fox", "selective_rope").positional.adds_decay
    assert not make_mixer("transformer", "selective_rope", selective_rope_decay=False).positional.adds_decay


def test_rope_rotation_matches_the_definition():
    settings = PositionalSettings(position_encoding="rope", partial_rotary_factor=0.5)
    layer = build_positional(settings, MixerSpec(HIDDEN, 2, 2, 16, 16, False))
    q = torch.randn(1, 5, 2, 16, dtype=torch.float64)
    enc = layer(q, q, q, torch.zeros(1, 5, HIDDEN), SequenceInfo.build(torch.zeros(1, 5, HIDDEN)), None)
    freq = 10000 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    R = rotation_matrix(3 * freq)
    assert torch.allclose(enc.q[0, 3, 1, :8].double(), R @ q[0, 3, 1, :8], atol=1e-6)
    assert torch.equal(enc.q[..., 8:], q[..., 8:])  # the partial rest is untouched
    assert torch.equal(enc.v, q)


@pytest.mark.parametrize("make,match", [
    (lambda: make_mixer("transformer", "rope", head_dim=7, num_kv_heads=4), "rotary dimension"),
    (lambda: make_mixer("gla", "rope", partial_rotary_factor=0.1), "partial_rotary_factor"),
    (lambda: build_positional(PositionalSettings(position_encoding="rove"), MixerSpec(32, 2, 2, 8, 7, False)),
     "value head size"),
    (lambda: make_mixer("gla", "alibi"), "position_encoding"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_activation="gelu"), "selective_rope_activation"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_spectrum="linear"), "selective_rope_spectrum"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_decay=True), "selective_rope_decay"),
    (lambda: make_mixer("gla", "nope", num_heads=5), "num_heads"),
    (lambda: make_mixer("transformer", "nope", num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (lambda: make_mixer("deltanet", "nope", expand_k=0.3), "expand_k"),
    (lambda: build_mixer("mamba", hidden_size=32), "family"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_temperature_base=0.0), "temperature_base"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_tau_max=-1.0), "tau_max"),
    # NaN or infinite temperatures passed `<= 0` and made every output NaN; a string or float size crashed later
    (lambda: make_mixer("gla", "selective_rope", selective_rope_tau_max=float("nan")), "selective_rope_tau_max"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_tau_max="1"), "selective_rope_tau_max"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_temperature_base=float("inf")), "temperature_base"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_rfa_theta="0.5"), "selective_rope_rfa_theta"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_conv_size=2.0), "selective_rope_conv_size"),
    (lambda: make_mixer("gla", "selective_rope", selective_rope_gain_per_head=True), "selective_rope_gain_per_head"),
])
def test_invalid_settings_raise_a_clear_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_temperature_base_one_turns_every_pair_at_tau_max():
    """The Selective RoPE reference's state-tracking setting: base 1.0, a uniform spectrum."""
    settings = PositionalSettings(position_encoding="selective_rope", selective_rope_temperature_base=1.0,
                                  selective_rope_tau_max=0.5)
    enc = build_positional(settings, MixerSpec(HIDDEN, 2, 2, 8, 8, True))
    assert torch.allclose(enc.tau.float(), torch.full_like(enc.tau.float(), 0.5))


def test_rfa_spectrum_is_the_reference_tan_profile_and_saved():
    """tau_i = tau_max * tan(a_i / 2) / max tan, a_i evenly spaced over [0, rfa_theta * pi]: from 0 up to tau_max."""
    dims = MixerSpec(HIDDEN, 2, 2, 8, 8, True)
    settings = PositionalSettings(position_encoding="selective_rope", selective_rope_spectrum="rfa",
                                  selective_rope_rfa_theta=0.9, selective_rope_tau_max=0.25)
    enc = build_positional(settings, dims)
    angles = [i * 0.9 * math.pi / 3 for i in range(4)]
    expected = [0.25 * math.tan(a / 2) / math.tan(angles[-1] / 2) for a in angles]
    assert torch.allclose(enc.tau.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-7)
    assert "tau" in enc.state_dict() and not enc.tau.requires_grad


def test_skip_conv_makes_the_angle_the_projection_of_the_current_token():
    """The reference's skip_conv: omega_t = phi_t - phi_{t-1}, so theta_t = phi_t depends on token t alone, within
    each packed document, and the first difference stays frozen."""
    layer = selective(MixerSpec(HIDDEN, 2, 2, 8, 4, has_decay=True), selective_rope_skip_conv=True)
    assert not layer.conv.weight.requires_grad
    with torch.no_grad():  # `selective` perturbs every tensor, the frozen difference too
        layer.conv.weight.copy_(layer.special_init()["conv.weight"])
    x = torch.randn(1, T, HIDDEN, dtype=torch.float64)
    changed = x.clone()
    changed[:, 3] += 1.0
    cu_seqlens = torch.tensor([0, 5, T])

    def theta(inputs: torch.Tensor) -> torch.Tensor:
        seq = SequenceInfo.build(inputs, cu_seqlens=cu_seqlens)
        omega, _, _ = layer.angle_rates(inputs, seq, None)
        return segment_cumsum(omega, cu_seqlens)

    a, b = theta(x), theta(changed)
    assert torch.allclose(a[:, :3], b[:, :3]) and torch.allclose(a[:, 4:], b[:, 4:])
    assert not torch.allclose(a[:, 3], b[:, 3])


# The Selective RoPE options of every configuration of the reference's repository
# (https://github.com/timurcarstensen/selective-rope, configs/<task>/...; docs/reference_settings.md maps them)
REFERENCE_SELECTIVE_ROPE = {
    # state_tracking.yaml: temp_type rope, temp_theta 1.0, temp_max 1.0, use_bias true, use_gate false
    "state_tracking": {"selective_rope_temperature_base": 1.0, "selective_rope_tau_max": 1.0,
                       "selective_rope_bias": True, "selective_rope_activation": None},
    # copying.yaml: temp_type rfa, temp_theta 0.9999, temp_max 0.25, skip_conv true, use_gate and use_bias true (the
    # grid's other corner is the default)
    "copying": {"selective_rope_spectrum": "rfa", "selective_rope_rfa_theta": 0.9999, "selective_rope_tau_max": 0.25,
                "selective_rope_skip_conv": True, "selective_rope_bias": True, "selective_rope_phase_gate": True,
                "selective_rope_activation": None},
    # mad: model/position_embedding/selective_rope.yaml as it stands (temp_theta 500000, rank 32, conv_act null)
    "mad": {"selective_rope_temperature_base": 500000.0, "selective_rope_rank": 32,
            "selective_rope_activation": None},
    # language_modeling.yaml: phi_parametrization full-rank (one gain per head), use_gate true (standard), use_bias
    # false, conv_act silu
    "language_modeling": {"selective_rope_rank": None, "selective_rope_gain_per_head": True,
                          "selective_rope_phase_gate": True, "selective_rope_activation": "silu"},
    # temp_grad true, the option every config leaves false
    "learned_temperature": {"selective_rope_learn_temperature": True},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("config", list(REFERENCE_SELECTIVE_ROPE))
def test_every_reference_setting_is_accepted_and_runs(family, config):
    mixer = make_mixer(family, "selective_rope", **REFERENCE_SELECTIVE_ROPE[config])
    out, _ = run(mixer, torch.randn(2, T, HIDDEN))
    assert out.shape == (2, T, HIDDEN) and torch.isfinite(out).all()


def test_temperature_bases_below_one_are_accepted_and_default_settings_are_unchanged():
    """Any base > 0 is a spectrum (below 1 the frequencies rise with the pair index); the defaults stay the
    paper's language-model setting."""
    settings = PositionalSettings(position_encoding="selective_rope", selective_rope_temperature_base=0.5)
    settings.validate()
    enc = build_positional(settings, MixerSpec(HIDDEN, 2, 2, 8, 8, True))
    assert torch.all(enc.tau[1:] > enc.tau[:-1])
    defaults = PositionalSettings()
    assert (defaults.selective_rope_temperature_base, defaults.selective_rope_tau_max, defaults.selective_rope_rank,
            defaults.selective_rope_activation, defaults.selective_rope_spectrum) == (500000.0, 1.0, 32, "silu", "rope")


@pytest.fixture
def registry_restored():
    """The options' registry as it was after the test, which may define an option (defining one registers it)."""
    saved = dict(PositionalEncoding.registry)
    yield
    PositionalEncoding.registry.clear()
    PositionalEncoding.registry.update(saved)


def test_an_option_that_leaves_out_a_declaration_fails_when_defined(registry_restored):
    with pytest.raises(TypeError, match="Partial does not declare description, rope_scaling_refusal$"):
        type("Partial", (PositionalEncoding,), {"kind": "partial"})
    with pytest.raises(TypeError, match="does not declare kind, description, rope_scaling_refusal"):
        type("Bare", (PositionalEncoding,), {})
    assert tuple(PositionalEncoding.registry) == POSITION_ENCODINGS


def test_a_new_option_is_read_from_its_class_by_every_decision(registry_restored):
    """The options' names and which of them a RoPE scaling applies to are the registry's: an option defined
    anywhere is accepted by the settings, and its own declaration decides the scaling."""
    type("Refusing", (NoPE,), {"kind": "refusing", "description": "Refusing", "rope_scaling_refusal": "not here"})
    type("Scaled", (RoPE,), {"kind": "scaled", "description": "Scaled"})
    yarn = {"rope_type": "yarn", "factor": 2.0}
    assert PositionalSettings(position_encoding="refusing").position_encoding == "refusing"
    with pytest.raises(ValueError, match="^not here$"):
        PositionalSettings(position_encoding="refusing", rope_parameters=yarn)
    assert PositionalSettings(position_encoding="scaled", rope_parameters=yarn).rope_scaling()["factor"] == 2.0


def test_the_lists_of_options_are_the_registry():
    assert POSITION_ENCODINGS == ("nope", "rope", "rove", "selective_rope") == tuple(PositionalEncoding.registry)
    assert ROPE_FREQUENCY_ENCODINGS == ("rope", "rove")
    assert RUN_POSITIONS is POSITION_ENCODINGS
    model_help = {f.name: f.metadata["help"] for f in dataclasses.fields(ModelSection)}
    assert model_help["position_encoding"] == "nope | rope | rove | selective_rope"
