import pytest

from rotarium.models import FAMILY_MODELS
from rotarium.training.build import accumulation_steps
from rotarium.training.config import Config, load_config, parse_overrides, recipe_names


def test_default_is_the_embedded_selective_rope_gla():
    config = load_config()
    assert config.model.family == "gla" and config.model.position_encoding == "selective_rope"
    assert config.data.source == "embedded" and config.tokenizer.name is None


def test_overrides_parse_and_coerce():
    overrides = parse_overrides(["--optim.lr", "1e-3", "--train.seed=3", "--eval.context_lengths", "[32, 64]",
                                 "--model.options.rope_theta", "500", "--train.report_to", "[tensorboard]"])
    config = load_config(None, overrides)
    assert config.optim.lr == 1e-3 and config.train.seed == 3 and config.eval.context_lengths == [32, 64]
    assert config.model.options == {"rope_theta": 500} and config.train.report_to == ["tensorboard"]


@pytest.mark.parametrize("overrides, message", [
    ({"optim.lrr": "1"}, "optim.lrr"),
    ({"nosection.lr": "1"}, "nosection.lr"),
    ({"train.max_steps": "many"}, "train.max_steps"),
    ({"train.max_steps": "0"}, "train.max_steps"),
    ({"optim.schedule": "linear"}, "optim.schedule"),
    ({"model.preset": "gla-7b"}, "model.preset"),
    ({"model.family": "mamba"}, "model.family"),
    ({"data.validation_fraction": "1.5"}, "data.validation_fraction"),
    ({"model.gradient_checkpointing": "maybe"}, "model.gradient_checkpointing"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_missing_or_unknown_config_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="neither a YAML file nor a recipe"):
        load_config("gla-7b-rope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(str(bad))


def test_override_syntax_errors():
    with pytest.raises(ValueError, match="needs a value"):
        parse_overrides(["--optim.lr"])
    with pytest.raises(ValueError, match="unexpected argument"):
        parse_overrides(["lr"])


def test_recipes_cover_every_family_size_and_position():
    names = recipe_names()
    assert len([name for name in names if "-370m-" in name or "-1.3b-" in name]) == len(FAMILY_MODELS) * 2 * 4
    for family in FAMILY_MODELS:
        for size, tokens in (("370m", 10e9), ("1.3b", 26e9)):
            for position in ("nope", "rope", "rove", "selective_rope"):
                config = load_config(f"{family}-{size}-{position.replace('_', '-')}")
                assert config.model.preset == f"{family}-{size}"
                assert config.model.position_encoding == position
                # a folder `rotarium prepare` writes from FineWeb-Edu with the recipe's tokenizer (data.prepare)
                subset = "10BT" if size == "370m" else "100BT"
                assert config.data.source == f"data/fineweb-edu-{subset.lower()}-llama2"
                assert not config.data.streaming
                # the 1.3B runs read 26B tokens of the 100B sample: prepare stops past them
                limit = "" if size == "370m" else " --max-tokens 27e9"
                assert config.data.prepare == (
                    f"HuggingFaceFW/fineweb-edu {config.data.source} --config sample-{subset} --streaming "
                    f"--tokenizer {config.tokenizer.name} --validation-documents 2000{limit}")
                assert config.data.seq_len == 2048 and config.optim.betas == [0.9, 0.95]
                per_step = config.train.global_batch_size * config.data.seq_len
                assert per_step == 524288  # about 0.5M tokens a step
                assert abs(per_step * config.train.max_steps - tokens) / tokens < 0.01
                assert config.optim.schedule == "cosine" and config.train.mixed_precision == "bf16"
                assert accumulation_steps(config, 8) == 2 and accumulation_steps(config, 16) == 1


def test_the_overrides_to_the_selective_rope_references_settings_apply_to_the_recipes():
    """docs/training.md gives the overrides that turn a recipe's positional settings into the Selective RoPE
    reference's; each must be a field the recipe's model takes, with the meaning stated."""
    from rotarium.configs import preset_config

    reference = {"gla": "rotary_gate_per_pair=false", "transformer": "selective_rope_decay=false",
                 "deltanet": "use_gated_delta=true use_output_gate=true", "fox": ""}
    for family, extra in reference.items():
        tokens = ["--model.options.selective_rope_rank", "null", "--model.options.selective_rope_gain_per_head",
                  "true", "--model.options.selective_rope_phase_gate", "true"]
        for item in extra.split():
            key, value = item.split("=")
            tokens += [f"--model.options.{key}", value]
        config = load_config(f"{family}-370m-selective-rope", parse_overrides(tokens))
        model = preset_config(config.model.preset, position_encoding=config.model.position_encoding,
                              **config.model.options)
        assert (model.selective_rope_rank, model.selective_rope_gain_per_head, model.selective_rope_phase_gate) == (
            None, True, True)
        rope = load_config(f"{family}-370m-rope", parse_overrides(["--model.options.rope_theta", "500000"]))
        assert preset_config(rope.model.preset, **rope.model.options).rope_theta == 500000
    assert load_config("gla-370m-rope").model.options == {}  # the recipes keep rotarium's defaults


def test_the_rove_papers_recipes_train_gpt2_shapes_on_fineweb_edu_10b():
    for size, lr in (("124m", 6e-4), ("354m", 3e-4)):
        for position in ("rope", "rove"):
            config = load_config(f"transformer-{size}-{position}")
            assert (config.model.preset, config.model.position_encoding) == (f"transformer-{size}", position)
            assert config.tokenizer.name == "openai-community/gpt2" and config.data.seq_len == 1024
            assert config.data.prepare == (
                f"HuggingFaceFW/fineweb-edu {config.data.source} --config sample-10BT --streaming "
                "--tokenizer openai-community/gpt2 --validation-documents 2000")
            per_step = config.train.global_batch_size * config.data.seq_len
            assert per_step == 524288 and abs(per_step * config.train.max_steps - 10e9) / 10e9 < 0.01
            assert config.optim.lr == lr and config.optim.schedule == "cosine"
            # as docs/training.md states them: llm.c's warmup, build-nanogpt's floor of a tenth, AdamW as both
            o = config.optim
            assert (o.warmup_steps, o.min_lr_ratio, o.weight_decay, o.betas, o.grad_clip) == (
                700, 0.1, 0.1, [0.9, 0.95], 1.0)
            assert config.train.mixed_precision == "bf16"
            assert max(config.eval.context_lengths) == 16 * config.data.seq_len  # the paper's 16k
            assert accumulation_steps(config, 8) * 8 * config.train.batch_size == config.train.global_batch_size
    assert {n for n in recipe_names() if "-124m-" in n or "-354m-" in n} == {
        "transformer-124m-rope", "transformer-124m-rove", "transformer-354m-rope", "transformer-354m-rove"}


def test_global_batch_must_divide():
    config = Config()
    config.train.global_batch_size, config.train.batch_size = 48, 16
    assert accumulation_steps(config, 1) == 3
    with pytest.raises(ValueError, match="global_batch_size"):
        accumulation_steps(config, 2)
