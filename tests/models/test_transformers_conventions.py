"""The conventions transformers' own model tests (``ModelTesterMixin``, ``GenerationTesterMixin``) check, written
for rotarium's four families: the mixins are not shipped with transformers' wheel.

Exempt, as transformers' recurrent models (mamba, mamba2, falcon_mamba) are: the key/value layout of the cache
(``test_past_key_values_format``), static caches and compiled decoding, attention implementations other than
rotarium's own kernels (sdpa, flash, flex), and custom 4D attention masks; and, for GLA and DeltaNet, which form no
attention weights, the attention outputs (``has_attentions = False``): they raise a ``ValueError`` instead.
"""
import inspect
import json
import warnings

import pytest
import torch
import transformers.modeling_utils
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer

from rotarium.layers import SoftmaxAttention
from rotarium.models import FAMILY_MODELS, MIXERS, set_activation_checkpointing, with_rope_parameters
from tests.asserts import assert_close_at_scale
from tests.models.helpers import COMBINATIONS, FAMILIES, VOCAB, one_option_each, tiny_model

# the softmax mixers form attention weights; the others (linear attention) form none
ATTENTION_FAMILIES = tuple(family for family in FAMILIES if issubclass(MIXERS[family], SoftmaxAttention))
LINEAR_FAMILIES = tuple(family for family in FAMILIES if family not in ATTENTION_FAMILIES)
# One positional option per family, so every option meets every test somewhere
OPTION = dict(one_option_each({"gla": "selective_rope", "fox": "rove", "deltanet": "rope",
                               "transformer": "selective_rope"}))


def ids_and_mask(batch=2, length=12, padding=3):
    ids = torch.randint(2, VOCAB, (batch, length))
    mask = torch.ones_like(ids)
    mask[-1, :padding] = 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_configs_name_the_head_count_as_transformers_does(family):
    config = tiny_model(family, "rope").config
    assert config.num_attention_heads == config.num_heads
    assert type(config)(num_attention_heads=8).num_heads == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_classes_inherit_generation_mixin_directly(family):
    lm = FAMILY_MODELS[family].lm
    assert GenerationMixin in lm.__bases__ and lm.can_generate()
    assert list(inspect.signature(lm.forward).parameters)[1] == "input_ids"
    assert list(inspect.signature(FAMILY_MODELS[family].model.forward).parameters)[1] == "input_ids"


# -- activation checkpointing ----------------------------------------------------------------------------------------

