"""The four families through the transformers API: loss, saving, generation, caching, positions."""
import copy
import inspect

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

import rotarium
from rotarium.models import CONFIGS, RotariumCache, set_activation_checkpointing
from tests.asserts import assert_close_at_scale
from tests.models.helpers import COMBINATIONS, FAMILIES, VOCAB, one_option_each, tiny_config, tiny_model


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_loss_is_finite_and_every_parameter_gets_a_gradient(family, pe):
    model = tiny_model(family, pe).train()
    ids = torch.randint(0, VOCAB, (2, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    loss = model(ids, labels=labels).loss
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    # the loss is the shifted next-token cross-entropy ignoring -100
    logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    assert torch.allclose(loss, expected, atol=1e-5)


@pytest.mark.parametrize("family", ["gla", "transformer"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_chunked_loss_equals_the_loss_from_full_logits(family, packed):
    """With labels the loss goes through the output projection chunk by chunk and no logits are returned;
    ``return_logits=True`` computes the full logits and the loss from them: the same loss and gradients."""
    model = tiny_model(family, "rope").train()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 30) if packed else (2, 24), generator=generator)
    labels = ids.clone()
    labels[0, 3:7] = -100
    kwargs = {"cu_seqlens": torch.tensor([0, 11, 30])} if packed else {}
    results = []
    for options in ({}, {"return_logits": True}, {"num_items_in_batch": torch.tensor(17)},
                    {"num_items_in_batch": torch.tensor(17), "return_logits": True}):
        model.zero_grad()
        out = model(ids, labels=labels, **kwargs, **options)
        assert (out.logits is None) is not options.get("return_logits", False)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    for (loss, grads), (loss_ref, grads_ref) in (results[:2], results[2:]):
        assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=0)
        for name, grad in grads_ref.items():
            assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max()), name


def test_evaluation_mode_returns_the_logits_with_the_loss():
    """Evaluation loops read the logits beside the loss (transformers' Trainer hands them to ``compute_metrics``), as
    from any causal LM: in ``eval()`` mode they come with it, and ``return_logits=False`` keeps the chunked loss alone;
    in training mode the chunked loss is the default."""
    model = tiny_model("gla", "rope").eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, labels=ids)
        lean = model(ids, labels=ids, return_logits=False)
        assert full.logits.shape == (2, 12, VOCAB) and lean.logits is None
        torch.testing.assert_close(full.loss, lean.loss)
        assert model.train()(ids, labels=ids).logits is None


