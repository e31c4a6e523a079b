"""`--overwrite` never loses the old run before the new one is real: a new run that fails on its config, data or
model leaves the old one untouched; once built, the new run moves the old one into `previous/`, deletes it after its
own first checkpoint, and puts it back if it stops with an error before that; a kill in between leaves it whole in
`previous/`."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from rotarium.cli import main
from rotarium.training import trainer as trainer_module
from rotarium.training.run_folder import PREVIOUS, REPLACING
from tests.training.helpers import cli_args, ok, run_child


def _old_run(run_dir: Path) -> dict[str, bytes]:
    """A stand-in for a finished run (what `--overwrite` looks for, with recognisable contents); returns its files."""
    files = {"checkpoints/step-6/COMPLETE": b"6\n", "checkpoints/step-6/state/model.safetensors": b"old weights",
             "final/model.safetensors": b"old final", "final/eval/perplexity.json": b"{}",
             "tokenizer/tokenizer.json": b"old tokenizer", "metrics.jsonl": b'{"step": 1, "loss": 5.0}\n',
             "training_args.json": b"{}", "loss_curve.png": b"png", "notes.txt": b"the user's own file"}
    for name, data in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    return files


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("bad", [pytest.param("typo", marks=pytest.mark.slow), "binary", "model"])
def test_overwrite_with_bad_data_or_model_leaves_the_old_run_untouched(bad, corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    old = _old_run(run_dir)
    args = ["train", "--output-dir", str(run_dir), "--overwrite", *cli_args(corpus)]
    if bad == "typo":  # the whole command in a child process
        result = run_child([*args, "--data.source", str(tmp_path / "docs.txtt")])
        code, err = result.returncode, result.stderr
    elif bad == "binary":
        (tmp_path / "corpus.bin").write_bytes(bytes(range(256)) * 64)
        code, err = main([*args, "--data.source", str(tmp_path / "corpus.bin")]), capsys.readouterr().err
    else:  # found only when the model is built, after the new tokenizer is trained
        code, err = main([*args, "--model.num_heads", "3"]), capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("rotarium train: error: "), err[-3000:]
    assert _files(run_dir) == old


@pytest.mark.slow
def test_a_kill_before_the_first_checkpoint_leaves_the_old_run_whole_in_previous(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    old = _old_run(run_dir)
    killed = run_child(["train", "--output-dir", str(run_dir), "--overwrite",
                        *cli_args(corpus, train__max_steps=4, train__save_every=2, train__eval_every=4)],
                       kill_in_save=1)  # killed while writing its first checkpoint
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    kept = _files(run_dir / PREVIOUS)
    assert kept == {name: data for name, data in old.items() if name != "notes.txt"}
    assert (run_dir / "notes.txt").read_bytes() == old["notes.txt"]
    assert not (run_dir / "checkpoints" / "step-2").exists()
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() != old["tokenizer/tokenizer.json"]
    # A second --overwrite while previous/ holds a run and the folder holds another would have to drop one: refused.
    (run_dir / "final").mkdir()
    assert main(["train", "--output-dir", str(run_dir), "--overwrite", *cli_args(corpus)]) == 2
    assert "holds a run an earlier --overwrite set aside" in capsys.readouterr().err
    assert _files(run_dir / PREVIOUS) == kept


@pytest.mark.slow
def test_overwrite_drops_the_old_run_after_the_first_checkpoint(corpus, tmp_path):
    run_dir = tmp_path / "run"
    old = _old_run(run_dir)
    ok(run_child(["train", "--output-dir", str(run_dir), "--overwrite",
                  *cli_args(corpus, train__max_steps=4, train__save_every=2, train__eval_every=4)]))
    assert not (run_dir / PREVIOUS).exists() and not (run_dir / REPLACING).exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]
    assert (run_dir / "final" / "model.safetensors").read_bytes() != old["final/model.safetensors"]
    assert (run_dir / "notes.txt").read_bytes() == old["notes.txt"]  # not the run's: never touched


def test_an_error_before_the_first_checkpoint_puts_the_old_run_back(corpus, tmp_path, monkeypatch, caplog):
    run_dir = tmp_path / "run"
    old = _old_run(run_dir)

    def broken(self, step):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward", broken)
    args = cli_args(corpus, train__max_steps=4, train__save_every=2, train__eval_every=4)
    with pytest.raises(RuntimeError, match="out of memory"):
        main(["train", "--output-dir", str(run_dir), "--overwrite", *args])
    assert _files(run_dir) == old
    assert "the previous run is back" in caplog.text