def recomputed(model, ids):
    """How many times each block's mixer ran in one forward and backward of the loss, minus the forward."""
    counts = [0] * len(model.model.layers)
    handles = [block.mixer.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
               for i, block in enumerate(model.model.layers)]
    model(ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    return [c - 1 for c in counts]


def gradients(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_checkpointing_layers_with_transformers_options(family, monkeypatch):
    model = tiny_model(family, OPTION[family], num_hidden_layers=4).train()
    assert all(isinstance(block, GradientCheckpointingLayer) for block in model.model.layers)
    ids = torch.randint(0, VOCAB, (2, 16))
    assert recomputed(model, ids) == [0, 0, 0, 0]
    plain = gradients(model)

    calls = []
    checkpoint = transformers.modeling_utils.checkpoint
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint",
                        lambda *args, **kwargs: calls.append(kwargs) or checkpoint(*args, **kwargs))
    model.activation_checkpointing_enable(every_n_layers=2, activation_checkpointing_kwargs={"use_reentrant": True})
    assert model.is_activation_checkpointing
    assert recomputed(model, ids) == [1, 0, 1, 0]
    assert len(calls) == 2 and all(call["use_reentrant"] for call in calls)
    for name, grad in gradients(model).items():
        assert torch.allclose(grad, plain[name], atol=1e-6), name

    offloads = []
    save_on_cpu = transformers.modeling_utils.save_on_cpu

    def counted(*args, **kwargs):
        offloads.append(kwargs)
        return save_on_cpu(*args, **{**kwargs, "pin_memory": False})  # pinning needs an accelerator

    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu", counted)
    set_activation_checkpointing(model, offload=True)  # rotarium's wrapper passes transformers' options on
    assert recomputed(model, ids) == [1, 1, 1, 1] and len(offloads) == 4
    for name, grad in gradients(model).items():
        assert torch.allclose(grad, plain[name], atol=1e-6), name

    set_activation_checkpointing(model, enabled=False)
    assert not model.is_activation_checkpointing and recomputed(model, ids) == [0, 0, 0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the older name is deprecated in transformers 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert recomputed(model, ids) == [1, 1, 1, 1]
    # asking for a cache while checkpointing: the blocks run twice, so no cache is filled (transformers' rule)
    assert model(ids, use_cache=True).cache is None


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_with_checkpointing_gives_every_parameter_a_gradient(family, use_reentrant):
    model = tiny_model(family, OPTION[family]).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids = torch.randint(0, VOCAB, (2, 10))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# -- attention weights -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,pe", [c for c in COMBINATIONS if c[0] in ATTENTION_FAMILIES])
def test_softmax_families_return_their_attention_weights(family, pe):
    model = tiny_model(family, pe)
    ids, mask = ids_and_mask()
    B, T, H = 2, 12, model.config.num_heads
    with torch.no_grad():
        reference = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids, attention_mask=mask, output_attentions=True, use_cache=True)
    assert_close_at_scale(out.logits, reference, 1e-5, what="logits with attention weights")
    assert len(out.attentions) == model.config.num_hidden_layers
    for weights in out.attentions:
        assert weights.shape == (B, H, T, T)
        assert torch.all(weights.triu(1) == 0)  # causal
        assert torch.all(weights[1, :, :, :3] == 0)  # padded keys
        assert torch.allclose(weights[0].sum(-1), torch.ones(H, T), atol=1e-5)
        assert torch.allclose(weights[1, :, 3:].sum(-1), torch.ones(H, T - 3), atol=1e-5)
    # decoding from the cache: the new token against every cached key
    step = torch.randint(2, VOCAB, (B, 1))
    full_mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        decoded = model(step, attention_mask=full_mask, cache=out.cache, output_attentions=True)
        again = model(torch.cat([ids, step], 1), attention_mask=full_mask, output_attentions=True, use_cache=False)
    for weights, full in zip(decoded.attentions, again.attentions):
        assert weights.shape == (B, H, 1, T + 1)
        assert (weights[:, :, 0] - full[:, :, -1]).abs().max() <= 1e-5


def test_attention_weights_come_from_config_and_in_tuples():
    model = tiny_model("transformer", "rope")
    ids = torch.randint(2, VOCAB, (1, 7))
    model.config.output_attentions = True
    with torch.no_grad():
        out = model(ids, labels=ids, return_logits=True)
        plain = model(ids, labels=ids, return_logits=True, return_dict=False)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 7, 7)
    assert len(plain) == len(out.to_tuple())
    for a, b in zip(plain, out.to_tuple()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    model.config.output_attentions = False
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=3, do_sample=False, output_attentions=True,
                                   return_dict_in_generate=True)
    assert len(generated.attentions) == 3
    assert [step[0].shape for step in generated.attentions] == [(1, 4, 7, 7), (1, 4, 1, 8), (1, 4, 1, 9)]


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_linear_families_refuse_output_attentions_by_name(family):
    model = tiny_model(family, OPTION[family])
    ids = torch.randint(2, VOCAB, (1, 5))
    with pytest.raises(ValueError, match="`output_attentions=True`.*forms none"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="`output_attentions=True`"):
        model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="`output_attentions=True`"):
        model(ids)


