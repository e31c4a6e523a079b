"""A resume or an evaluation never derives the held-out documents from a source that changed since the run trained
on it (issue 42, unsafe 2): the run records its source's identity (files, sizes, content hashes) and a local
`data.source` as an absolute path; a changed source is refused naming what changed, `--allow-data-change` goes on
with a warning (and the run records the step), and a run recorded before identities resumes with a note."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rotarium.cli import main
from rotarium.data.documents import embedded_documents
from tests.training.helpers import cli_args

DOCS = embedded_documents()[:40]
SHORT = {"train__max_steps": 2, "train__save_every": 1, "train__eval_every": 2}


def _jsonl(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


def _train(run_dir: Path, source: Path | str, *extra: str) -> None:
    assert main(["train", "--output-dir", str(run_dir), *cli_args(source, **SHORT), *extra]) == 0


def _resume(run_dir: Path, *extra: str) -> int:
    return main(["train", "--output-dir", str(run_dir), "--resume", "--max-steps", "3", *extra])


def _error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and "Traceback" not in "\n".join(lines), lines[-10:]
    return lines[-1]


def test_appended_documents_are_refused_on_resume_and_allowed_knowingly(tmp_path, capsys, caplog):
    corpus = _jsonl(tmp_path / "docs.jsonl", DOCS)
    run_dir = tmp_path / "run"
    _train(run_dir, corpus)
    recorded = corpus.stat().st_size
    with open(corpus, "a") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in embedded_documents()[40:44]))
    capsys.readouterr()
    assert _resume(run_dir) == 2
    message = _error(capsys)
    assert message.startswith(f"rotarium train: error: --resume: `data.source={corpus}` is not the source recorded "
                              f"in {run_dir / 'checkpoints' / 'step-1' / 'training_args.json'}: docs.jsonl has "
                              f"{corpus.stat().st_size} bytes, {recorded} bytes were recorded; "), message
    assert "--allow-data-change" in message
    assert json.loads((run_dir / "training_args.json").read_text())["train.max_steps"] == 2  # nothing rewritten
    # knowingly: it goes on, says the held-out documents may overlap, and the run records the step
    assert _resume(run_dir, "--allow-data-change") == 0
    assert "--allow-data-change allows: the held-out documents may now include documents" in caplog.text
    record = json.loads((run_dir / "final" / "training_args.json").read_text())["held_out"]
    assert record["changed_at_steps"] == [1]
    # which `rotarium eval` repeats
    caplog.clear()
    assert main(["eval", "--model", str(run_dir / "final"), "--context-lengths", "16", "--max-tokens", "64"]) == 0
    assert "went on with a changed `data.source` at step 1" in caplog.text


def test_eval_refuses_a_changed_source_naming_the_file_and_allows_it_knowingly(tmp_path, capsys, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _jsonl(corpus / "a.jsonl", DOCS[:20])
    _jsonl(corpus / "b.jsonl", DOCS[20:])
    run_dir = tmp_path / "run"
    _train(run_dir, corpus)
    _jsonl(corpus / "b.jsonl", DOCS[20:][::-1])  # the same size, another order
    capsys.readouterr()
    eval_args = ["eval", "--model", str(run_dir / "final"), "--context-lengths", "16", "--max-tokens", "64"]
    assert main(eval_args) == 2
    message = _error(capsys)
    assert "b.jsonl has other content of the same size" in message and "--allow-data-change" in message, message
    assert main([*eval_args, "--allow-data-change"]) == 0
    assert "the held-out documents may now include documents the run trained on" in caplog.text


def test_a_relative_source_is_recorded_and_resumed_as_its_absolute_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    _jsonl(tmp_path / "here" / "docs.jsonl", DOCS)
    _jsonl(tmp_path / "elsewhere" / "docs.jsonl", embedded_documents()[40:80])  # another file of that name
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path / "here")
    _train(run_dir, "docs.jsonl")
    args = json.loads((run_dir / "training_args.json").read_text())
    assert args["data.source"] == str(tmp_path / "here" / "docs.jsonl")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert _resume(run_dir) == 0, capsys.readouterr().err[-3000:]
    assert json.loads((run_dir / "training_args.json").read_text())["held_out"] == args["held_out"]


def test_a_run_recorded_before_identities_resumes_with_a_note(tmp_path, caplog):
    corpus = _jsonl(tmp_path / "docs.jsonl", DOCS)
    run_dir = tmp_path / "run"
    _train(run_dir, corpus)
    for path in (run_dir / "training_args.json", run_dir / "checkpoints" / "step-1" / "training_args.json"):
        args = json.loads(path.read_text())
        del args["held_out"]["identity"]
        path.write_text(json.dumps(args))
    # the checkpoint's checksums cover its training_args.json: as an older rotarium wrote it, without them
    (run_dir / "checkpoints" / "step-1" / "checksums.json").unlink()
    assert _resume(run_dir) == 0
    assert "records no identity of `data.source=" in caplog.text and "cannot be checked" in caplog.text


@pytest.mark.parametrize("allow", [False, True])
def test_a_prepared_folder_made_again_needs_allow_data_change(allow, tmp_path, capsys):
    from rotarium.data.prepared import prepare

    corpus = _jsonl(tmp_path / "docs.jsonl", DOCS)
    folder = tmp_path / "prepared"
    prepare(str(corpus), folder, vocab_size=320, validation_fraction=0.2, num_proc=1, progress=False)
    run_dir = tmp_path / "run"
    _train(run_dir, folder)
    _jsonl(corpus, DOCS + embedded_documents()[40:42])
    import shutil

    shutil.rmtree(folder)
    prepare(str(corpus), folder, tokenizer=str(run_dir / "tokenizer"), validation_fraction=0.2, num_proc=1,
            progress=False)
    capsys.readouterr()
    code = _resume(run_dir, *(["--allow-data-change"] if allow else []))
    if allow:
        assert code == 0
    else:
        assert code == 2
        message = _error(capsys)
        assert "its content differs (fingerprint" in message and "--allow-data-change" in message, message
