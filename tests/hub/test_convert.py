"""``rotarium convert``: fla's and Llama's checkpoints become rotarium folders that compute the same logits.

The fla side is fla's own model classes run on CPU (:func:`fla_on_cpu`), saved with fla's ``save_pretrained``; the
converted folder is loaded with ``AutoModelForCausalLM`` after ``import rotarium``. fla's Transformer cannot be
built without flash-attn, so its checkpoint is written by hand under its parameter names from the weights of an
equivalent transformers model (Llama; Qwen3 for the QK-norm), which is then the oracle.
"""
from __future__ import annotations

import argparse
import json
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from fla.models import TransformerConfig as FlaTransformerConfig
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import rotarium
from rotarium.hub.convert import (
    COPIED_FILES,
    FLA_DEFAULTS,
    FLA_TYPES,
    SOURCE_PATTERNS,
    add_commands,
    convert_checkpoint,
    fla_config_classes,
    fla_intermediate_size,
    map_fla_config,
    resolve_source,
)
from rotarium.models import CONFIGS, build_mixer
from tests.asserts import assert_close_at_scale
from tests.fla_cpu import fla_on_cpu, tiny_fla_model
from tests.hub.helpers import BLOCK_ROTARIUM, run_python, save_tokenizer

BATCH, LENGTH = 2, 70  # longer than fla's 64-token chunk, so its chunked kernels run
TOL = 1e-4  # at the logits' scale
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# Each model type with fla's defaults, then the options that map to something other than a default: GLA's
# convolutions, unfused gate norm without weight and tied embeddings, DeltaNet's output gate, Gated DeltaNet's head
# size that does not divide the width (its published 6 x 256 heads), FoX's per-head QK-norm, GQA, biases and gate.
CASES = [
    pytest.param("gla", {}, id="gla"),
    pytest.param("gla", {"use_short_conv": True, "fuse_norm": False, "elementwise_affine": False,
                         "tie_word_embeddings": True}, id="gla-conv-unfused-no-affine-tied"),
    pytest.param("delta_net", {}, id="delta_net"),
    pytest.param("delta_net", {"use_gate": True, "expand_v": 2.0}, id="delta_net-gate"),
    pytest.param("gated_deltanet", {}, id="gated_deltanet"),
    pytest.param("gated_deltanet", {"hidden_size": 72, "num_heads": 6, "head_dim": 16, "expand_v": 2.0,
                                    "use_gate": False}, id="gated_deltanet-head_dim"),
    pytest.param("forgetting_transformer", {}, id="forgetting_transformer"),
    pytest.param("forgetting_transformer", {"qk_norm": True, "use_output_gate": True, "num_kv_heads": 2,
                                            "qkv_bias": True}, id="forgetting_transformer-qk_norm-gqa"),
]