# The options that size heads apart from the width (Gated DeltaNet's published 6 heads of 256) and that give the
# QK-norm its own weights per head and its own epsilon (fla's Forgetting Transformer): with every positional option,
# they save, load and decode as the defaults do.
HEAD_OPTIONS = {
    "gla": {"hidden_size": 30, "num_heads": 3, "head_dim": 8, "expand_v": 1.5},
    "deltanet": {"hidden_size": 30, "num_heads": 3, "head_dim": 8, "expand_v": 2.0, "use_gated_delta": True,
                 "use_output_gate": True},
    "fox": {"qk_norm": True, "qk_norm_per_head": True, "qk_norm_eps": 1e-5, "num_kv_heads": 2},
    "transformer": {"qk_norm": True, "qk_norm_eps": 1e-5},
}


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_head_dim_and_qk_norm_options_save_and_decode(family, pe, tmp_path):
    model = tiny_model(family, pe, **HEAD_OPTIONS[family])
    mixer = model.model.layers[0].mixer
    if family in ("gla", "deltanet"):
        assert (mixer.head_k_dim, mixer.head_v_dim) == (8, 12 if family == "gla" else 16)
    else:
        assert mixer.q_norm.eps == 1e-5
        assert mixer.q_norm.weight.shape == ((4, 8) if family == "fox" else (8,))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        assert torch.equal(loaded(ids).logits, full)
        out = model(ids[:, :11], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        logits = [out.logits]
        for t in range(11, 30):
            logits.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert_close_at_scale(torch.cat(logits, 1), full, 1e-4, what="decoded logits")


def test_per_head_qk_norm_normalises_each_head_with_its_own_weight():
    norm = rotarium.layers.HeadRMSNorm(3, 4, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(3, 4) + 0.5)
    x = torch.randn(2, 5, 3, 4)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_save_and_auto_load_give_identical_logits(family, pe, tmp_path):
    model = tiny_model(family, pe)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == f"rotarium_{family}"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    base = AutoModel.from_pretrained(tmp_path)
    assert isinstance(base, rotarium.models.RotariumModel)


def greedy_without_cache(model, ids, steps):
    for _ in range(steps):
        next_token = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], 1)
    return ids


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_greedy_generate_with_cache_equals_recomputing_the_prefix(family, pe):
    model = tiny_model(family, pe)
    ids = torch.randint(2, VOCAB, (1, 9))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=32, do_sample=False)
        assert torch.equal(generated, greedy_without_cache(model, ids, 32))
    assert len(set(generated[0, 9:].tolist())) > 1


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(family, pe):
    model = tiny_model(family, pe)
    long, short = torch.randint(2, VOCAB, (1, 12)), torch.randint(2, VOCAB, (1, 7))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False)
        alone_long = model.generate(long, max_new_tokens=12, do_sample=False)
        alone_short = model.generate(short, max_new_tokens=12, do_sample=False)
    assert torch.equal(out[0, 12:], alone_long[0, 12:])
    assert torch.equal(out[1, 12:], alone_short[0, 7:])


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_prefill_then_token_by_token_logits_equal_the_full_forward(family, pe):
    model = tiny_model(family, pe)
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :11], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        assert isinstance(cache, RotariumCache) and cache.get_seq_length() == 11
        logits = [out.logits]
        for t in range(11, 30):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    assert_close_at_scale(torch.cat(logits, 1), full, 1e-4, what="decoded logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_copying_selective_rope_decodes_like_the_full_forward(family):
    """The reference's copying setting: the "rfa" spectrum and skip_conv, whose first difference is carried by the
    convolution state across decoding steps and survives the model's initialisation frozen."""
    model = tiny_model(family, "selective_rope", selective_rope_spectrum="rfa", selective_rope_skip_conv=True,
                       selective_rope_bias=True, selective_rope_phase_gate=True)
    convs = [m.conv for m in model.modules() if type(m).__name__ == "SelectiveRoPE"]
    assert convs and all(not c.weight.requires_grad and c.weight[:, 0].tolist() == [[-1.0, 1.0]] * c.channels
                         for c in convs)
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :7], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(7, 20):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    assert_close_at_scale(torch.cat(logits, 1), full, 1e-4, what="decoded logits")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pe", ["rope", "rove"])
def test_shifting_position_ids_leaves_logits_unchanged(family, pe):
    model = tiny_model(family, pe)
    ids = torch.randint(0, VOCAB, (2, 20))
    positions = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        a = model(ids, position_ids=positions).logits
        b = model(ids, position_ids=positions + 777).logits
    # float32 angles of position 777 carry ~1e-5 relative error, hence a tolerance relative to the logits' scale
    assert_close_at_scale(b, a, 1e-4, what="shifted logits")


@pytest.mark.parametrize("family,pe", one_option_each(
    {"gla": "selective_rope", "fox": "nope", "deltanet": "rope", "transformer": "rove"}))
def test_packed_documents_equal_separate_forwards_and_loss_skips_boundaries(family, pe):
    model = tiny_model(family, pe)
    docs = [torch.randint(0, VOCAB, (1, n)) for n in (9, 4, 13)]
    cu = torch.tensor([0, 9, 13, 26])
    packed = torch.cat(docs, 1)
    with torch.no_grad():
        logits = model(packed, cu_seqlens=cu).logits
        separate = torch.cat([model(d).logits for d in docs], 1)
        assert_close_at_scale(logits, separate, 1e-4, what="packed logits")
        loss = model(packed, labels=packed, cu_seqlens=cu).loss
        per_doc = [torch.nn.functional.cross_entropy(model(d).logits[0, :-1], d[0, 1:], reduction="sum") for d in docs]
    assert torch.allclose(loss, sum(per_doc) / (26 - 3), atol=1e-5)


def test_sampling_and_beam_search_run_with_the_recurrent_cache():
    model = tiny_model("gla", "selective_rope")
    ids = torch.randint(2, VOCAB, (2, 6))
    with torch.no_grad():
        sampled = model.generate(ids, max_new_tokens=10, do_sample=True, top_k=5, temperature=0.8)
        assert sampled.shape == (2, 16)
        beams = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False)
        beams_nocache = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(beams, beams_nocache)


