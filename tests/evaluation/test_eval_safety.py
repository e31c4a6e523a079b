"""`rotarium eval` and `rotarium generate` use only what the run left, and say so when they cannot: eval scores the
documents the run held out or stops (a corpus changed since training, a moved corpus, a relative `data.source` read
from another directory), no command uses a checkpoint with missing, unexpected or unreadable weights (eval,
generate, train's --init-from), and a prompt that is not UTF-8 or an output folder that cannot be written is one
error line before any work."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, held_out_documents
from rotarium.data.heldout import documents_sha256
from tests.cli_cases import error_line, run_cli_cases
from tests.hub.helpers import CodeInPickle
from tests.training.helpers import ROOT, TINY, cli_args

# one worker runs the module, so its trained run and cases are made once (a module fixture is made per worker)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("eval-safety")]

SHORT = ["--context-lengths", "16", "--max-tokens", "256"]


def _train_with_a_relative_source(work: Path) -> Path:
    """A 2-step run trained in ``work`` on ``data.source=corpus`` (a folder named relative to ``work``)."""
    (work / "corpus").mkdir(parents=True)
    (work / "corpus" / "docs.txt").write_text("\n\n\n".join(embedded_documents()[:40]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    args = cli_args(Path("corpus"), train__max_steps=2, train__eval_every=2, train__save_every=2)
    result = subprocess.run([sys.executable, "-m", "rotarium", "train", "--output-dir", "run", *args], cwd=work,
                            env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-5000:]
    return work / "run"


def _variant(final: Path, folder: Path, edit_args=None, edit_weights=None) -> Path:
    shutil.copytree(final, folder)
    if edit_args is not None:
        args = json.loads((folder / "training_args.json").read_text())
        edit_args(args)
        (folder / "training_args.json").write_text(json.dumps(args))
    if edit_weights is not None:
        edit_weights(folder / "model.safetensors")
    return folder


def _keep_three_tensors(path: Path) -> None:
    weights = load_file(path)
    save_file({k: weights[k] for k in sorted(weights)[:3]}, path, metadata={"format": "pt"})


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval-safety")
    final = _train_with_a_relative_source(root / "work") / "final"
    corpus = str(root / "work" / "corpus")
    models = root / "models"

    def old_run(args):  # as rotarium wrote it before it recorded the held-out documents
        del args["held_out"]
        args["data.source"] = corpus

    _variant(final, models / "no-record", edit_args=old_run)
    _variant(final, models / "absolute", edit_args=lambda a: a.update({"data.source": corpus}))  # as if so trained
    _variant(final, models / "moved", edit_args=lambda a: a["held_out"].update(source=str(root / "gone")))
    _variant(final, models / "missing", edit_weights=_keep_three_tensors)
    _variant(final, models / "truncated", edit_weights=_truncate)
    _variant(final, models / "read-only")
    pickled = _variant(final, models / "pickled")
    (pickled / "model.safetensors").unlink()
    torch.save({"model.embeddings.weight": torch.zeros(2), "payload": CodeInPickle(root / "code-ran")},
               pickled / "pytorch_model.bin")
    (models / "read-only" / "eval").chmod(0o555)
    (root / "a_file").write_text("not a folder\n")
    return root


def _cases_as_trained(root: Path) -> dict[str, list[str]]:
    final, models, out = root / "work" / "run" / "final", root / "models", root / "out"
    corpus = root / "work" / "corpus"
    train = ["train", *cli_args(corpus, train__max_steps=1)]
    text = ["--data", str(corpus), *SHORT]  # the cases about weights and output folders, apart from the split
    return {
        "relative source from another directory": ["eval", "--model", str(final), "--output-dir",
                                                   str(out / "relative"), *SHORT],
        "run without a record": ["eval", "--model", str(models / "no-record"), "--output-dir",
                                 str(out / "no-record"), *SHORT],
        "moved corpus": ["eval", "--model", str(models / "moved"), "--output-dir", str(out / "moved"), *SHORT],
        "eval: missing weights": ["eval", "--model", str(models / "missing"), "--output-dir", str(out / "x"),
                                  *text],
        "generate: missing weights": ["generate", "--model", str(models / "missing"), "--prompt", "The"],
        "train: missing weights": [*train, "--output-dir", str(root / "runs" / "init"), "--init-from",
                                   str(models / "missing")],
        "eval: truncated weights": ["eval", "--model", str(models / "truncated"), "--output-dir", str(out / "x"),
                                    *text],
        "generate: truncated weights": ["generate", "--model", str(models / "truncated"), "--prompt", "The"],
        "eval: pickled code": ["eval", "--model", str(models / "pickled"), "--output-dir", str(out / "x"), *text],
        "generate: pickled code": ["generate", "--model", str(models / "pickled"), "--prompt", "The"],
        "train: pickled code": [*train, "--output-dir", str(root / "runs" / "pickled"), "--init-from",
                                str(models / "pickled")],
        "prompt not UTF-8": ["generate", "--model", str(final), "--prompt", "caf\udce9 cr\udce8me",
                             "--max-new-tokens", "2"],
        "read-only evaluation folder": ["eval", "--model", str(models / "read-only"), *text],
        "output folder that is a file": ["eval", "--model", str(final), "--output-dir", str(root / "a_file"),
                                         *text],
        "output folder inside a file": ["eval", "--model", str(final), "--output-dir",
                                        str(root / "a_file" / "eval"), *text],
    }


@pytest.fixture(scope="module")
def results(root) -> dict[str, tuple[int, str] | None]:
    """Every case, run with the corpus as the run trained on it, then with the corpus grown by two documents."""
    results = run_cli_cases(_cases_as_trained(root), root, skip_if_writable={
        "read-only evaluation folder": root / "models" / "read-only" / "eval"})
    corpus = root / "work" / "corpus"
    with open(corpus / "docs.txt", "a", encoding="utf-8") as f:
        f.write("\n\n\n" + "\n\n\n".join(embedded_documents()[40:42]))
    model, out = root / "models" / "absolute", root / "out"
    results.update(run_cli_cases({
        "grown corpus": ["eval", "--model", str(model), "--output-dir", str(out / "grown"), *SHORT],
        "grown corpus, scored knowingly": ["eval", "--model", str(model), "--data", str(corpus), "--output-dir",
                                           str(out / "knowingly"), *SHORT],
    }, root))
    return results


def test_training_records_the_documents_it_held_out(root):
    corpus = root / "work" / "corpus"
    args = json.loads((root / "work" / "run" / "final" / "training_args.json").read_text())
    assert args["data.source"] == str(corpus)  # a relative source is recorded as its absolute path
    section = DataSection(source=str(corpus), validation_fraction=TINY["data.validation_fraction"])
    held_out = held_out_documents(section, args["train.seed"])
    assert {k: args["held_out"][k] for k in ("source", "documents", "sha256")} == {
        "source": str(corpus), "documents": len(held_out), "sha256": documents_sha256(held_out)}
    assert list(args["held_out"]["identity"]["files"]) == ["docs.txt"]
    assert json.loads((root / "work" / "run" / "training_args.json").read_text())["held_out"] == args["held_out"]


def test_a_relative_source_is_read_where_the_run_trained(root, results):
    code, err = results["relative source from another directory"]
    assert code == 0, err[-3000:]
    assert (root / "out" / "relative" / "perplexity.json").is_file()


def test_eval_refuses_a_corpus_that_changed_since_training(root, results):
    message = error_line(results["grown corpus"], "eval")
    for text in ("is not the source recorded in", "docs.txt has", "may include documents the run trained on",
                 str(root / "models" / "absolute" / "training_args.json"), "--allow-data-change", "--data FILE"):
        assert text in message, f"{text!r} not in {message!r}"
    assert not (root / "out" / "grown").exists()
    code, err = results["grown corpus, scored knowingly"]
    assert code == 0 and (root / "out" / "knowingly" / "perplexity.json").is_file(), err[-3000:]


def test_eval_refuses_a_corpus_no_longer_where_the_run_read_it(root, results):
    message = error_line(results["moved corpus"], "eval")
    for text in ("`data.source=", str(root / "gone"), "no longer there", "--data FILE"):
        assert text in message, f"{text!r} not in {message!r}"


def test_eval_of_a_run_without_a_record_warns_that_it_cannot_verify(root, results):
    code, err = results["run without a record"]
    assert code == 0, err[-3000:]
    assert "no record of the documents the run held out" in err and "cannot be verified" in err
    assert (root / "out" / "no-record" / "perplexity.json").is_file()


@pytest.mark.parametrize("case, command", [("eval: missing weights", "eval"),
                                           ("generate: missing weights", "generate"),
                                           ("train: missing weights", "train")])
def test_a_checkpoint_with_missing_weights_is_never_used(root, results, case, command):
    message = error_line(results[case], command)
    flag = "--init-from" if command == "train" else "--model"
    for text in (f"{flag} {root / 'models' / 'missing'}", "do not match its config.json", "missing (",
                 "model.layers."):
        assert text in message, f"{text!r} not in {message!r}"
    assert not (root / "runs" / "init" / "final").exists()


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_truncated_weights_are_one_error_line_naming_the_file(root, results, command):
    message = error_line(results[f"{command}: truncated weights"], command)
    for text in (str(root / "models" / "truncated" / "model.safetensors"), "truncated or damaged"):
        assert text in message, f"{text!r} not in {message!r}"


@pytest.mark.parametrize("command", ["eval", "generate", "train"])
def test_pickled_code_in_the_weights_is_refused_unread(root, results, command):
    message = error_line(results[f"{command}: pickled code"], command)
    for text in (str(root / "models" / "pickled"), "hold code or Python objects besides tensors", "not loaded"):
        assert text in message, f"{text!r} not in {message!r}"
    assert "weights_only=False" not in results[f"{command}: pickled code"][1]
    assert not (root / "code-ran").exists()


def test_a_prompt_that_is_not_utf8_is_one_error_line(results):
    message = error_line(results["prompt not UTF-8"], "generate")
    assert "--prompt is not UTF-8 text (byte 0xe9 at character 3)" in message
    assert "Loading weights" not in results["prompt not UTF-8"][1]


@pytest.mark.parametrize("case, texts", [
    ("read-only evaluation folder", ["--output-dir", "eval", "not writable"]),
    ("output folder that is a file", ["--output-dir", "a_file", "not a folder"]),
    ("output folder inside a file", ["a_file", "is a file"]),
])
def test_an_output_folder_that_cannot_be_written_stops_eval_before_any_work(results, case, texts):
    if results[case] is None:
        pytest.skip("this process may write into read-only folders")
    message = error_line(results[case], "eval")
    for text in texts:
        assert text in message, f"{text!r} not in {message!r}"
    assert "Loading weights" not in results[case][1] and "eval L=" not in results[case][1]
