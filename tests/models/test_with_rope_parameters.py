"""``rotarium.models.with_rope_parameters``: RoPE scaling on a model in memory gives what saving it and loading it
with ``rope_parameters`` gives."""
import pytest
import torch

from rotarium.models import CONFIGS, FAMILY_MODELS, load_pretrained, with_rope_parameters

YARN = {"rope_type": "yarn", "factor": 4.0}


def tiny(family: str, option: str) -> torch.nn.Module:
    config = CONFIGS[family](vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2,
                             max_position_embeddings=16, position_encoding=option)
    torch.manual_seed(0)
    return FAMILY_MODELS[family].lm(config).eval()


@pytest.mark.parametrize("family, option", [("transformer", "rove"), ("fox", "rope"), ("gla", "rove")])
def test_a_model_rescaled_in_memory_equals_the_one_loaded_with_the_scaling(family, option, tmp_path):
    model = tiny(family, option)
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(str(tmp_path), flag="--model", rope_parameters=YARN).eval()
    scaled = with_rope_parameters(model, YARN)
    ids = torch.randint(0, 64, (2, 64))  # four times the original length
    with torch.no_grad():
        expected, got, unscaled = loaded(ids).logits, scaled(ids).logits, model(ids).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(got, unscaled)  # the scaling acts
    assert model.config.rope_parameters.get("factor") is None  # the original is untouched
    assert not scaled.training


def test_generation_keeps_the_models_settings_when_training_turned_the_cache_off():
    model = tiny("transformer", "rope")
    model.config.use_cache = False  # as a trainer leaves it
    scaled = with_rope_parameters(model, YARN)
    assert scaled.generation_config.use_cache  # without it generate recomputes the whole prefix at every token
    ids = torch.randint(0, 64, (1, 20))
    out = scaled.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                          pad_token_id=0)
    assert out.shape == (1, 25)


def test_an_option_without_position_rotations_is_refused():
    with pytest.raises(ValueError, match="rope"):
        with_rope_parameters(tiny("gla", "nope"), YARN)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 0}, {"rope_type": "yarn", "factor": "2"}])
def test_a_scaling_that_cannot_work_is_refused_naming_the_key(scaling):
    with pytest.raises(ValueError, match="`rope_parameters.factor` must be a finite number >= 1"):
        with_rope_parameters(tiny("transformer", "rope"), scaling)
