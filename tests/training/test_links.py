"""No file is written through a link (issue: a link planted in a run or model folder made rotarium overwrite the
file it points to): the run lock refuses one, and `rotarium train` and `rotarium eval` write around a planted link or
stop naming it. The file writers themselves are tested in tests/utils/test_links.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rotarium.training.lock import RunLock
from rotarium.training.run_folder import RunFolder
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import cli_args
from tests.utils.helpers import SECRET, plant_link, secret_file


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    return secret_file(tmp_path)


def test_the_run_lock_refuses_a_link(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    plant_link(run / ".lock", outside)
    with pytest.raises(ValueError, match=r"lock.*symbolic link"):
        RunLock(run)
    assert outside.read_text() == SECRET


@pytest.mark.slow
def test_train_and_eval_never_write_through_a_planted_link(tmp_path, corpus, outside):
    run = tmp_path / "run"
    base = cli_args(corpus, train__max_steps=2, train__save_every=1, train__eval_every=2)
    first = run_cli_cases({"train": ["train", *base, "--output-dir", str(run)]}, tmp_path)
    assert first["train"][0] == 0, first["train"][1][-3000:]

    plant_link(run / ".lock", outside)
    results = run_cli_cases({"resume through a linked lock": ["train", "--output-dir", str(run), "--resume"]},
                            tmp_path)
    assert "symbolic link" in error_line(results["resume through a linked lock"], "train")
    assert outside.read_text() == SECRET

    (run / ".lock").unlink()
    plant_link(run / "loss_curve.png", outside)
    final = run / "final"
    (final / "eval").mkdir(exist_ok=True)
    plant_link(final / "eval" / "perplexity.png", outside)
    plant_link(final / "eval" / "perplexity.json", outside)
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


def test_the_loss_curve_copy_never_goes_through_a_link(tmp_path, outside):
    run = tmp_path / "run"
    (run / "final" / "eval").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    plant_link(run / "final" / "eval" / "loss_curve.png", outside)
    RunFolder(run).write_loss_curve()
    copied = run / "final" / "eval" / "loss_curve.png"
    assert not copied.is_symlink() and copied.read_bytes() == (run / "loss_curve.png").read_bytes()
    assert outside.read_text() == SECRET

    (run / "final" / "eval" / "loss_curve.png").unlink()
    (run / "final" / "eval").rmdir()
    (run / "final" / "eval").symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic link"):
        RunFolder(run).write_loss_curve()
    assert sorted(os.listdir(outside.parent)) == ["secret.txt"] and outside.read_text() == SECRET