@pytest.mark.parametrize("family", ["gla", "fox", "transformer"])
def test_expanded_and_selected_cache_rows_continue_their_own_sequences(family):
    model = tiny_model(family, "rope")
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids[[1, 0]], use_cache=False).logits
        out = model(ids[:, :8], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        cache.batch_repeat_interleave(2)  # rows a a b b
        cache.batch_select_indices(torch.tensor([2, 1]))  # rows b a
        logits = [model(ids[[1, 0], t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(8, 12)]
    assert_close_at_scale(torch.cat(logits, 1), full[:, 8:], 1e-4, what="decoded logits")


@pytest.mark.parametrize("family", ["fox", "transformer"])
def test_a_copied_prompt_cache_serves_several_continuations(family):
    """transformers' prompt reuse: each continuation decodes from a deep copy of one prefilled cache."""
    model = tiny_model(family, "rope")
    prompt, endings = torch.randint(0, VOCAB, (1, 9)), torch.randint(0, VOCAB, (3, 1, 4))
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        prompt_cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for ending in endings:
            cache = copy.deepcopy(prompt_cache)
            logits = [model(ending[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(4)]
            full = model(torch.cat([prompt, ending], 1), use_cache=False).logits[:, 9:]
            assert_close_at_scale(torch.cat(logits, 1), full, 1e-4, what="decoded logits")


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model("deltanet", "selective_rope").train()
    ids = torch.randint(0, VOCAB, (2, 16))
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_activation_checkpointing(model)
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, plain[n], atol=1e-6), n


def test_tied_embeddings_resize_and_bfloat16(tmp_path):
    model = tiny_model("transformer", "rope", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.resize_token_embeddings(VOCAB + 7)
    assert model.config.vocab_size == VOCAB + 7 and model(torch.tensor([[VOCAB + 3]])).logits.shape[-1] == VOCAB + 7
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    out = loaded(torch.randint(0, VOCAB, (1, 70))).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    untied = tiny_model("transformer", "rope")
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()



def test_to_dtype_and_from_pretrained_dtype_give_selective_rope_the_same_temperatures(tmp_path):
    """The frozen temperatures are computed constants, as RoPE's frequencies, which stay float32: ``model.to(dtype)``
    keeps their float32 values as ``from_pretrained(dtype=...)`` does, so that both give the same model, and a cast
    model's checkpoint holds the temperatures it was trained with. Learned temperatures are weights: cast, and
    loaded in the dtype asked, as the others."""
    model = tiny_model("transformer", "selective_rope")
    temperatures = model.model.layers[0].mixer.positional.tau.clone()
    model.save_pretrained(tmp_path / "float32")
    cast = copy.deepcopy(model).to(torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "float32", dtype=torch.bfloat16)
    cast.save_pretrained(tmp_path / "cast")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "cast", dtype=torch.float32)
    for version in (cast, loaded, reloaded, copy.deepcopy(cast).float()):
        for block in version.model.layers:
            assert block.mixer.positional.tau.dtype == torch.float32
            assert torch.equal(block.mixer.positional.tau, temperatures)
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(cast(ids).logits, loaded(ids).logits)
    learned = tiny_model("transformer", "selective_rope", selective_rope_learn_temperature=True)
    learned.save_pretrained(tmp_path / "learned")
    cast = learned.to(torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "learned", dtype=torch.bfloat16)
    for version in (cast, loaded):
        assert version.model.layers[0].mixer.positional.tau.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(cast(ids).logits, loaded(ids).logits)

@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_training_step_tracks_float32(family):
    """accelerate's bf16 mixed precision on a CPU: the projections run in bf16, the kernels stay float32."""
    model = tiny_model(family, "selective_rope").train()
    ids = torch.randint(0, VOCAB, (2, 150))  # several chunks
    reference = model(ids, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - reference.item()) < 0.02 * reference.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_initialisation_follows_the_recipe():
    config = tiny_config("deltanet", "selective_rope", use_gated_delta=False, num_hidden_layers=8)
    model = rotarium.DeltaNetForCausalLM(config)
    std = config.initializer_range
    assert abs(model.model.embed_tokens.weight.std().item() - std) < 0.005
    o_proj = model.model.layers[0].mixer.o_proj.weight
    assert abs(o_proj.std().item() - std / 4) < 0.002  # residual projections scaled by 1/sqrt(2 * layers)
    decay_bias = model.model.layers[0].mixer.positional.decay_proj.bias
    assert torch.all(torch.sigmoid(decay_bias) > 0.9)  # Selective RoPE's decay starts with long memories
    gated = rotarium.DeltaNetForCausalLM(tiny_config("deltanet", "nope", use_gated_delta=True))
    A = gated.model.layers[0].mixer.A_log.exp()
    assert torch.all((A >= 1) & (A <= 16))


def test_gpt2_shaped_presets_have_gpt2s_special_tokens():
    # GPT-2's tokenizer ends (and starts) every document with <|endoftext|>, id 50256; ids 1 and 2, the Llama
    # presets' bos and eos, are '"' and '#' in GPT-2's vocabulary, at which generate() would stop
    for name in ("transformer-124m", "transformer-354m"):
        config = rotarium.preset_config(name)
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (50256, 50256, None), name
    assert (rotarium.preset_config("transformer-370m").bos_token_id,
            rotarium.preset_config("transformer-370m").eos_token_id) == (1, 2)  # the Llama-2 tokenizer's


def test_presets_have_the_advertised_sizes():
    from rotarium.configs.param_table import parameter_count

    for name in rotarium.PRESETS:
        count = parameter_count(name, position_encoding="selective_rope")
        advertised = {"124m": 124e6, "354m": 354e6, "370m": 370e6, "1.3b": 1.3e9}[name.rsplit("-", 1)[1]]
        assert abs(count - advertised) / advertised < 0.1, (name, count)
    # the RoVE paper's GPT-2-shaped models: GPT-2 small's and medium's shapes and vocabulary, tied embeddings, and
    # GPT-2's 8 d^2 MLP parameters a layer (within one SwiGLU rounding)
    for name, layers, width, heads in (("transformer-124m", 12, 768, 12), ("transformer-354m", 24, 1024, 16)):
        config = rotarium.TransformerConfig.from_preset(name, position_encoding="rove")
        assert (config.num_hidden_layers, config.hidden_size, config.num_heads) == (layers, width, heads)
        assert config.vocab_size == 50257 and config.max_position_embeddings == 1024 and config.tie_word_embeddings
        assert abs(3 * config.intermediate_size - 8 * width) <= 3 * 64
        for option in ("nope", "rope", "rove", "selective_rope"):
            count = parameter_count(name, position_encoding=option)
            assert abs(count - int(name.rsplit("-", 1)[1][:-1]) * 1e6) < 1.5e6 + (option == "selective_rope") * 2e6
    config = rotarium.GLAConfig.from_preset("gla-370m", position_encoding="selective_rope")
    assert config.hidden_size == 1024 and config.position_encoding == "selective_rope"
    assert rotarium.preset_config("fox-1.3b").num_heads == 32
    with pytest.raises(ValueError, match="deltanet"):
        rotarium.GLAConfig.from_preset("deltanet-370m")
    with pytest.raises(ValueError, match="preset"):
        rotarium.preset_config("gla-7b")


@pytest.mark.parametrize("family,overrides,field", [
    ("gla", {"hidden_size": 30}, "num_heads"),
    ("gla", {"position_encoding": "alibi"}, "position_encoding"),
    ("gla", {"expand_k": 0.3}, "expand_k"),
    ("fox", {"num_kv_heads": 3}, "num_kv_heads"),
    ("transformer", {"vocab_size": 0}, "vocab_size"),
    ("deltanet", {"num_hidden_layers": "2"}, "num_hidden_layers"),
    ("transformer", {"position_encoding": "rove", "head_dim": 7}, "rotary dimension"),
    ("gla", {"selective_rope_spectrum": "x", "position_encoding": "selective_rope"}, "selective_rope_spectrum"),
    ("gla", {"initializer_range": 2.0}, "initializer_range"),
    ("deltanet", {"head_dim": 0}, "head_dim"),
    ("gla", {"head_dim": 5, "expand_v": 0.5}, "expand_v"),
    ("fox", {"qk_norm_eps": 1e-5}, "qk_norm"),
    ("transformer", {"qk_norm_per_head": True}, "qk_norm"),
    ("transformer", {"qk_norm": True, "qk_norm_eps": 0.0}, "qk_norm_eps"),
])
def test_invalid_configs_raise_value_errors_naming_the_field(family, overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(family, overrides.pop("position_encoding", "nope"), **overrides)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_saved_field_is_a_typed_argument_documented_where_it_is_defined(family):
    config_class = CONFIGS[family]
    shared = dict(inspect.signature(rotarium.RotariumConfig.__init__).parameters)
    own = dict(inspect.signature(config_class.__init__).parameters)
    for arguments in (shared, own):
        for name in ("self", "kwargs"):
            arguments.pop(name)
    transformers_fields = set(PretrainedConfig().to_dict())
    config = config_class()
    # rope_parameters only where the option has RoPE frequencies (transformers' convention)
    unsaved = set() if hasattr(config, "rope_parameters") else {"rope_parameters"}
    assert set(config.to_dict()) - transformers_fields == (set(shared) | set(own)) - unsaved
    for owner, arguments in ((rotarium.RotariumConfig, shared), (config_class, own)):
        for name, argument in arguments.items():
            assert argument.annotation is not inspect.Parameter.empty, (owner.__name__, name)
            assert f"\n        {name} (`" in owner.__doc__, (owner.__name__, name)
    # a family repeats a shared field only to change its default
    for name in set(own) & set(shared):
        assert own[name].default != shared[name].default, name
    assert set(config_class.mixer_fields) <= set(own)
