"""No file is written through a link (issue: a link planted in a run or model folder made rotarium overwrite the
file it points to). Files written by renaming a new file into place replace a link there; files opened in place (the
run lock, the appended metrics) and the folders rotarium makes in its own folders refuse one."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rotarium.training.lock import RunLock
from rotarium.utils.files import append_text, make_folder, write_json_atomic, write_text_atomic
from rotarium.utils.plots import save_figure
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import cli_args

SECRET = "a file outside the run, which must stay as it is\n"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def _link(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def test_atomic_writes_replace_a_link_and_leave_its_target(tmp_path, outside):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, write in [("a.txt", lambda p: write_text_atomic(p, "new")),
                        ("a.json", lambda p: write_json_atomic(p, {"x": 1})),
                        ("a.png", lambda p: save_figure(plt.subplots()[0], p))]:
        path = tmp_path / name
        _link(path, outside)
        write(path)
        assert not path.is_symlink() and path.stat().st_size > 0, name
        assert outside.read_text() == SECRET, name


def test_appends_and_folders_refuse_a_link(tmp_path, outside):
    log = tmp_path / "metrics.jsonl"
    _link(log, outside)
    with pytest.raises(ValueError, match="symbolic link"):
        append_text(log, "{}\n")
    folder = tmp_path / "eval"
    folder.symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(ValueError, match=f"{folder}.*symbolic link"):
        make_folder(folder)
    assert outside.read_text() == SECRET and sorted(os.listdir(outside.parent)) == ["secret.txt"]


def test_the_run_lock_refuses_a_link(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    _link(run / ".lock", outside)
    with pytest.raises(ValueError, match=r"lock.*symbolic link"):
        RunLock(run)
    assert outside.read_text() == SECRET


def test_train_and_eval_never_write_through_a_planted_link(tmp_path, corpus, outside):
    run = tmp_path / "run"
    base = cli_args(corpus, train__max_steps=2, train__save_every=1, train__eval_every=2)
    first = run_cli_cases({"train": ["train", *base, "--output-dir", str(run)]}, tmp_path)
    assert first["train"][0] == 0, first["train"][1][-3000:]

    _link(run / ".lock", outside)
    results = run_cli_cases({"resume through a linked lock": ["train", "--output-dir", str(run), "--resume"]},
                            tmp_path)
    assert "symbolic link" in error_line(results["resume through a linked lock"], "train")
    assert outside.read_text() == SECRET

    (run / ".lock").unlink()
    _link(run / "loss_curve.png", outside)
    final = run / "final"
    (final / "eval").mkdir(exist_ok=True)
    _link(final / "eval" / "perplexity.png", outside)
    _link(final / "eval" / "perplexity.json", outside)
    linked_eval = tmp_path / "linked_model"
    linked_eval.mkdir()
    for entry in final.iterdir():
        if entry.name != "eval":
            (linked_eval / entry.name).symlink_to(entry)
    (linked_eval / "eval").symlink_to(outside.parent, target_is_directory=True)
    small_eval = ["--context-lengths", "16", "--max-tokens", "64", "--device", "cpu"]
    results = run_cli_cases({
        "resume with a linked loss curve": ["train", "--output-dir", str(run), "--resume", "--train.max_steps", "3"],
        "eval with linked results": ["eval", "--model", str(final), *small_eval],
        "eval into a linked folder": ["eval", "--model", str(linked_eval), "--data", str(corpus), *small_eval],
    }, tmp_path)
    assert results["resume with a linked loss curve"][0] == 0, results["resume with a linked loss curve"][1][-3000:]
    assert results["eval with linked results"][0] == 0, results["eval with linked results"][1][-3000:]
    message = error_line(results["eval into a linked folder"], "eval")
    assert "symbolic link" in message and str(linked_eval / "eval") in message
    assert outside.read_text() == SECRET and sorted(os.listdir(outside.parent)) == ["secret.txt"]
    for written in (run / "loss_curve.png", final / "eval" / "perplexity.png", final / "eval" / "perplexity.json"):
        assert not written.is_symlink() and written.stat().st_size > 0, written