# -- ModelTesterMixin's model checks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_hidden_states_tuples_and_gradients_follow_transformers(family):
    model = tiny_model(family, OPTION[family]).train()
    ids = torch.randint(2, VOCAB, (2, 9))
    attentions = family in ATTENTION_FAMILIES
    out = model(ids, labels=ids, return_logits=True, output_hidden_states=True, output_attentions=attentions)
    layers = model.config.num_hidden_layers
    assert len(out.hidden_states) == layers + 1 and all(h.shape == (2, 9, 32) for h in out.hidden_states)
    assert torch.allclose(out.hidden_states[-1], model.model(ids).last_hidden_state, atol=1e-5)
    assert (out.attentions is not None) == attentions
    # the tuple form holds the same values in the same order
    plain = model(ids, labels=ids, return_logits=True, output_hidden_states=True, output_attentions=attentions,
                  return_dict=False)
    assert len(plain) == len(out.to_tuple())
    # gradients reach the hidden states and attention weights the model returns
    out.hidden_states[0].retain_grad()
    if attentions:
        out.attentions[0].retain_grad()
    out.loss.backward()
    assert out.hidden_states[0].grad is not None
    assert not attentions or out.attentions[0].grad is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_batching_and_logits_to_keep_give_the_same_outputs(family):
    model = tiny_model(family, OPTION[family])
    ids, mask = ids_and_mask(batch=3)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        embedded = model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, use_cache=False)
        rows = [model(ids[i:i + 1], attention_mask=mask[i:i + 1], use_cache=False).logits for i in range(3)]
        last = model(ids, attention_mask=mask, logits_to_keep=1, use_cache=False).logits
    assert torch.allclose(embedded.logits, full, atol=1e-6)
    assert_close_at_scale(torch.cat(rows), full, 1e-5, what="rows one by one")
    assert torch.allclose(last, full[:, -1:], atol=1e-6)
    assert model.get_output_embeddings() is model.lm_head
    assert model.get_input_embeddings() is model.model.embed_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_with_transformers_position_ids_gives_the_unpadded_logits(family):
    """GenerationTesterMixin's left-padding check: positions ``cumsum(mask) - 1``, 1 on padding; also in a batch of
    one, where positions restarting at the first real token are not taken for packed documents."""
    model = tiny_model(family, OPTION[family])
    ids = torch.randint(2, VOCAB, (2, 10))
    padded = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids], 1)
    mask = torch.ones_like(padded)
    mask[:, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits[:, -1]
        batch = model(padded, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]
        one = model(padded[:1], attention_mask=mask[:1], position_ids=positions[:1], use_cache=False).logits[:, -1]
    assert_close_at_scale(batch, expected, 1e-5, what="left-padded batch")
    assert_close_at_scale(one, expected[:1], 1e-5, what="left-padded row")


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_between_real_tokens_gives_the_unpadded_logits_and_continues(family):
    """An attention mask with holes (PEFT's prompt tuning puts its virtual tokens before a left-padded prompt): the
    real tokens' logits, and a continuation from the cache, are those of the tokens without the holes."""
    model = tiny_model(family, OPTION[family])
    ids, ending = torch.randint(2, VOCAB, (2, 10)), torch.randint(2, VOCAB, (2, 3))
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[0, 4:7] = keep[1, 1:3] = keep[1, 12] = False
    holes = torch.zeros(2, 13, dtype=torch.long).masked_scatter(keep, ids)
    with torch.no_grad():
        expected = model(torch.cat([ids, ending], 1), use_cache=False).logits
        out = model(holes, attention_mask=keep.long(), use_cache=True)
        continued = model(ending, attention_mask=torch.cat([keep, torch.ones(2, 3, dtype=torch.bool)], 1).long(),
                          cache=out.cache).logits
    assert_close_at_scale(out.logits[keep].view(2, 10, -1), expected[:, :10], 1e-5, what="logits with holes")
    assert_close_at_scale(continued, expected[:, 10:], 1e-5, what="continued logits")


# -- GenerationTesterMixin's checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_generate_continues_from_its_cache_and_from_inputs_embeds(family, pe):
    model = tiny_model(family, pe)
    ids, mask = ids_and_mask(batch=2, length=7, padding=2)
    greedy = {"do_sample": False, "return_dict_in_generate": True}
    with torch.no_grad():
        whole = model.generate(ids, attention_mask=mask, max_new_tokens=8, **greedy)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=4, **greedy)
        mask_now = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
        rest = model.generate(first.sequences, attention_mask=mask_now, cache=first.cache, max_new_tokens=4,
                              **greedy)
        embed = model.get_input_embeddings()
        from_embeds = model.generate(inputs_embeds=embed(ids), attention_mask=mask, max_new_tokens=4, **greedy)
        rest_embeds = model.generate(inputs_embeds=embed(first.sequences), attention_mask=mask_now,
                                     cache=from_embeds.cache, max_new_tokens=4, **greedy)
    assert torch.equal(rest.sequences, whole.sequences)
    assert torch.equal(torch.cat([from_embeds.sequences, rest_embeds.sequences], 1), whole.sequences[:, 7:])


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_dict_outputs_and_assisted_sampling(family):
    model = tiny_model(family, OPTION[family])
    ids = torch.randint(2, VOCAB, (2, 6))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                             output_scores=True, output_logits=True, output_hidden_states=True)
        sampled = model.generate(ids[:1], max_new_tokens=6, do_sample=True, assistant_model=tiny_model(
            family, OPTION[family], num_hidden_layers=1))
    assert len(out.scores) == len(out.logits) == len(out.hidden_states) == 4
    assert out.hidden_states[0][0].shape == (2, 6, 32) and out.hidden_states[1][0].shape == (2, 1, 32)
    assert sampled.shape == (1, 12)


