"""Names renamed in the redesign keep working, with a FutureWarning that names the new one."""
import pytest
import torch

import rotarium.layers
import rotarium.layers.positional
import rotarium.ops.backend
import rotarium.training.config
from rotarium.layers import MixerSpec, PositionalOutput, PositionalSettings, build_mixer
from rotarium.layers.linear_attention import LinearAttentionMixer
from rotarium.models import FoXConfig, GLAConfig


@pytest.mark.parametrize(("module", "old", "new"), [
    (rotarium.layers, "HeadDims", MixerSpec),
    (rotarium.layers, "Encoded", PositionalOutput),
    (rotarium.layers.positional, "HeadDims", MixerSpec),
    (rotarium.layers.positional, "Encoded", PositionalOutput),
    (rotarium.ops.backend, "dispatch", rotarium.ops.backend.record_backend),
    (rotarium.training.config, "check_model_options", rotarium.training.config.validate_model_options),
])
def test_renamed_module_attributes_answer_with_a_warning(module, old, new):
    with pytest.warns(FutureWarning, match=f"`{module.__name__}.{old}` is renamed"):
        assert getattr(module, old) is new


def test_an_unknown_module_attribute_still_raises():
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        rotarium.layers.Nothing  # noqa: B018


def test_renamed_methods_and_attributes_answer_with_a_warning():
    config = GLAConfig(hidden_size=32, num_heads=2, num_hidden_layers=1, vocab_size=16)
    with pytest.warns(FutureWarning, match="`check` is renamed `validate_fields`"):
        config.check()
    with pytest.warns(FutureWarning, match="`check_field_names` is renamed `validate_field_names`"), \
            pytest.raises(ValueError, match="unknown field `nonsense`"):
        GLAConfig.check_field_names(["nonsense"])
    with pytest.warns(FutureWarning, match="`check_options` is renamed `validate_options`"):
        GLAConfig.check_options(["rope_theta"], prefix="", set_elsewhere={})

    settings = PositionalSettings()
    linear = build_mixer("deltanet", hidden_size=32, num_heads=2, positional=settings, use_output_gate=True)
    with pytest.warns(FutureWarning, match="`output_gate` is renamed `silu_output_gate`"):
        assert linear.output_gate is True
    enc = PositionalOutput(*(torch.zeros(1, 1, 2, 16),) * 3, None, None)
    with pytest.warns(FutureWarning, match="`decoding` is renamed `runs_step_wise`"):
        assert LinearAttentionMixer.decoding(None, enc) is False

    fox = FoXConfig(hidden_size=32, num_heads=2, output_gate=True)
    softmax = build_mixer("fox", **fox.mixer_kwargs())
    with pytest.warns(FutureWarning, match="`output_gate` is renamed `sigmoid_output_gate`"):
        assert softmax.output_gate is True
