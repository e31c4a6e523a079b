"""A family's own fields are declared once, by its ``family_fields`` dataclass, as the positional fields are by
PositionalSettings: its config's signature, defaults, documentation, attributes and mixer arguments are derived from
it, and the keys a saved config holds stay those of the checkpoints written before."""
import inspect
from dataclasses import fields

import pytest

from rotarium.models import CONFIGS, RotariumConfig
from rotarium.models.configuration import FAMILY_DOCS_PLACEHOLDER
from tests.models.helpers import FAMILIES, tiny_config

# Each family's signature as written by hand before the declarations (name, default, annotation), in order: what
# configs and checkpoints rely on, written out so that a change shows here.
SIGNATURES = {
    "gla": [("expand_k", 0.5, "float"), ("expand_v", 1.0, "float"), ("use_short_conv", True, "bool"),
            ("conv_size", 4, "int"), ("gate_low_rank_dim", 16, "int"), ("gate_logit_normalizer", 16.0, "float"),
            ("head_dim", None, "int | None"), ("rotary_gate_per_pair", True, "bool")],
    "fox": [("num_kv_heads", None, "int | None"), ("head_dim", None, "int | None"), ("qk_norm", False, "bool"),
            ("qk_norm_per_head", False, "bool"), ("qk_norm_eps", None, "float | None"), ("output_gate", False, "bool"),
            ("attention_bias", False, "bool")],
    "deltanet": [("expand_k", 1.0, "float"), ("expand_v", 1.0, "float"), ("use_short_conv", True, "bool"),
                 ("conv_size", 4, "int"), ("use_gated_delta", False, "bool"), ("use_output_gate", False, "bool"),
                 ("head_dim", None, "int | None")],
    "transformer": [("num_kv_heads", None, "int | None"), ("head_dim", None, "int | None"),
                    ("attention_bias", False, "bool"), ("qk_norm", False, "bool"), ("qk_norm_per_head", False, "bool"),
                    ("qk_norm_eps", None, "float | None"), ("position_encoding", "rope", "str")],
}
# the shared field a family declares to change its default
SHARED_OVERRIDES = {"transformer": {"position_encoding"}}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_signature_is_the_declaration_and_as_it_was(family):
    config_class = CONFIGS[family]
    declared = fields(config_class.family_fields)
    parameters = list(inspect.signature(config_class.__init__).parameters.values())
    assert [p.name for p in parameters] == ["self", *(f.name for f in declared), "kwargs"]
    assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD
    own = parameters[1:-1]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in own)
    assert [(p.name, p.default, p.annotation) for p in own] == [(f.name, f.default, f.type) for f in declared]
    assert [(p.name, p.default, p.annotation) for p in own] == SIGNATURES[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mixer_takes_the_declared_fields_but_the_shared_ones(family):
    config_class = CONFIGS[family]
    names = [f.name for f in fields(config_class.family_fields)]
    shared = set(inspect.signature(RotariumConfig.__init__).parameters)
    assert config_class.mixer_fields == tuple(n for n in names if n not in shared)
    assert set(names) & shared == SHARED_OVERRIDES.get(family, set())
    assert set(tiny_config(family, "nope").mixer_kwargs()) == {"hidden_size", "num_heads", "norm_eps", "positional",
                                                                 *config_class.mixer_fields}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_documents_every_family_field_from_its_declaration(family):
    config_class = CONFIGS[family]
    doc = " ".join(config_class.__doc__.split())
    assert FAMILY_DOCS_PLACEHOLDER.strip() not in doc
    for declared in fields(config_class.family_fields):
        assert f" {declared.name} (`{declared.type.removesuffix(' | None')}`, *optional*" in doc
        assert " ".join(declared.metadata["doc"].split()) in doc
    assert "kwargs: The shared fields of [`RotariumConfig`]." in doc


@pytest.mark.parametrize("family", FAMILIES)
def test_fields_are_set_by_keyword_or_position_saved_and_read_back(family, tmp_path):
    config_class = CONFIGS[family]
    names = config_class.mixer_fields
    default = config_class()
    for name, value, _ in SIGNATURES[family]:
        assert getattr(default, name) == value
    changed = {names[0]: 2.0 if isinstance(getattr(default, names[0]), float) else 2}
    by_keyword = config_class(**changed)
    by_position = config_class(*changed.values())
    assert getattr(by_keyword, names[0]) == getattr(by_position, names[0]) == changed[names[0]]
    by_keyword.save_pretrained(tmp_path)
    loaded = config_class.from_pretrained(tmp_path)
    assert loaded.to_dict() == by_keyword.to_dict()
    assert {name for name, _, _ in SIGNATURES[family]} <= set(loaded.to_dict())
    with pytest.raises(TypeError, match="multiple values for argument"):
        config_class(1, **{names[0]: 1})
