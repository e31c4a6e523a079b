"""The families' registry: one record per family (``FAMILY_MODELS``, derived from each config of ``FAMILY_CONFIGS``,
which names its mixer and its fla peer), from which every other list of families is read; the named softmax mixers
leave checkpoints as they were."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin

from rotarium.configs import PRESETS
from rotarium.configs.presets import preset_config
from rotarium.hub.checkpoint import MODEL_TYPES
from rotarium.layers import ForgettingAttention, GatedLinearAttention, SoftmaxAttention, TransformerAttention
from rotarium.models import (
    CONFIGS,
    FAMILY_MODELS,
    MIXERS,
    FamilyClasses,
    FoXConfig,
    FoXModel,
    GLAConfig,
    GLAModel,
    NoFlaPeer,
    modeling,
)
from rotarium.models.configuration import FAMILY_CONFIGS, GLAFields
from rotarium.models.modeling import bind_family, family_registry
from rotarium.synthetic.runner import FAMILIES as SYNTHETIC_FAMILIES
from tests.models.helpers import FAMILIES, tiny_config, tiny_model

# A one-block model's state-dict keys as saved before the softmax mixers had classes of their own (written out, so
# that a change of module names shows here rather than in a checkpoint that no longer loads).
SHARED_KEYS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mixer_norm.weight",
               "model.layers.0.mlp_norm.weight", "model.layers.0.mlp.gate_proj.weight",
               "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"}
ATTENTION_KEYS = {f"model.layers.0.mixer.{name}_proj.weight" for name in "qkvo"}
SAVED_KEYS = {
    "fox": SHARED_KEYS | ATTENTION_KEYS | {"model.layers.0.mixer.fgate_proj.weight",
                                          "model.layers.0.mixer.fgate_proj.bias"},
    "transformer": SHARED_KEYS | ATTENTION_KEYS,
}


def test_every_list_of_families_is_read_from_the_registry():
    assert tuple(MIXERS) == tuple(CONFIGS) == tuple(FAMILY_MODELS) == SYNTHETIC_FAMILIES == FAMILIES
    assert tuple(CONFIGS.values()) == FAMILY_CONFIGS
    assert CONFIGS == {name: record.config for name, record in FAMILY_MODELS.items()}
    assert MODEL_TYPES == {record.model_type: name for name, record in FAMILY_MODELS.items()}
    assert {family for family, _ in PRESETS.values()} == set(FAMILY_MODELS)
    for record in FAMILY_MODELS.values():
        assert AutoConfig.for_model(record.model_type).__class__ is record.config
        assert AutoModel._model_mapping[record.config] is record.model
        assert AutoModelForCausalLM._model_mapping[record.config] is record.lm


@pytest.mark.parametrize("family", FAMILIES)
def test_a_record_is_whole(family):
    record = FAMILY_MODELS[family]
    config, model, lm = record  # the record still unpacks as the three classes it always held
    assert record.name == config.family == family
    assert model.config_class is config and lm.config_class is config
    assert record.mixer is MIXERS[family]
    assert record.class_names == (config.__name__, model.__name__, lm.__name__)
    built = tiny_model(family, "nope")
    assert all(type(block.mixer) is record.mixer for block in built.model.layers)


def test_the_registry_refuses_a_record_that_is_not_whole():
    gla = FAMILY_MODELS["gla"]
    with pytest.raises(ValueError, match="declared twice"):
        family_registry(gla, gla)
    with pytest.raises(ValueError, match="GLAModel.config_class is GLAConfig, not FoXConfig"):
        family_registry(FamilyClasses(FoXConfig, GLAModel, FAMILY_MODELS["fox"].lm))

    class MambaConfig(GLAConfig):
        family = "mamba"

    with pytest.raises(ValueError, match="family 'mamba' has no mixer"):
        family_registry(FamilyClasses(MambaConfig, FoXModel, FAMILY_MODELS["fox"].lm))


def test_the_softmax_families_have_named_mixers():
    config = tiny_config("fox", "nope")
    kwargs = config.mixer_kwargs()
    fox, transformer = ForgettingAttention(**kwargs), TransformerAttention(**kwargs)
    assert isinstance(fox, SoftmaxAttention) and isinstance(transformer, SoftmaxAttention)
    assert fox.forget_gate and hasattr(fox, "fgate_proj")
    assert not transformer.forget_gate and not hasattr(transformer, "fgate_proj")


@pytest.mark.parametrize("family", sorted(SAVED_KEYS))
def test_checkpoints_keep_their_keys_and_configs(family):
    """A mixer's class name reaches neither the state dict nor the config, so checkpoints saved before the named
    mixers load as they did."""
    model = tiny_model(family, "nope", num_hidden_layers=1, num_kv_heads=None, tie_word_embeddings=False)
    assert set(model.state_dict()) == SAVED_KEYS[family]
    saved = model.config.to_json_string()
    assert not any(mixer.__name__ in saved for mixer in MIXERS.values())


def test_the_registry_refuses_a_family_that_lacks_a_declaration():
    """What the card, the FLOPs count and the GPU check read of a family is on its record: a family that leaves one
    out fails at registration, by name, instead of getting another family's text, formula or mapping."""

    class UndescribedConfig(GLAConfig):
        family = "gla"  # GLA's mixer, but no description of its own

    with pytest.raises(ValueError, match="UndescribedConfig has no `description` of its own"):
        family_registry(FamilyClasses(UndescribedConfig, *bound_to(UndescribedConfig)))

    class Uncounted(MIXERS["gla"]):
        unweighted_flops_per_token = None

    class UncountedConfig(GLAConfig):
        family = "uncounted"
        description = "a mixer that does not count its FLOPs"
        mixer_class = Uncounted

    with pytest.raises(ValueError, match="its mixer Uncounted does not count its FLOPs"):
        family_registry(FamilyClasses(UncountedConfig, *bound_to(UncountedConfig)))

    class PeerlessConfig(GLAConfig):  # GLA's fla peer would map it to fla's GLA: it must say its own
        family = "peerless"
        description = "a family that does not say which fla model computes the same"
        mixer_class = GatedLinearAttention

    with pytest.raises(ValueError, match="family 'peerless': PeerlessConfig declares no fla peer"):
        family_registry(FamilyClasses(PeerlessConfig, *bound_to(PeerlessConfig)))


