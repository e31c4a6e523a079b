"""`rotarium export` and `rotarium push` publish only what the checkpoint holds: weights that do not match the
config are refused (never exported with random tensors in their place), no symbolic link out of the checkpoint is
followed (a link to a private file would be uploaded) except a real Hugging Face cache snapshot's links into its own
blobs, where they write is checked before any work, and the model card names no local path and copies what it takes
from run files as text."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from rotarium.hub import export as export_module
from rotarium.hub import export_checkpoint, push_checkpoint
from rotarium.hub import push as push_module
from tests.cli_cases import error_line, run_cli_cases
from tests.hub.helpers import CodeInPickle, make_checkpoint, write_run_outputs

SECRET = "hf_private_token_do_not_publish"
REVISION = "0123456789abcdef0123456789abcdef01234567"


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
    for name in ("missing-layer", "unexpected-tensor", "linked-tokenizer", "linked-plot", "linked-args",
                 "pickled-code"):
        shutil.copytree(root / "good", root / name)
    _edit_weights(root / "missing-layer" / "checkpoint-30",
                  lambda w: {k: v for k, v in w.items() if ".layers.1." not in k})
    _edit_weights(root / "unexpected-tensor" / "checkpoint-30", lambda w: {**w, "model.extra.weight": torch.zeros(2)})
    (root / "linked-tokenizer" / "checkpoint-30" / "special_tokens_map.json").symlink_to(
        root / "private" / "secret.txt")
    (root / "linked-plot" / "eval" / "loss.png").symlink_to(root / "private" / "secret.txt")
    (root / "linked-args" / "training_args.json").unlink()
    (root / "linked-args" / "training_args.json").symlink_to(root / "private" / "secret.json")
    weights = load_file(root / "pickled-code" / "checkpoint-30" / "model.safetensors")
    (root / "pickled-code" / "checkpoint-30" / "model.safetensors").unlink()
    torch.save({**weights, "evil": CodeInPickle(root / "ran.txt")},
               root / "pickled-code" / "checkpoint-30" / "pytorch_model.bin")

    # a parent folder named `snapshots` is no Hugging Face cache: its links may not leave the checkpoint
    (root / "home" / ".ssh").mkdir(parents=True)
    (root / "home" / ".ssh" / "id_rsa").write_text(SECRET)
    make_checkpoint(root / "home" / "snapshots" / "model", "gla", "rope", tokenizer=True)
    (root / "home" / "snapshots" / "model" / "tokenizer_config.json").unlink()
    (root / "home" / "snapshots" / "model" / "tokenizer_config.json").symlink_to("../../.ssh/id_rsa")
    # a folder shaped as the cache whose blobs/ is itself a link elsewhere
    repo = root / "cache" / "models--someone--tiny"
    make_checkpoint(repo / "snapshots" / REVISION, "gla", "rope", tokenizer=True)
    (repo / "blobs").symlink_to(root / "private")
    (repo / "snapshots" / REVISION / "tokenizer_config.json").unlink()
    (repo / "snapshots" / REVISION / "tokenizer_config.json").symlink_to("../../blobs/secret.txt")

    (root / "a-file").write_text("mine")
    (root / "read-only").mkdir()
    (root / "read-only").chmod(0o555)
    return root


CASES = {  # name -> (checkpoint folder, texts the error line must hold)
    "missing layer": ("missing-layer/checkpoint-30", ["missing", "model.layers.1.", "do not match its config.json"]),
    "unexpected tensor": ("unexpected-tensor/checkpoint-30", ["unexpected", "model.extra.weight"]),
    "linked tokenizer file": ("linked-tokenizer/checkpoint-30",
                              ["checkpoint-30/special_tokens_map.json", "symbolic link"]),
    "linked evaluation plot": ("linked-plot/checkpoint-30", ["eval/loss.png", "symbolic link"]),
    "linked training metadata": ("linked-args/checkpoint-30", ["linked-args/training_args.json", "symbolic link"]),
    "pickled code in the weights": ("pickled-code/checkpoint-30",
                                    ["hold code or Python objects besides tensors", "are not loaded"]),
    "link out of a folder named snapshots": ("home/snapshots/model",
                                             ["home/snapshots/model/tokenizer_config.json", "symbolic link"]),
    "cache blobs that are a link": (f"cache/models--someone--tiny/snapshots/{REVISION}",
                                    [f"{REVISION}/tokenizer_config.json", "symbolic link"]),
}
# Outputs and card options refused before any work: name -> (arguments after the command, texts of the error line)
OPTION_CASES = {
    "export: output is a file": (["{good}", "{root}/a-file", "--overwrite"], ["a-file is a file"]),
    "export: output under a file": (["{good}", "{root}/a-file/out"], ["a-file is a file"]),
    "export: read-only output": (["{good}", "{root}/read-only/out"], ["read-only", "not writable"]),
    "export: local path as --dataset": (["{good}", "{root}/exports/x", "--dataset", "./corpora/my_data"],
                                        ["--dataset './corpora/my_data' is not a Hub dataset id"]),
    "push: local path as --dataset": (["{good}", "someone/tiny", "--dry-run", "--dataset", "{root}/corpora"],
                                      ["--dataset", "is not a Hub dataset id"]),
    "push: --dataset with a line break": (["{good}", "someone/tiny", "--dry-run", "--dataset", "a\n---\nlicense: x"],
                                          ["is not a Hub dataset id"]),
    "export: --license with a line break": (["{good}", "{root}/exports/x", "--license", "mit\n---"],
                                            ["--license", "is not a license id"]),
}


@pytest.fixture(scope="module")
def results(root) -> dict[str, tuple[int, str] | None]:
    cases = {}
    for name, (folder, _) in CASES.items():
        checkpoint = str(root / folder)
        cases[f"export: {name}"] = ["export", checkpoint, str(root / "exports" / name.replace(" ", "-"))]
        cases[f"push: {name}"] = ["push", checkpoint, "someone/gla-tiny", "--dry-run"]
    good = root / "good" / "checkpoint-30"
    for name, (argv, _) in OPTION_CASES.items():
        cases[name] = [name.split(":")[0], *(a.format(root=root, good=good) for a in argv)]
    return run_cli_cases(cases, root, skip_if_writable={"export: read-only output": root / "read-only"})


# These tests share the checkpoints and their cases (module fixtures, made again in each worker that runs one of
# them): one worker runs them all (xdist_group), so those are made once.
@pytest.mark.slow
@pytest.mark.xdist_group("export-safety")
@pytest.mark.parametrize("command", ["export", "push"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_that_would_publish_the_wrong_thing_is_refused(case, command, root, results):
    message = error_line(results[f"{command}: {case}"], command)
    for text in CASES[case][1]:
        assert text in message, f"{text!r} not in {message!r}"
    assert "weights_only` set to `False" not in message and not (root / "ran.txt").exists()
    exports = root / "exports"
    assert not exports.exists() or not any(exports.iterdir())  # no export, not even a temporary one
    secrets = {root / "private" / "secret.txt", root / "private" / "secret.json", root / "home" / ".ssh" / "id_rsa"}
    leaked = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p not in secrets
              and SECRET.encode() in p.read_bytes()]
    assert leaked == []


@pytest.mark.slow
@pytest.mark.xdist_group("export-safety")
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_outputs_and_card_options_are_checked_before_the_work(case, root, results):
    message = error_line(results[case], case.split(":")[0])
    for text in OPTION_CASES[case][1]:
        assert text in message, f"{text!r} not in {message!r}"
    assert (root / "a-file").read_text() == "mine"
    assert not (root / "exports").exists() or not any((root / "exports").iterdir())


def test_export_and_push_check_where_they_write_before_loading_the_weights(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "ckpt", "gla", "rope")
    (tmp_path / "a-file").write_text("mine")

    def no_work(*args, **kwargs):
        raise AssertionError("the export started before its output was checked")

    monkeypatch.setattr(export_module, "load_weights", no_work)
    monkeypatch.setattr(push_module, "write_export", no_work)
    with pytest.raises(ValueError, match="a-file is a file"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "a-file" / "out")
    with pytest.raises(ValueError, match="overlaps the checkpoint"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "ckpt" / "..", overwrite=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file"))  # no temporary folder can be made there
    with pytest.raises(ValueError, match="TMPDIR"):
        push_checkpoint(tmp_path / "ckpt", "someone/tiny", dry_run=True, log=lambda _: None)
    assert (tmp_path / "a-file").read_text() == "mine"


def test_a_hugging_face_cache_snapshot_exports_through_its_links(tmp_path):
    """snapshot_download's layout: <repo>/snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / REVISION
    make_checkpoint(snapshot, "gla", "rope", tokenizer=True)
    (repo / "blobs").mkdir()
    for file in sorted(snapshot.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(repo / "blobs" / digest)
        file.symlink_to(Path("../../blobs") / digest)
    out = export_checkpoint(snapshot, tmp_path / "out")
    assert (out / "tokenizer_config.json").is_file() and not (out / "tokenizer_config.json").is_symlink()
    plan = push_checkpoint(snapshot, "someone/tiny", dry_run=True, log=lambda _: None)
    assert {"model.safetensors", "tokenizer_config.json"} <= set(dict(plan.files))


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


HOSTILE = "x\n---\nlicense: evil\n---\n# Owned\n<script>alert(1)</script> [click](http://evil.example) `code`"


def test_the_model_card_copies_run_files_as_text(tmp_path):
    """Names and values from training_args.json, metrics.jsonl and eval/ cannot add front matter, HTML, links,
    headings or table cells to the published card; a dataset name that is no Hub id becomes no link or metadata."""
    run = tmp_path / "run"
    make_checkpoint(run / "final", "gla", "rope")
    write_run_outputs(run)
    (run / "training_args.json").write_text(json.dumps({"dataset": HOSTILE, "note": HOSTILE, HOSTILE: 1}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": "<img src=x onerror=alert(1)>", "loss": HOSTILE}) + "\n")
    table = [{HOSTILE: 1.5, "ppl](javascript:alert(1))": HOSTILE}]
    (run / "eval" / "<b>hostile.json").write_text(json.dumps(table))
    shutil.copy(run / "eval" / "perplexity.png", run / "eval" / "x](http:evil.example).png")
    card = (export_checkpoint(run / "final", tmp_path / "exported") / "README.md").read_text()

    assert card.startswith("---\n") and card.splitlines().count("---") == 2  # the front matter's own two lines
    assert set(yaml.safe_load(card.split("---\n", 2)[1])) == {"library_name", "pipeline_tag", "license", "tags"}
    assert "huggingface.co/datasets" not in card
    for tag in ("<script", "<img", "<b>"):
        assert tag not in card
    assert "&lt;script&gt;" in card  # shown as text
    # every link left is an evaluation plot in the export, none comes from a run file
    assert all(target.startswith("eval/") for target in re.findall(r"(?<!\\)\]\(([^)]*)\)", card))
    headings = [line for line in card.splitlines() if line.startswith("#")]
    assert not any("Owned" in line and not line.startswith("###") for line in headings)
    assert not any(line.startswith("# Owned") for line in card.splitlines())
    table_rows = [line for line in card.splitlines() if line.startswith("| note |")]
    assert len(table_rows) == 1 and table_rows[0].count(" | ") == 1  # one cell of name, one of value
