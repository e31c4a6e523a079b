"""`rotarium export`: the folder's contents, the model card, the reverse direction, and safe writing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import rotarium
from rotarium.cli import main
from rotarium.hub import export as export_module
from rotarium.hub import export_checkpoint, read_checkpoint
from rotarium.hub.checkpoint import table_rows
from rotarium.models.remote_code import bundle
from tests.hub.helpers import make_checkpoint, write_run_outputs
from tests.models.helpers import VOCAB


def card_header(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A training run folder: metadata and eval outputs beside checkpoint-30/, which holds a tokenizer."""
    run = tmp_path_factory.mktemp("run")
    model = make_checkpoint(run / "checkpoint-30", "gla", "selective_rope", tokenizer=True)
    write_run_outputs(run)
    return run, model


def test_export_folder_and_model_card(run, tmp_path):
    run, model = run
    out = export_checkpoint(run / "checkpoint-30", tmp_path / "export", repo_id="someone/gla-tiny")
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json",
            "tokenizer_config.json", "modeling_rotarium.py", "configuration_rotarium.py",
            "eval/perplexity.png"} <= names
    assert {name for name in names if name.endswith(".py")} == set(bundle())  # the model code only
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_rotarium.GLAConfig",
                                  "AutoModel": "modeling_rotarium.GLAModel",
                                  "AutoModelForCausalLM": "modeling_rotarium.GLAForCausalLM"}
    card = (out / "README.md").read_text()
    meta = card_header(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "mit" and meta["datasets"] == ["HuggingFaceFW/fineweb-edu"]
    assert {"rotarium", "gla", "selective-rope", "custom_code"} <= set(meta["tags"])
    n = model.num_parameters()
    assert f"| parameters | {n / 1e3:.1f}K ({n:,}) |" in card
    assert "| position_encoding | selective_rope |" in card
    assert "Tokens: 30.0K (30,000)." in card  # the last metrics line wins over max_tokens
    assert "Training loss at step 30: 3.7." in card  # not the validation record written after it
    assert "Validation loss at step 30: 4.5 (perplexity 90)." in card
    assert "| learning_rate | 0.003 |" in card and "optimizer" not in card  # nested values are left out
    assert "| context_length | perplexity |\n|---|---|\n| 64 | 31.25 |\n| 128 | 30.5 |\n| 256 | 45.125 |" in card
    assert "![perplexity](eval/perplexity.png)" in card
    assert 'repo = "someone/gla-tiny"' in card and "AutoTokenizer" in card


def test_card_without_metadata_and_cli_options(tmp_path, capsys):
    make_checkpoint(tmp_path / "ckpt", "transformer", "rove")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--license", "apache-2.0",
                 "--dataset", "me/data"]) == 0
    assert "exported" in capsys.readouterr().out
    card = (tmp_path / "out" / "README.md").read_text()
    meta = card_header(card)
    assert meta["license"] == "apache-2.0" and meta["datasets"] == ["me/data"]
    assert "## Evaluation" not in card and "Tokens:" not in card
    assert 'repo = "out"' in card and str(tmp_path) not in card and "AutoTokenizer" not in card


@pytest.mark.parametrize("layout", [
    [{"context_length": 64, "perplexity": 3.0}],
    {"rows": [{"context_length": 64, "perplexity": 3.0}]},
    {"context_length": [64], "perplexity": [3.0]},
    {"context_length": 64, "perplexity": 3.0},
])
def test_eval_table_layouts(layout):
    assert table_rows(layout) == [{"context_length": 64, "perplexity": 3.0}]
    assert table_rows({"nested": {"a": 1}}) is None


def test_rotarium_loads_exports_with_and_without_code(run, tmp_path):
    run, model = run
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
    out = export_checkpoint(run / "checkpoint-30", tmp_path / "with-code")
    plain = tmp_path / "without-code"
    shutil.copytree(out, plain)
    for f in plain.glob("*.py"):
        f.unlink()
    config = json.loads((plain / "config.json").read_text())
    del config["auto_map"]
    (plain / "config.json").write_text(json.dumps(config))
    for folder in (out, plain):
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(loaded) is rotarium.GLAForCausalLM  # rotarium's classes, no remote code
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, expected)
        # and the folder exports again (an exported checkpoint is a checkpoint)
        assert read_checkpoint(folder).family == "gla"