def bound_to(config: type) -> tuple[type, type]:
    """Model and causal-LM classes bound to ``config``, as a family declares them."""
    model = type(f"{config.__name__}Model", (FAMILY_MODELS["gla"].model,), {"config_class": config})
    lm = type(f"{config.__name__}ForCausalLM", (FAMILY_MODELS["gla"].lm,), {"config_class": config})
    return model, lm


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_declares_what_is_read_of_it(family):
    record = FAMILY_MODELS[family]
    assert record.description == vars(record.config)["description"]
    assert record.mixer.unweighted_flops_per_token is not None
    assert {"mixer_class", "fla_peer"} <= set(vars(record.config))


class MambaMixer(GatedLinearAttention):
    """A fifth family's mixer, for the test of declaring one."""


class MambaConfig(GLAConfig):
    r"""A fifth family, declared as a family is: its config names its mixer and its fla peer.

    Args:
        {family fields}
    """

    model_type = "rotarium_mamba_test"
    family = "mamba"
    description = "a fifth family, for the test of declaring one"
    mixer_class = MambaMixer
    family_fields = GLAFields

    def fla_peer(self, head_k_dim, head_v_dim):
        raise NoFlaPeer("fla has no model of this test's family")


def test_a_family_is_its_config_and_its_mixer():
    """A family's config and mixer are all it declares: its model classes are derived, named after the config and
    defined in modeling's namespace, where transformers' Auto classes, auto_map and the remote code look them up."""
    try:
        record = family_registry(bind_family(MambaConfig))["mamba"]
        assert record.class_names == ("MambaConfig", "MambaModel", "MambaForCausalLM")
        for cls in (record.model, record.lm):
            assert getattr(modeling, cls.__name__) is cls and cls.__module__ == modeling.__name__
            assert cls.__qualname__ == cls.__name__ and cls.config_class is MambaConfig
        assert GenerationMixin in record.lm.__bases__
        model = record.lm(MambaConfig(hidden_size=32, num_heads=2, num_hidden_layers=1, vocab_size=64))
        assert type(model.model.layers[0].mixer) is MambaMixer
        assert model(torch.randint(0, 64, (1, 8))).logits.shape == (1, 8, 64)
    finally:
        for name in ("MambaModel", "MambaForCausalLM"):
            vars(modeling).pop(name, None)


def test_each_family_declares_its_fla_peer_or_why_it_has_none():
    with pytest.raises(NoFlaPeer, match="flash-attn"):
        preset_config("transformer-370m").fla_peer(64, 64)
    with pytest.raises(NoFlaPeer, match="rope"):
        preset_config("gla-370m", position_encoding="rope").fla_peer(128, 256)
    model_type, kwargs = preset_config("deltanet-370m", use_gated_delta=True).fla_peer(128, 128)
    assert model_type == "gated_deltanet" and (kwargs["head_dim"], kwargs["expand_v"]) == (128, 1.0)