def token_ids(vocab_size: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


def converted_logits(src: Path, out: Path, ids: torch.Tensor) -> torch.Tensor:
    convert_checkpoint(src, out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__module__.startswith("rotarium.")
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("spread", [True, False], ids=["spread", "fla-init"])
@pytest.mark.parametrize(("model_type", "overrides"), CASES)
def test_fla_model_converts_to_the_same_logits(tmp_path, model_type, overrides, spread):
    fla_model = tiny_fla_model(model_type, spread=spread, **overrides)
    fla_model.save_pretrained(tmp_path / "fla")
    ids = token_ids()
    with fla_on_cpu(), torch.no_grad():
        expected = fla_model(ids).logits
    got = converted_logits(tmp_path / "fla", tmp_path / "rotarium", ids)
    assert_close_at_scale(got, expected, TOL)


# Llama / Qwen3 parameter names -> fla Transformer's (the inverse of the converter's renames)
TO_FLA = ((".self_attn.", ".attn."), (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm."),
          ("model.embed_tokens.", "model.embeddings."))


def write_fla_transformer(folder: Path, model: torch.nn.Module, **config: object) -> None:
    """A checkpoint as fla's ``TransformerForCausalLM.save_pretrained`` writes it: fla's config and the weights of
    ``model`` under fla's parameter names."""
    state = {}
    for name, tensor in model.state_dict().items():
        for old, new in TO_FLA:
            name = name.replace(old, new)
        state[name] = tensor.contiguous()
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    FlaTransformerConfig(**config).save_pretrained(folder)


TINY_LLAMA = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


def tiny_reference(model_class: type, config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    with torch.no_grad():  # norm weights away from 1, so that a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def fla_transformer_config(qk_norm: bool, rope_theta: float) -> dict[str, object]:
    return {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "norm_eps": 1e-5, "qk_norm": qk_norm, "rope_theta": rope_theta}


def test_fla_transformer_converts_to_llamas_logits(tmp_path):
    llama = tiny_reference(LlamaForCausalLM, LlamaConfig(**TINY_LLAMA, rope_theta=500.0))
    write_fla_transformer(tmp_path / "fla", llama, **fla_transformer_config(qk_norm=False, rope_theta=500.0))
    ids = token_ids()
    with torch.no_grad():
        expected = llama(ids).logits
    assert_close_at_scale(converted_logits(tmp_path / "fla", tmp_path / "rotarium", ids), expected, TOL)


def test_fla_transformer_with_qk_norm_converts_to_qwen3s_logits(tmp_path):
    # Qwen3 is Llama with fla's Transformer QK-norm: one RMSNorm weight per head size, before RoPE; fla fixes its
    # epsilon at 1e-5, so the model's norm_eps is set to the same for Qwen3 to compute the same function.
    qwen = tiny_reference(Qwen3ForCausalLM, Qwen3Config(**TINY_LLAMA, head_dim=16, rope_theta=10000.0))
    write_fla_transformer(tmp_path / "fla", qwen, **fla_transformer_config(qk_norm=True, rope_theta=10000.0))
    ids = token_ids()
    with torch.no_grad():
        expected = qwen(ids).logits
    assert_close_at_scale(converted_logits(tmp_path / "fla", tmp_path / "rotarium", ids), expected, TOL)


# Each scaling transformers' Llama reads, with an original length of 32 and a non-default key where it has one; the
# logits are compared at 4x that length, where every scaling departs from plain RoPE.
ORIGINAL_LENGTH = 32
SCALED_LLAMAS = [
    pytest.param({"rope_type": "linear", "factor": 4.0}, id="linear"),
    pytest.param({"rope_type": "dynamic", "factor": 4.0}, id="dynamic"),
    pytest.param({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_LENGTH}, id="yarn"),
    pytest.param({"rope_type": "yarn", "factor": 4.0, "beta_fast": 16, "attention_factor": 1.2}, id="yarn-keys"),
    pytest.param({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": ORIGINAL_LENGTH}, id="llama3"),
]


@pytest.mark.parametrize("scaling", SCALED_LLAMAS)
def test_scaled_llama_converts_to_the_same_logits_at_four_times_its_length(tmp_path, scaling):
    llama = tiny_reference(LlamaForCausalLM, LlamaConfig(
        **TINY_LLAMA, max_position_embeddings=ORIGINAL_LENGTH,
        rope_parameters={**scaling, "rope_theta": 500.0}))
    llama.save_pretrained(tmp_path / "llama")
    ids = torch.randint(0, 128, (BATCH, 4 * ORIGINAL_LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = llama(ids).logits
    got = converted_logits(tmp_path / "llama", tmp_path / "rotarium", ids)
    assert_close_at_scale(got, expected, TOL)
    config = json.loads((tmp_path / "rotarium" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == scaling["rope_type"]
    # and unscaled, the converted model would not have matched: the scaling is what the comparison checks
    unscaled = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, max_position_embeddings=ORIGINAL_LENGTH,
                                            rope_theta=500.0)).float().eval()
    unscaled.load_state_dict(llama.state_dict())
    with torch.no_grad(), pytest.raises(AssertionError):
        assert_close_at_scale(unscaled(ids).logits, expected, 10 * TOL)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_converts_to_the_same_logits_with_its_tokenizer(tmp_path, tied):
    llama = tiny_reference(LlamaForCausalLM, LlamaConfig(**TINY_LLAMA, rope_theta=500000.0, tie_word_embeddings=tied))
    llama.save_pretrained(tmp_path / "llama")
    save_tokenizer(tmp_path / "llama")
    ids = token_ids()
    with torch.no_grad():
        expected = llama(ids).logits
    assert_close_at_scale(converted_logits(tmp_path / "llama", tmp_path / "rotarium", ids), expected, TOL)
    config = json.loads((tmp_path / "rotarium" / "config.json").read_text())
    assert config["model_type"] == "rotarium_transformer" and config["rope_theta"] == 500000.0
    assert (tmp_path / "rotarium" / "tokenizer.json").is_file()
    assert (tmp_path / "rotarium" / "modeling_rotarium.py").is_file()


def test_every_tokenizer_file_is_carried_over_and_downloaded(tmp_path):
    """A chat model's template is a file of its own (chat_template.jinja): the converted folder keeps it, and a Hub
    source's download fetches it."""
    from transformers import AutoTokenizer

    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path / "llama")
    save_tokenizer(tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "llama")
    assert (tmp_path / "llama" / "chat_template.jinja").is_file()
    convert_checkpoint(tmp_path / "llama", tmp_path / "out")
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == tokenizer.chat_template
    assert all(any(fnmatch(name, pattern) for pattern in SOURCE_PATTERNS) for name in COPIED_FILES)


SHARDS = {"model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                   "b": "model-00002-of-00002.safetensors"}})}
HUB_REPOS = {  # a Hub repository's files -> those a download of it must fetch
    "whole": ({"config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin"},
              {"config.json", "tokenizer.json", "model.safetensors"}),
    "sharded": ({"config.json", *SHARDS, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "consolidated.safetensors", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
                 "pytorch_model-00002-of-00002.bin"},
                {"config.json", *SHARDS, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "pytorch_model.bin.index.json"}),
    "pickled only": ({"config.json", "tokenizer.model", "pytorch_model.bin.index.json",
                      "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"},
                     {"config.json", "tokenizer.model", "pytorch_model.bin.index.json",
                      "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"}),
}


@pytest.mark.parametrize("layout", list(HUB_REPOS))
def test_a_hub_source_downloads_one_weights_layout(tmp_path, monkeypatch, layout):
    """A repository holding its weights as safetensors and as pickles fetches only the safetensors (the layout
    transformers loads first, and convert reads), and of sharded safetensors only the shards its index names; a
    repository of pickles alone fetches them. Every download is of the same commit."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    files, expected = HUB_REPOS[layout]
    commit = "0123456789abcdef" * 2 + "01234567"
    snapshot = tmp_path / "models--owner--name" / "snapshots" / commit
    fetched, revisions = set(), []

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, **_):
        assert repo_id == "owner/name"
        revisions.append(revision)
        snapshot.mkdir(parents=True, exist_ok=True)
        for name in filter_repo_objects(sorted(files), allow_patterns=allow_patterns):
            fetched.add(name)
            (snapshot / name).write_text(SHARDS.get(name, "{}"))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_source("owner/name") == snapshot
    assert fetched == expected
    assert revisions[1:] and set(revisions[1:]) == {commit}


def test_convert_command_writes_the_folder(tmp_path, capsys):
    tiny_fla_model("delta_net").save_pretrained(tmp_path / "fla")
    parser = argparse.ArgumentParser(prog="rotarium")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["convert", str(tmp_path / "fla"), str(tmp_path / "out")])
    assert args.func(args) == 0
    assert "converted" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "rotarium_deltanet"


def test_conversion_is_atomic_and_refuses_to_overwrite(tmp_path):
    tiny_fla_model("gla").save_pretrained(tmp_path / "fla")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_checkpoint(tmp_path / "fla", out)
    convert_checkpoint(tmp_path / "fla", out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    # a refused conversion leaves nothing behind
    tiny_fla_model("delta_net", allow_neg_eigval=True).save_pretrained(tmp_path / "neg")
    with pytest.raises(ValueError):
        convert_checkpoint(tmp_path / "neg", tmp_path / "neg-out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fla", "neg", "out"]


# Every fla option rotarium cannot express, with the field the error must name.
REFUSED = [
    ("gla", {"num_kv_heads": 2}, "num_kv_heads"),
    ("gla", {"feature_map": "relu"}, "feature_map"),
    ("gla", {"use_output_gate": False}, "use_output_gate"),
    ("gla", {"clamp_min": -0.05}, "clamp_min"),
    ("delta_net", {"use_beta": False}, "use_beta"),
    ("delta_net", {"qk_activation": "relu"}, "qk_activation"),
    ("delta_net", {"qk_norm": "sum"}, "qk_norm"),
    ("delta_net", {"allow_neg_eigval": True}, "allow_neg_eigval"),
    ("delta_net", {"use_short_conv": False}, "use_short_conv"),
    ("gated_deltanet", {"num_v_heads": 8}, "num_v_heads"),
    ("gated_deltanet", {"output_gate_activation": "sigmoid"}, "output_gate_activation"),
    ("gated_deltanet", {"allow_neg_eigval": True}, "allow_neg_eigval"),
    ("gated_deltanet", {"use_short_conv": False}, "use_short_conv"),
    ("forgetting_transformer", {"window_size": 16}, "window_size"),
]


@pytest.mark.parametrize(("model_type", "overrides", "field"), REFUSED,
                         ids=[f"{t}-{f}" for t, _, f in REFUSED])
def test_inexpressible_fla_options_raise_naming_the_field(tmp_path, model_type, overrides, field):
    tiny_fla_model(model_type, **overrides).save_pretrained(tmp_path / "fla")
    with pytest.raises(ValueError, match=f"`{field}` = "):
        convert_checkpoint(tmp_path / "fla", tmp_path / "out")


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("changes", "field"), [
    ({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                          "rope_theta": 10000.0}}, "rope_parameters.rope_type"),
])
def test_inexpressible_llama_options_raise_naming_the_field(tmp_path, changes, field):
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path / "llama")
    edit_config(tmp_path / "llama", **changes)
    with pytest.raises(ValueError, match=f"`{field}` = "):
        convert_checkpoint(tmp_path / "llama", tmp_path / "out")


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 0.5}, {"rope_type": "yarn", "factor": 4.0,
                                                                              "original_max_position_embeddings": -1}])
def test_a_llama_scaling_that_cannot_work_is_refused_naming_the_key(tmp_path, scaling):
    """transformers only warns of a factor below 1; rotarium refuses it as it refuses it in its own configs."""
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path / "llama")
    edit_config(tmp_path / "llama", rope_parameters={**scaling, "rope_theta": 10000.0})
    key = next(key for key in ("factor", "original_max_position_embeddings") if key in scaling and scaling[key] < 1)
    with pytest.raises(ValueError, match=f"cannot convert llama: `rope_parameters.{key}` must be"):
        convert_checkpoint(tmp_path / "llama", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("changes", "field"), [({"qk_norm": True, "window_size": 8}, "window_size"),
                                                ({"hidden_act": "powlu"}, "hidden_act")])
def test_inexpressible_fla_transformer_options_raise(tmp_path, changes, field):
    llama = tiny_reference(LlamaForCausalLM, LlamaConfig(**TINY_LLAMA))
    write_fla_transformer(tmp_path / "fla", llama, **fla_transformer_config(qk_norm=False, rope_theta=10000.0))
    edit_config(tmp_path / "fla", **changes)
    with pytest.raises(ValueError, match=f"`{field}` = "):
        convert_checkpoint(tmp_path / "fla", tmp_path / "out")


def test_unknown_sources_raise(tmp_path):
    llama = tiny_reference(LlamaForCausalLM, LlamaConfig(**TINY_LLAMA))
    llama.save_pretrained(tmp_path / "llama")
    edit_config(tmp_path / "llama", model_type="transformer")  # not fla's Transformer: its names are Llama's
    with pytest.raises(ValueError, match="not fla's Transformer"):
        convert_checkpoint(tmp_path / "llama", tmp_path / "out")
    edit_config(tmp_path / "llama", model_type="mamba")
    with pytest.raises(ValueError, match="model_type 'mamba'"):
        convert_checkpoint(tmp_path / "llama", tmp_path / "out")
    with pytest.raises(ValueError, match="neither a folder nor a Hub model id"):
        convert_checkpoint(tmp_path / "missing", tmp_path / "out")


# The settings of fla's published models (flame's configs, fla-hub's config.json) that shape the conversion.
PUBLISHED = [
    pytest.param("gla", {"hidden_size": 1024, "num_heads": 4}, id="gla-340M"),
    pytest.param("gla", {"hidden_size": 2048, "num_heads": 4, "attn_mode": "fused_chunk"}, id="gla-1.3B-100B"),
    pytest.param("delta_net", {"hidden_size": 2048, "num_heads": 16}, id="delta_net-1.3B-100B"),
    pytest.param("gated_deltanet", {"hidden_size": 1024, "num_heads": 6, "head_dim": 256}, id="gated_deltanet-340M"),
    pytest.param("gated_deltanet", {"hidden_size": 2048, "num_heads": 6, "head_dim": 256}, id="gated_deltanet-1B"),
    pytest.param("transformer", {"hidden_size": 1024, "num_heads": 16}, id="transformer-340M"),
    pytest.param("forgetting_transformer", {"hidden_size": 1024, "num_heads": 16, "qk_norm": True}, id="fox-qk_norm"),
]


@pytest.mark.parametrize(("model_type", "settings"), PUBLISHED)
def test_published_fla_configs_map_to_rotarium_configs_of_the_same_shapes(model_type, settings):
    fla_config = fla_config_classes()[model_type](**settings)
    family, kwargs = map_fla_config(model_type, fla_config)
    config = CONFIGS[family](**kwargs)  # builds every layer's shapes on the meta device
    with torch.device("meta"):
        mixer = build_mixer(family, **config.mixer_kwargs())
    if model_type == "gated_deltanet":
        assert (mixer.head_k_dim, mixer.head_v_dim, mixer.v_proj.out_features) == (256, 512, 6 * 512)
    assert config.intermediate_size == fla_intermediate_size(fla_config)


@pytest.mark.parametrize("model_type", FLA_TYPES)
def test_fla_defaults_used_without_fla_are_fla_s(model_type):
    fla_config = fla_config_classes()[model_type]()
    for field, default in FLA_DEFAULTS[model_type].items():
        assert getattr(fla_config, field, None) == default, (model_type, field)


def test_conversion_without_fla_reads_the_config_alike(tmp_path, monkeypatch):
    # GLA's defaults differ most from rotarium's (no short convolutions)
    tiny_fla_model("gla").save_pretrained(tmp_path / "fla")
    convert_checkpoint(tmp_path / "fla", tmp_path / "with-fla")
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` now raises ImportError
    convert_checkpoint(tmp_path / "fla", tmp_path / "without-fla")
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("with-fla", "without-fla")]
    assert configs[0] == configs[1] and configs[0]["use_short_conv"] is False


CHILD = BLOCK_ROTARIUM + r"""
import json, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("rotarium", trust_remote_code=True).eval()
expected = torch.load("expected.pt")
with torch.no_grad():
    torch.save(model(expected["ids"]).logits, "logits.pt")
json.dump({"module": type(model).__module__,
           "leaked": sorted(m for m in __import__("sys").modules if m.split(".")[0] in ("rotarium", "fla"))},
          open("results.json", "w"))
"""


@pytest.mark.slow
def test_converted_folder_loads_without_rotarium(tmp_path):
    fla_model = tiny_fla_model("gated_deltanet", hidden_size=72, num_heads=6, head_dim=16)
    fla_model.save_pretrained(tmp_path / "fla")
    ids = token_ids()
    with fla_on_cpu(), torch.no_grad():
        torch.save({"ids": ids, "logits": fla_model(ids).logits}, tmp_path / "expected.pt")
    convert_checkpoint(tmp_path / "fla", tmp_path / "rotarium")
    proc = run_python(CHILD, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["module"].startswith("transformers_modules.") and results["leaked"] == []
    assert_close_at_scale(torch.load(tmp_path / "logits.pt"), torch.load(tmp_path / "expected.pt")["logits"], TOL)


def test_convert_checkpoint_is_exported():
    assert rotarium.convert_checkpoint is convert_checkpoint
