"""`rotarium export` and `rotarium push` publish only what the checkpoint holds: weights that do not match the
config are refused (never exported with random tensors in their place), no symbolic link out of the checkpoint is
followed (a link to a private file would be uploaded), and the model card names no local path."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from rotarium.hub import export_checkpoint, push_checkpoint
from tests.hub.helpers import make_checkpoint, write_run_outputs
from tests.reliability.cli_cases import error_line, run_cli_cases

SECRET = "hf_private_token_do_not_publish"


def _edit_weights(folder: Path, edit) -> None:
    weights = load_file(folder / "model.safetensors")
    save_file(edit(weights), folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Checkpoints of a run folder, each wrong in one way, beside a private file outside all of them."""
    root = tmp_path_factory.mktemp("export-safety")
    (root / "private").mkdir()
    (root / "private" / "secret.txt").write_text(SECRET)
    (root / "private" / "secret.json").write_text(json.dumps({"api_token": SECRET}))

    make_checkpoint(root / "good" / "checkpoint-30", "gla", "rope", tokenizer=True)
    write_run_outputs(root / "good")
    for name in ("missing-layer", "unexpected-tensor", "linked-tokenizer", "linked-plot", "linked-args"):
        shutil.copytree(root / "good", root / name)
    _edit_weights(root / "missing-layer" / "checkpoint-30",
                  lambda w: {k: v for k, v in w.items() if ".layers.1." not in k})
    _edit_weights(root / "unexpected-tensor" / "checkpoint-30", lambda w: {**w, "model.extra.weight": torch.zeros(2)})
    (root / "linked-tokenizer" / "checkpoint-30" / "special_tokens_map.json").symlink_to(
        root / "private" / "secret.txt")
    (root / "linked-plot" / "eval" / "loss.png").symlink_to(root / "private" / "secret.txt")
    (root / "linked-args" / "training_args.json").unlink()
    (root / "linked-args" / "training_args.json").symlink_to(root / "private" / "secret.json")
    return root


CASES = {  # name -> (checkpoint folder, texts the error line must hold)
    "missing layer": ("missing-layer", ["missing", "model.layers.1.", "do not match its config.json"]),
    "unexpected tensor": ("unexpected-tensor", ["unexpected", "model.extra.weight"]),
    "linked tokenizer file": ("linked-tokenizer", ["checkpoint-30/special_tokens_map.json", "symbolic link"]),
    "linked evaluation plot": ("linked-plot", ["eval/loss.png", "symbolic link"]),
    "linked training metadata": ("linked-args", ["linked-args/training_args.json", "symbolic link"]),
}


@pytest.fixture(scope="module")
def results(root) -> dict[str, tuple[int, str]]:
    cases = {}
    for name, (folder, _) in CASES.items():
        checkpoint = str(root / folder / "checkpoint-30")
        cases[f"export: {name}"] = ["export", checkpoint, str(root / "exports" / folder)]
        cases[f"push: {name}"] = ["push", checkpoint, "someone/gla-tiny", "--dry-run"]
    return run_cli_cases(cases, root)


@pytest.mark.parametrize("command", ["export", "push"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_that_would_publish_the_wrong_thing_is_refused(case, command, root, results):
    message = error_line(results[f"{command}: {case}"], command)
    for text in CASES[case][1]:
        assert text in message, f"{text!r} not in {message!r}"
    exports = root / "exports"
    assert not exports.exists() or not any(exports.iterdir())  # no export, not even a temporary one
    leaked = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.parent.name != "private"
              and SECRET.encode() in p.read_bytes()]
    assert leaked == []


def test_tied_weights_and_links_inside_the_checkpoint_are_fine(tmp_path):
    make_checkpoint(tmp_path / "ckpt", "transformer", "rope", tokenizer=True, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "ckpt" / "model.safetensors")  # tied: not stored
    (tmp_path / "ckpt" / "tokenizer.json").rename(tmp_path / "ckpt" / "tokenizer-v1.json")
    (tmp_path / "ckpt" / "tokenizer.json").symlink_to("tokenizer-v1.json")
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert not (out / "tokenizer.json").is_symlink()
    assert (out / "tokenizer.json").read_text() == (tmp_path / "ckpt" / "tokenizer-v1.json").read_text()
    plan = push_checkpoint(tmp_path / "ckpt", "someone/tiny", dry_run=True, log=lambda _: None)
    assert "model.safetensors" in dict(plan.files)


def test_the_model_card_names_no_local_path(tmp_path):
    make_checkpoint(tmp_path / "run" / "final", "gla", "rope")
    write_run_outputs(tmp_path / "run")
    args = {"data.source": "corpora/my_corpus.jsonl", "model.init_from": f"{tmp_path / 'runs' / 'base' / 'final'}/",
            "tokenizer.name": "gpt2", "dataset_name": [str(tmp_path / "corpora"), "someone/data"],
            "eval.sample_prompt": "x/2/3 is not a path", "optim.lr": 0.003}
    (tmp_path / "run" / "training_args.json").write_text(json.dumps(args))
    out = export_checkpoint(tmp_path / "run" / "final", tmp_path / "exported")
    card = (out / "README.md").read_text()
    assert str(tmp_path) not in card and "corpora" not in card and "runs/base" not in card
    assert "| data.source | my_corpus.jsonl |" in card and "| model.init_from | final |" in card
    assert "| tokenizer.name | gpt2 |" in card  # a Hub id stays as it is
    assert "| eval.sample_prompt | x/2/3 is not a path |" in card
    assert yaml.safe_load(card.split("---\n", 2)[1])["datasets"] == ["someone/data"]  # Hub ids only
    assert 'repo = "exported"' in card  # the usage snippet names the folder, not where it is