def test_options_that_do_not_rotate_by_position_keep_an_odd_head_size():
    """transformers checks a default rope_parameters on every config and refuses an odd head size; only RoPE and
    RoVE rotate by position, so only they carry rope_parameters and meet that check (as a ValueError)."""
    from rotarium import GLAConfig, TransformerConfig

    config = GLAConfig(hidden_size=30, num_heads=3, head_dim=5, position_encoding="nope")
    assert not hasattr(config, "rope_parameters") and config.head_dim == 5
    with pytest.raises(ValueError, match="even rotary dimension"):
        TransformerConfig(position_encoding="rove", head_dim=7)


# -- rope_parameters -------------------------------------------------------------------------------------------------

ROTATES = {"nope": False, "rope": True, "rove": True, "selective_rope": False}


@pytest.mark.parametrize(("family", "option"), COMBINATIONS)
def test_only_configs_with_rope_frequencies_carry_rope_parameters(family, option, tmp_path):
    """As transformers' own models without RoPE: transformers' utilities and rope-scaling tests take a config with
    the attribute for a RoPE model. Saving, loading and rebuilding keep the rule."""
    model = tiny_model(family, option)
    assert hasattr(model.config, "rope_parameters") == ROTATES[option]
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert ("rope_parameters" in saved) == ROTATES[option]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hasattr(loaded.config, "rope_parameters") == ROTATES[option]
    assert hasattr(type(loaded.config).from_dict(loaded.config.to_dict()), "rope_parameters") == ROTATES[option]
    ids = torch.randint(2, VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("option", ["nope", "selective_rope"])
def test_a_scaling_given_to_an_option_without_rope_frequencies_is_refused_by_name(option, tmp_path):
    tiny_model("gla", option).save_pretrained(tmp_path)
    scaling = {"rope_type": "yarn", "factor": 4.0}
    for load in (AutoModelForCausalLM.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(ValueError, match="`rope_parameters`"):
            load(tmp_path, rope_parameters=scaling)
    with pytest.raises(ValueError, match="`rope_parameters`"):
        with_rope_parameters(tiny_model("gla", option), scaling)


def test_switching_the_option_of_a_config_builds_and_saves():
    """An option switched on a built config: a RoPE model from a NoPE config (rope_parameters absent: unscaled),
    and a NoPE config from a RoPE one, which no longer carries rope_parameters once saved and loaded."""
    config = tiny_model("transformer", "nope").config
    config.position_encoding = "rope"
    rope = FAMILY_MODELS["transformer"].lm(config)
    assert rope.model.layers[0].mixer.positional.kind == "rope"
    config = tiny_model("gla", "rope").config
    config.position_encoding = "nope"
    assert FAMILY_MODELS["gla"].lm(config).model.layers[0].mixer.positional.kind == "nope"
    assert not hasattr(type(config).from_dict(config.to_dict()), "rope_parameters")


@pytest.mark.parametrize("name", ["rope_theta", "partial_rotary_factor"])
@pytest.mark.parametrize("option", ["rope", "rove"])
def test_rope_values_inside_rope_parameters_are_the_ones_used(name, option, tmp_path):
    """transformers 5 keeps rope_theta and partial_rotary_factor in rope_parameters and its models read them there:
    a config edited that way, or built with a dict that says so, gives the model built with the field set; the field
    stays a way to set them, before or after construction."""
    value = {"rope_theta": 500.0, "partial_rotary_factor": 0.5}[name]
    expected = tiny_model("transformer", option, **{name: value})
    ids = torch.randint(2, VOCAB, (1, 8))
    with torch.no_grad():
        logits = expected(ids).logits
        assert not torch.allclose(logits, tiny_model("transformer", option)(ids).logits)  # the value matters

        def check(config):
            model = FAMILY_MODELS["transformer"].lm(config).eval()
            model.load_state_dict(expected.state_dict())
            torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=0)

        edited = tiny_model("transformer", option).config
        edited.rope_parameters[name] = value  # transformers' way
        check(edited)
        check(type(edited).from_dict(edited.to_dict()))  # a saved config keeps it
        given = tiny_model("transformer", option, rope_parameters={"rope_type": "default", name: value}).config
        assert getattr(given, name) == value
        check(given)
        field = tiny_model("transformer", option).config
        setattr(field, name, value)  # as from_pretrained(path, rope_theta=...) sets it
        assert field.rope_parameters[name] == value
        check(field)
