"""Wrong inputs to the model API fail at the model's boundary with a ValueError naming the argument."""
import pytest
import torch

from rotarium.models import RotariumCache
from rotarium.ops import utils as ops_utils
from tests.models.helpers import FAMILIES, VOCAB, tiny_model


def prefill_cache(model, ids) -> RotariumCache:
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out.cache if hasattr(out, "cache") else out.past_key_values


@pytest.mark.parametrize("family", FAMILIES)
def test_an_empty_input_is_refused(family):
    model = tiny_model(family, "rope")
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`input_ids` is empty \(shape \(1, 0\)\)"):
        model(empty)
    with pytest.raises(ValueError, match="`input_ids` is empty"):
        model.generate(empty, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`inputs_embeds` is empty"):
        model(inputs_embeds=torch.zeros(2, 0, 32))
    with pytest.raises(ValueError, match=r"`input_ids` must have shape \[batch, seq_len\]"):
        model(torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_of_another_width_are_refused(family):
    model = tiny_model(family, "rope")
    with pytest.raises(ValueError, match=r"`inputs_embeds` must have shape \[batch, seq_len, hidden_size\] with "
                                         r"hidden_size 32, got \(2, 5, 16\)"):
        model(inputs_embeds=torch.randn(2, 5, 16))


@pytest.mark.parametrize("source,target", [("transformer", "gla"), ("deltanet", "gla"), ("gla", "transformer"),
                                           ("fox", "deltanet"), ("transformer", "fox")])
def test_a_cache_of_another_family_is_refused(source, target):
    ids = torch.randint(0, VOCAB, (2, 5))
    cache = prefill_cache(tiny_model(source, "rope"), ids)
    model = tiny_model(target, "rope")
    with pytest.raises(ValueError, match=f"`past_key_values` holds the states of a {source} model, but this is a "
                                         f"{target} model"):
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=f"`cache` holds the states of a {source} model"):
        model(ids[:, :1], cache=cache, use_cache=True)


def test_a_cache_of_the_same_family_with_other_settings_is_refused():
    ids = torch.randint(0, VOCAB, (1, 5))
    cache = prefill_cache(tiny_model("gla", "rope"), ids)
    with pytest.raises(ValueError, match=r"other settings \(num_heads: 4 in the cache, 2 here\)"):
        tiny_model("gla", "rope", num_heads=2)(ids[:, :1], past_key_values=cache)
    with pytest.raises(ValueError, match=r"position_encoding: 'rope' in the cache, 'rove' here"):
        tiny_model("gla", "rove")(ids[:, :1], past_key_values=cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cache_of_another_batch_size_is_refused(family):
    model = tiny_model(family, "rope")
    cache = prefill_cache(model, torch.randint(0, VOCAB, (2, 5)))
    with pytest.raises(ValueError, match="`past_key_values` holds states for a batch of 2 sequences, but the inputs "
                                         "have a batch of 1"):
        model(torch.randint(0, VOCAB, (1, 1)), past_key_values=cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_outside_the_vocabulary_are_refused(family):
    model = tiny_model(family, "rope")
    for bad in (VOCAB, -1):
        ids = torch.tensor([[1, 2, bad, 3]])
        with pytest.raises(ValueError, match=f"`input_ids` holds the id {bad}, outside the vocabulary of {VOCAB} "
                                             f"tokens"):
            model(ids)
        with pytest.raises(ValueError, match=f"the id {bad}"):
            model.generate(ids, max_new_tokens=1)


def test_the_vocabulary_check_is_skipped_with_the_value_checks(monkeypatch):
    monkeypatch.setattr(ops_utils, "VALUE_CHECKS", False)
    with pytest.raises(IndexError):  # the embedding's own error: nothing read the ids before it
        tiny_model("gla", "nope")(torch.tensor([[VOCAB]]))


def test_the_cache_reports_its_batch_size_like_transformers():
    model = tiny_model("transformer", "rope")
    assert RotariumCache(2).batch_size == -1
    cache = prefill_cache(model, torch.randint(0, VOCAB, (3, 4)))
    assert cache.batch_size == 3
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 6
    cache.batch_select_indices(torch.tensor([True, False, True, False, False, False]))
    assert cache.batch_size == 2
    cache.reset()
    assert cache.batch_size == -1


def test_the_common_config_base_names_the_family_configs():
    from rotarium.models import RotariumConfig

    with pytest.raises(TypeError, match="GLAConfig.*from_preset"):
        RotariumConfig(hidden_size=32)
