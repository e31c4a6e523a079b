"""The positional layer's fields are declared once, by PositionalSettings: the configs' signatures, defaults and
documentation are derived from it, and a model build checks the settings once, whatever its depth."""
import inspect
from dataclasses import FrozenInstanceError, fields

import pytest

from rotarium.layers import PositionalSettings
from rotarium.layers.positional import PositionalSettings as SettingsClass
from rotarium.models import CONFIGS, RotariumConfig
from rotarium.models.configuration import POSITIONAL_DOCS_PLACEHOLDER
from rotarium.models.modeling import FAMILY_MODELS

DECLARED = fields(PositionalSettings)


def test_every_config_takes_every_positional_field_with_its_declared_default():
    signature = inspect.signature(RotariumConfig.__init__)
    for declared in DECLARED:
        parameter = signature.parameters[declared.name]
        assert (parameter.default, parameter.annotation) == (declared.default, declared.type)
    for config_class in CONFIGS.values():
        config = config_class()
        assert set(config_class.field_names()) >= {f.name for f in DECLARED}
        assert config.positional_settings.rope_scaling() is None  # transformers spells "unscaled" its own way
        for declared in DECLARED:
            if declared.name == "rope_parameters":
                continue
            expected = "rope" if (config_class.family, declared.name) == ("transformer", "position_encoding") \
                else declared.default
            assert getattr(config, declared.name) == expected, (config_class.family, declared.name)


def test_the_config_documents_every_positional_field_from_its_declaration():
    doc = " ".join(RotariumConfig.__doc__.split())
    assert POSITIONAL_DOCS_PLACEHOLDER.strip() not in doc
    for declared in DECLARED:
        assert f"{declared.name} (`" in doc
        assert " ".join(declared.metadata["doc"].split()) in doc


def test_settings_are_checked_when_made_and_cannot_change_afterwards():
    with pytest.raises(ValueError, match="`partial_rotary_factor` must be in"):
        PositionalSettings(position_encoding="rope", partial_rotary_factor=0.0)
    settings = PositionalSettings(position_encoding="rope")
    with pytest.raises(FrozenInstanceError):
        settings.partial_rotary_factor = 0.0


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_a_model_build_checks_the_settings_once_whatever_its_depth(family, monkeypatch):
    checks = []
    original = SettingsClass.validate
    monkeypatch.setattr(SettingsClass, "validate", lambda self: (checks.append(1), original(self))[1])
    record = FAMILY_MODELS[family]
    for depth in (1, 4):
        config = record.config(hidden_size=32, num_heads=2, num_hidden_layers=depth, vocab_size=16,
                               position_encoding="selective_rope")
        checks.clear()
        record.lm(config)
        assert len(checks) == 1, (family, depth, len(checks))
