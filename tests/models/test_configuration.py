"""Model configs built from Python: transformers' keywords are kept, a preset's mistyped override is refused naming the
closest field."""
from __future__ import annotations

import pytest

from rotarium.configs.presets import preset_config
from rotarium.models import GLAConfig, RotariumConfig


def test_config_classes_keep_transformers_keywords():
    """The Python API stays transformers-compatible: a config class keeps keywords it does not define (from_pretrained
    passes transformers' own, and saved configs carry them); the training config is where options are checked."""
    config = GLAConfig(hidden_size=32, num_heads=2, num_hidden_layers=1, some_hub_key=3)
    assert config.some_hub_key == 3 and "some_hub_key" not in GLAConfig.field_names()


def test_an_mlp_width_of_zero_is_refused_not_taken_for_the_default():
    """Only None means the default MLP width; 0 built a model of the default width while the config said 0."""
    assert GLAConfig(hidden_size=32, num_heads=2).intermediate_size > 0
    with pytest.raises(ValueError, match="`intermediate_size` must be a positive integer, got 0"):
        GLAConfig(hidden_size=32, num_heads=2, intermediate_size=0)


def test_a_mistyped_preset_override_is_refused_with_the_closest_field():
    """``from_preset`` builds from the preset's values plus the overrides: a mistyped override would be kept as an
    unused attribute while the preset's value is used, so it is refused; transformers' own keys are still taken."""
    with pytest.raises(ValueError, match=r"unknown override `position_encodng` for a gla model; did you mean "
                                         r"position_encoding"):
        RotariumConfig.from_preset("gla-370m", position_encodng="rope")
    with pytest.raises(ValueError, match="unknown override `qk_norm` for a gla model"):
        preset_config("gla-370m", qk_norm=True)  # a FoX and Transformer field, not a GLA one
    config = preset_config("fox-370m", qk_norm=True, num_hidden_layers=2, dtype="bfloat16")
    assert config.qk_norm and config.num_hidden_layers == 2