def test_bf16_is_kept(tmp_path):
    model = make_checkpoint(tmp_path / "ckpt", "fox", "rope")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_bad_checkpoints_and_targets(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        export_checkpoint(tmp_path / "other", tmp_path / "out")
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "rotarium_gla"}))
    with pytest.raises(ValueError, match="no weights"):
        export_checkpoint(tmp_path / "other", tmp_path / "out")
    with pytest.raises(ValueError, match="not a folder"):
        export_checkpoint(tmp_path / "missing", tmp_path / "out")
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "rotarium export: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

    make_checkpoint(tmp_path / "ckpt", "deltanet", "nope")
    with pytest.raises(ValueError, match="overlaps the checkpoint"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "ckpt" / "export")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_a_failed_export_leaves_the_previous_one(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "ckpt", "gla", "rope")
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    before = sorted(p.name for p in out.iterdir())

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "write_export", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(tmp_path / "ckpt", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # no temporary folder left behind
    monkeypatch.undo()
    export_checkpoint(tmp_path / "ckpt", out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


def test_metadata_of_a_rotarium_train_checkpoint_is_found_in_its_run_folder(tmp_path):
    """`rotarium train` writes <run>/checkpoints/step-<N>/ with metrics.jsonl and eval/ in <run>."""
    make_checkpoint(tmp_path / "run" / "checkpoints" / "step-30", "gla", "rope")
    write_run_outputs(tmp_path / "run")
    checkpoint = read_checkpoint(tmp_path / "run" / "checkpoints" / "step-30")
    assert checkpoint.last_metrics["step"] == 30
    assert checkpoint.training_args["dataset"] == "HuggingFaceFW/fineweb-edu"


def test_exported_weights_get_the_permissions_of_the_other_files(run, tmp_path):
    """safetensors writes its files 0600; an export's weights read as its other files do (the umask's)."""
    import os

    previous = os.umask(0o022)
    try:
        out = export_checkpoint(run[0] / "checkpoint-30", tmp_path / "export")
    finally:
        os.umask(previous)
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


@pytest.mark.parametrize("size", ["lots", "-5MB", "0KB", "100", "5GiB"])
def test_a_shard_size_that_is_no_size_is_refused_before_the_work(tmp_path, monkeypatch, capsys, size):
    """save_pretrained would fail on it only after the weights are loaded, naming no flag, or (a size of 0 or below)
    write one file per tensor."""
    make_checkpoint(tmp_path / "ckpt", "gla", "rope")

    def no_work(*args, **kwargs):
        raise AssertionError("the export started before --max-shard-size was checked")

    monkeypatch.setattr(export_module, "load_weights", no_work)
    for argv in (["export", str(tmp_path / "ckpt"), str(tmp_path / "out")],
                 ["push", str(tmp_path / "ckpt"), "someone/tiny", "--dry-run"]):
        assert main([*argv, f"--max-shard-size={size}"]) == 2
        assert f"error: --max-shard-size {size!r} is not a size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out", max_shard_size="1.5GB")  # a decimal size is one


def test_a_run_folder_given_as_the_checkpoint_is_refused_naming_its_checkpoints(tmp_path, capsys):
    make_checkpoint(tmp_path / "run" / "checkpoints" / "step-6", "gla", "rope")
    write_run_outputs(tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert f"pass one of the checkpoints in it: {tmp_path / 'run' / 'checkpoints' / 'step-6'}" in message
    make_checkpoint(tmp_path / "run" / "final", "gla", "rope")
    with pytest.raises(ValueError, match=r"checkpoints in it: .*/run/final, .*/run/checkpoints/step-6"):
        export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_folder_saved_twice_in_two_weight_layouts_is_refused(tmp_path):
    """save_pretrained sharding into a folder that holds a model.safetensors leaves it there, and transformers loads
    it before the new index: the export would publish the older weights. Convert would read the index instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rotarium.hub.convert import convert_checkpoint

    model = make_checkpoint(tmp_path / "ckpt", "gla", "rope")
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4))
    llama.save_pretrained(tmp_path / "llama")
    llama.save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    for run in (lambda: export_checkpoint(tmp_path / "ckpt", tmp_path / "out"),
                lambda: convert_checkpoint(tmp_path / "llama", tmp_path / "out")):
        with pytest.raises(ValueError, match="both model.safetensors and model.safetensors.index.json"):
            run()
    assert not (tmp_path / "out").exists()
