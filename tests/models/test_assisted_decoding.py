"""Assisted and prompt-lookup decoding: the cache rolls back the states of rejected draft tokens (recurrent states,
convolution windows, RoPE offsets, Selective RoPE's angles, KV caches), so both give greedy search's tokens."""
import copy

import pytest
import torch
from transformers import DynamicCache

from rotarium.models import RotariumCache
from tests.asserts import assert_close_at_scale
from tests.models.helpers import COMBINATIONS, VOCAB, tiny_model


def recording_crops(cache: RotariumCache) -> list[int]:
    """The count of dropped tokens of every ``crop`` of ``cache``, in order."""
    seen, crop = [], cache.crop

    def recorded(tokens_to_remove):
        seen.append(-tokens_to_remove)
        return crop(tokens_to_remove)

    cache.crop = recorded
    return seen


def near_copy(model, noise=0.05, seed=1):
    """The model with its weights moved a little: an assistant that agrees with it on some drafts, not all."""
    assistant = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in assistant.parameters():
            if p.ndim == 2:
                p.add_(torch.randn(p.shape, generator=generator) * noise)
    return assistant


def next_logits(model, cache, last_token):
    return model(last_token, cache=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_assisted_and_prompt_lookup_decoding_give_greedy_searchs_tokens(family, pe):
    model = tiny_model(family, pe)
    assistant = near_copy(model)
    assistant.generation_config.num_assistant_tokens = 4
    prompt = torch.randint(2, VOCAB, (1, 8))
    prompt = torch.cat([prompt, prompt[:, :5], prompt], 1)  # repeats for prompt lookup to draft from
    new_tokens = 24
    greedy = {"max_new_tokens": new_tokens, "do_sample": False, "return_dict_in_generate": True}
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        expected = model.generate(prompt, **greedy)
        last = expected.sequences[:, -1:]
        reference = next_logits(model, expected.cache, last)
        for strategy in ({"assistant_model": assistant}, {"prompt_lookup_num_tokens": 3}):
            cache = RotariumCache(layers)
            crops = recording_crops(cache)
            out = model.generate(prompt, cache=cache, **strategy, **greedy)
            assert torch.equal(out.sequences, expected.sequences), strategy
            # drafts were rejected (states rolled back) and, from the assistant, accepted (fewer verifications
            # than tokens); prompt lookup drafts from repeats that the tiny model's tokens rarely follow
            assert max(crops) > 0 and (len(crops) < new_tokens or "assistant_model" not in strategy), crops
            # the cache left behind continues the sequence as greedy search's does
            assert out.cache is cache and cache.get_seq_length() == expected.sequences.shape[1] - 1
            assert_close_at_scale(next_logits(model, cache, last), reference, 1e-4, what=next(iter(strategy)))


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_crop_takes_back_every_state_of_the_dropped_tokens(family, pe):
    """A left-padded batch of 2: a forward of 5 tokens while recording, then dropping r of them and going on
    gives the full forward's logits, for every r."""
    model = tiny_model(family, pe)
    ids = torch.randint(2, VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        for dropped in range(6):
            cache = RotariumCache(model.config.num_hidden_layers)
            model(ids[:, :6], attention_mask=mask[:, :6], cache=cache)
            cache.activate_past_recording(recurrent_states_to_keep=5)
            model(ids[:, 6:11], attention_mask=mask[:, :11], cache=cache)
            cache.crop(-dropped)
            assert cache.get_seq_length() == 11 - dropped
            rest = model(ids[:, 11 - dropped:], attention_mask=mask, cache=cache).logits
            assert_close_at_scale(rest, full[:, 11 - dropped:], 1e-4, what=f"{dropped} dropped")


def test_a_rollback_beyond_the_recorded_tokens_is_refused_by_name():
    model = tiny_model("gla", "selective_rope")
    ids = torch.randint(2, VOCAB, (1, 12))
    with torch.no_grad():
        cache = model(ids[:, :4]).cache
        with pytest.raises(ValueError, match=r"activate_past_recording\(recurrent_states_to_keep=2\)"):
            cache.crop(-2)
        cache.activate_past_recording(recurrent_states_to_keep=3)
        model(ids[:, 4:10], cache=cache)
        with pytest.raises(ValueError, match="cannot drop the 4 newest tokens"):
            cache.crop(-4)
        cache.crop(-3)
    assert cache.get_seq_length() == 7


def test_the_kv_cache_goes_on_in_place_after_a_rollback():
    model = tiny_model("transformer", "rope")
    ids = torch.randint(2, VOCAB, (1, 12))
    with torch.no_grad():
        cache = model(ids[:, :4]).cache
        cache.activate_past_recording(recurrent_states_to_keep=4)
        model(ids[:, 4:8], cache=cache)
        storage = cache.layers[0].state.kv.keys.data_ptr()
        cache.crop(-3)
        model(ids[:, 5:6], cache=cache)
    assert cache.layers[0].state.kv.keys.data_ptr() == storage


@pytest.mark.parametrize("make", [DynamicCache, lambda config: DynamicCache(config=config)],
                         ids=["DynamicCache()", "DynamicCache(config)"])
def test_transformers_empty_caches_are_filled_with_rotarium_layers(make):
    from rotarium.models.cache import RotariumCacheLayer

    model = tiny_model("deltanet", "selective_rope")
    ids = torch.randint(2, VOCAB, (1, 10))
    cache = make(model.config) if make is not DynamicCache else DynamicCache()
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6], cache=cache, use_cache=True)
        assert out.cache is cache and all(isinstance(layer, RotariumCacheLayer) for layer in cache.layers)
        rest = model(ids[:, 6:], cache=cache).logits
    assert_close_at_scale(rest, full[:, 6:], 1e-4)


def test_a_key_value_cache_of_another_model_is_refused_by_name():
    model = tiny_model("gla", "rope")
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    with pytest.raises(ValueError, match="`cache` holds DynamicLayer layers"):
        model(torch.randint(2, VOCAB, (1, 3)), cache=cache)
    with pytest.raises(ValueError, match="`past_key_values` must be a transformers Cache"):
        model(torch.randint(2, VOCAB, (1, 3)), past_key_values=((torch.zeros(1), torch.zeros(1)),))
