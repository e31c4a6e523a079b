"""RoPE scaling (transformers' `rope_parameters`) in the positional layer: frequencies and attention factors are
transformers' own, factor 1 is the unscaled model, RoVE stays relative under YaRN with the factor on the logits only,
the linear families take no attention factor, and Selective RoPE and NoPE refuse a scaling (docs/design.md §3.5)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import rotarium  # noqa: F401  (registers the Auto classes)
from rotarium.layers import MixerSpec, PositionalSettings, SequenceInfo, build_positional
from rotarium.models import CONFIGS
from rotarium.ops.rotary import rotate_half_pairs
from tests.asserts import assert_close_at_scale
from tests.layers.helpers import FAMILIES, make_mixer, run

ORIGINAL = 16  # the training length the scalings extend
HEAD = 16
# Each type with its keys; longrope's factors are one per rotated pair
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0},
    "yarn-keys": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0,
                  "mscale_all_dim": 0.5, "original_max_position_embeddings": 8},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(HEAD // 2)],
                 "long_factor": [1.0 + i for i in range(HEAD // 2)]},
}
# factor 1 of every type (longrope: every per-pair factor 1)
UNIT_SCALINGS = {name: {**s, "factor": 1.0} if "factor" in s else
                 {**s, "short_factor": [1.0] * (HEAD // 2), "long_factor": [1.0] * (HEAD // 2)}
                 for name, s in SCALINGS.items()}


def rope_layer(scaling: dict | None, encoding: str = "rope", softmax: bool = True, theta: float = 100.0,
               head_v: int = HEAD) -> torch.nn.Module:
    settings = PositionalSettings(position_encoding=encoding, rope_theta=theta, rope_parameters=scaling,
                                  max_position_embeddings=ORIGINAL)
    return build_positional(settings, MixerSpec(64, 2, 2, HEAD, head_v, has_decay=False, softmax=softmax))


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("length", [ORIGINAL // 2, 4 * ORIGINAL])
def test_frequencies_and_attention_factor_are_transformers(name, length):
    """Against transformers' Llama rotary embedding (its cos and sin carry the attention factor), at lengths inside
    and beyond the original one, where dynamic and longrope switch."""
    scaling = SCALINGS[name]
    llama = LlamaConfig(hidden_size=64, num_attention_heads=64 // HEAD, head_dim=HEAD,
                        max_position_embeddings=ORIGINAL, rope_parameters={**scaling, "rope_theta": 100.0})
    rotary = LlamaRotaryEmbedding(llama)
    positions = torch.arange(length)[None]
    cos, sin = rotary(torch.zeros(1, length, HEAD), positions)

    layer = rope_layer(scaling)
    frequencies = layer.frequencies(HEAD, torch.device("cpu"), layer.scaling_length(positions))
    angles = positions[0, :, None].float() * frequencies
    factor = layer.attention_factor
    assert factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    torch.testing.assert_close(torch.cat([angles.cos(), angles.cos()], -1) * factor, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([angles.sin(), angles.sin()], -1) * factor, sin[0], rtol=0, atol=1e-6)
    if name != "dynamic" or length > ORIGINAL:  # dynamic is plain RoPE up to the original length
        plain = rope_layer(None).frequencies(HEAD, torch.device("cpu"))
        assert not torch.allclose(frequencies, plain)


def test_attention_factor_multiplies_the_rotated_features_of_q_and_k():
    """YaRN's factor m on each of q and k: the logits take m^2, as transformers' cos * m and sin * m give; features
    past the rotary size pass through unscaled, as in transformers' partial rotary."""
    settings = PositionalSettings(position_encoding="rope", rope_theta=100.0, partial_rotary_factor=0.5,
                                  rope_parameters=SCALINGS["yarn"], max_position_embeddings=ORIGINAL)
    layer = build_positional(settings, MixerSpec(64, 2, 2, HEAD, HEAD, has_decay=False, softmax=True))
    m = layer.attention_factor
    assert m > 1
    q, k, v = (torch.randn(1, 40, 2, HEAD) for _ in range(3))
    x = torch.randn(1, 40, 64)
    enc = layer(q, k, v, x, SequenceInfo.build(x), None)
    angles = torch.arange(40.0)[None, :, None, None] * layer.frequencies(HEAD // 2, torch.device("cpu"))
    rq, rk = rotate_half_pairs(angles, q, k)
    torch.testing.assert_close(enc.q[..., :HEAD // 2], m * rq[..., :HEAD // 2])
    torch.testing.assert_close(enc.k[..., :HEAD // 2], m * rk[..., :HEAD // 2])
    torch.testing.assert_close(enc.k[..., HEAD // 2:], k[..., HEAD // 2:])
    assert torch.equal(enc.v, v)


def test_rove_rotates_values_with_scaled_unit_rotations():
    """RoVE + YaRN: values turn by the scaled frequencies with unit rotations, so the factor never reaches the value
    path (a rotation by m * R_j in and m * R_i^T out would scale the output by m^2)."""
    layer = rope_layer(SCALINGS["yarn"], "rove", head_v=12)
    assert layer.attention_factor > 1
    q, k = torch.randn(1, 50, 2, HEAD), torch.randn(1, 50, 2, HEAD)
    v = torch.randn(1, 50, 2, 12)
    x = torch.randn(1, 50, 64)
    enc = layer(q, k, v, x, SequenceInfo.build(x), None)
    torch.testing.assert_close(enc.value_rotation.abs(), torch.ones_like(enc.value_rotation.abs()))
    torch.testing.assert_close(enc.restore(enc.v), v)
    expected = torch.arange(50.0)[:, None] * layer.frequencies(12, torch.device("cpu"))
    plain = torch.arange(50.0)[:, None] * rope_layer(None, "rove", head_v=12).frequencies(12, torch.device("cpu"))
    torch.testing.assert_close(enc.value_rotation[0, :, 0].angle(), torch.atan2(expected.sin(), expected.cos()))
    assert not torch.allclose(expected, plain)


def tiny_model(family: str, encoding: str, **fields) -> torch.nn.Module:
    config = CONFIGS[family](vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2,
                             position_encoding=encoding, max_position_embeddings=ORIGINAL, rope_theta=100.0,
                             **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("encoding", ["rope", "rove"])
@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn", "yarn-keys", "llama3"])
def test_factor_one_is_the_unscaled_model(family, encoding, name):
    """Every type at factor 1 computes the unscaled model's logits (longrope: in the test below)."""
    # transformers' dynamic NTK grows the base with the length beyond the original one whatever the factor
    # (base * (factor * L / L_0 - factor + 1)^(d / (d - 2))), so factor 1 is plain RoPE up to the original length
    length = ORIGINAL if name == "dynamic" else 3 * ORIGINAL
    ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(0))
    plain = tiny_model(family, encoding)
    scaled = tiny_model(family, encoding, rope_parameters=UNIT_SCALINGS[name])
    scaled.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(scaled(ids).logits, plain(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("encoding", ["rope", "rove"])
def test_longrope_models_build_with_no_head_dim_and_unit_factors_are_the_unscaled_model(family, encoding):
    """A LongRoPE config without `head_dim` (rotarium's default) builds and saves: transformers' own check sized the
    factor lists by `head_dim` and failed on None; the layer checks them against the size it rotates."""
    key_size = {"expand_k": 1.0} if "expand_k" in CONFIGS[family].field_names() else {}
    ids = torch.randint(0, 64, (2, 3 * ORIGINAL), generator=torch.Generator().manual_seed(0))
    plain = tiny_model(family, encoding, **key_size)
    scaled = tiny_model(family, encoding, rope_parameters=UNIT_SCALINGS["longrope"], **key_size)
    assert type(scaled.config).from_dict(scaled.config.to_dict()).rope_parameters["rope_type"] == "longrope"
    scaled.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(scaled(ids).logits, plain(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("encoding", ["rope", "rove"])
@pytest.mark.parametrize("name", ["linear", "yarn", "llama3"])
def test_scaled_output_depends_on_relative_offsets_only(family, encoding, name):
    """Shifting every position by a constant leaves the output unchanged: the scaled frequencies are one fixed set, so
    R_i^T R_j = R_{j-i} still holds for q, k and RoVE's values. (dynamic and longrope pick their frequencies from
    the last position, so a shift may change them.)"""
    ids = torch.randint(0, 64, (2, 2 * ORIGINAL), generator=torch.Generator().manual_seed(0))
    model = tiny_model(family, encoding, rope_parameters=SCALINGS[name])
    positions = torch.arange(ids.shape[1])[None].expand(2, -1)
    with torch.no_grad():
        base = model(ids, position_ids=positions).logits
        shifted = model(ids, position_ids=positions + 3 * ORIGINAL + 5).logits
        plain = tiny_model(family, encoding)
        plain.load_state_dict(model.state_dict())
        unscaled = plain(ids, position_ids=positions).logits
    torch.testing.assert_close(shifted, base, rtol=0, atol=2e-5)
    assert not torch.allclose(base, unscaled, atol=1e-4)  # the scaling does change the model


@pytest.mark.parametrize("family", FAMILIES)
def test_only_softmax_mixers_take_the_attention_factor(family):
    """The linear families have no softmax whose sharpness YaRN's factor restores: theirs is 1 (for DeltaNet a
    factor would also break the unit-norm keys the delta rule needs)."""
    mixer = make_mixer(family, "rove", rope_parameters=SCALINGS["yarn"], max_position_embeddings=ORIGINAL)
    softmax = family in ("transformer", "fox")
    expected = rope_layer(SCALINGS["yarn"]).attention_factor if softmax else 1.0
    assert mixer.positional.attention_factor == expected
    assert (expected > 1) == softmax
    out, _ = run(mixer, torch.randn(1, 3 * ORIGINAL, 32))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("encoding", "words"), [("selective_rope", "learned running sum"), ("nope", "has none")])
def test_scaling_is_refused_where_there_is_no_position_frequency(encoding, words):
    with pytest.raises(ValueError, match=f"`rope_parameters`.*{words}"):
        CONFIGS["gla"](vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, position_encoding=encoding,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("name", list(UNIT_SCALINGS))
@pytest.mark.parametrize("encoding", ["rope", "rove"])
def test_factor_one_is_the_unscaled_layer(name, encoding):
    length = ORIGINAL if name == "dynamic" else 3 * ORIGINAL
    q, k, v = (torch.randn(2, length, 2, HEAD) for _ in range(3))
    x = torch.randn(2, length, 64)
    got = rope_layer(UNIT_SCALINGS[name], encoding)(q, k, v, x, SequenceInfo.build(x), None)
    expected = rope_layer(None, encoding)(q, k, v, x, SequenceInfo.build(x), None)
    for a, b in ((got.q, expected.q), (got.k, expected.k), (got.v, expected.v)):
        assert_close_at_scale(a, b, 1e-6)


@pytest.mark.parametrize(("parameters", "match"), [
    ({"rope_type": "ntk", "factor": 2.0}, "rope_parameters.rope_type"),
    ({"rope_type": "yarn", "factor": 2.0, "rope_theta": 0.5}, "`rope_parameters.rope_theta` must be > 1"),
    ({"rope_type": "default", "partial_rotary_factor": "half"}, "`rope_parameters.partial_rotary_factor` must be in"),
])
def test_bad_rope_parameters_raise_naming_the_key(parameters, match):
    with pytest.raises(ValueError, match=match):
        CONFIGS["transformer"](vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2,
                               position_encoding="rope", rope_parameters=parameters)


FACTOR_RULE = "`rope_parameters.factor` must be a finite number >= 1"
LENGTH_RULE = "`rope_parameters.original_max_position_embeddings` must be a positive integer"
BAD_VALUES = [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -8}, LENGTH_RULE),
    ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8.5}, LENGTH_RULE),
    ({"rope_type": "linear", "factor": "4"}, FACTOR_RULE),
    ({"rope_type": "linear", "factor": 0}, FACTOR_RULE),
    ({"rope_type": "dynamic", "factor": 0.5}, FACTOR_RULE),
    ({"rope_type": "yarn", "factor": float("nan")}, FACTOR_RULE),
    ({"rope_type": "yarn", "factor": float("inf")}, FACTOR_RULE),
    ({"type": "yarn", "factor": True}, FACTOR_RULE),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": -1}, "`rope_parameters.beta_fast` must be a finite number > 0"),
    ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.0},
     "`rope_parameters.attention_factor` must be a finite number > 0"),
    ({"rope_type": "yarn", "factor": 2.0, "mscale": "1"}, "`rope_parameters.mscale` must be a finite number"),
    ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.0, "high_freq_factor": 4.0},
     "`rope_parameters.low_freq_factor` must be a finite number > 0"),
    ({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0},
     "`rope_parameters.high_freq_factor` must be greater than `rope_parameters.low_freq_factor`"),
    ({**SCALINGS["longrope"], "short_factor": [1.0, 0.0] * (HEAD // 4)},
     "`rope_parameters.short_factor` must be a list of finite numbers > 0"),
    ({**SCALINGS["longrope"], "long_factor": "2"}, "`rope_parameters.long_factor` must be a list of finite numbers"),
    ({**SCALINGS["longrope"], "long_factor": [2.0] * 3}, "`rope_parameters.long_factor` lists one factor per rotated"),
    ({"rope_type": 4, "factor": 2.0}, "`rope_parameters.rope_type` must be"),
]


@pytest.mark.parametrize(("parameters", "match"), BAD_VALUES)
def test_scaling_values_that_cannot_work_raise_naming_the_key(parameters, match):
    """Before transformers' functions meet them (a math domain error, a TypeError, NaN tables): the factors are finite
    numbers, >= 1 for `factor` as transformers' validation requires of every scaling, the original length a
    positive integer. Both where a config is made and where a loaded config's scaling reaches the layer."""
    with pytest.raises(ValueError, match=match):
        CONFIGS["transformer"](vocab_size=64, hidden_size=64, num_hidden_layers=1, num_heads=64 // HEAD,
                               head_dim=HEAD, position_encoding="rope", rope_parameters=parameters)
    with pytest.raises(ValueError, match=match):
        rope_layer(parameters)


def test_a_missing_key_raises_naming_it():
    """A config validates its keys with transformers' own check; settings that reach the layer without it (set on a
    loaded config) fail at construction, naming the key."""
    with pytest.raises(ValueError, match="needs the key 'factor'"):
        rope_layer({"rope_type": "linear"})


def test_longrope_on_rove_needs_one_factor_per_value_pair_too():
    with pytest.raises(ValueError, match="longrope.*value head size"):
        rope_layer(SCALINGS["longrope"], "rove", head_v=12)


def test_rope_scaling_alias_and_from_pretrained_and_old_checkpoints(tmp_path):
    """The deprecated `rope_scaling` (with its legacy `type`) reads as `rope_parameters`; `from_pretrained(...,
    rope_parameters=...)` scales a saved unscaled model without retraining; a config saved before the field existed
    loads unscaled."""
    ids = torch.randint(0, 64, (1, 3 * ORIGINAL), generator=torch.Generator().manual_seed(0))
    plain = tiny_model("transformer", "rove")
    scaled = tiny_model("transformer", "rove", rope_parameters=SCALINGS["yarn"])
    scaled.load_state_dict(plain.state_dict())
    alias = CONFIGS["transformer"](vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                   position_encoding="rove", max_position_embeddings=ORIGINAL, rope_theta=100.0,
                                   rope_scaling={"type": "yarn", "factor": 4.0})
    assert alias.positional_settings.rope_scaling() == scaled.config.positional_settings.rope_scaling()

    plain.save_pretrained(tmp_path / "plain")
    with torch.no_grad():
        expected, unscaled = scaled(ids).logits, plain(ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", rope_parameters={"rope_type": "yarn",
                                                                                            "factor": 4.0}).eval()
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=1e-6)

        config = json.loads((tmp_path / "plain" / "config.json").read_text())
        del config["rope_parameters"]
        (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
        old = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
        assert old.config.positional_settings.rope_scaling() is None
        torch.testing.assert_close(old(ids).logits, unscaled, rtol=0, atol=0)
