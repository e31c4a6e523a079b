"""`rotarium train` with bad input stops before training: return code 2, one clear line on stderr naming the
problem (no traceback), and nothing of a run (no checkpoints/, no metrics) in --output-dir."""
from pathlib import Path

import pytest

from rotarium.cli import main


def _files(folder: Path) -> dict[str, Path]:
    (folder / "empty.txt").write_text("")
    (folder / "empty.jsonl").write_text("")
    (folder / "blank.jsonl").write_text("\n")
    (folder / "tiny.txt").write_text("The first short document.\n\n\nThe second one.\n")
    return {p.name: p for p in folder.iterdir()}


CASES = {
    "missing file": (["--data.source", "/nonexistent/file.txt"], ["/nonexistent/file.txt", "no such file"]),
    "empty txt": (["--data.source", "{empty.txt}"], ["0 document"]),
    "empty jsonl": (["--data.source", "{empty.jsonl}"], ["empty.jsonl", "is empty"]),
    "blank jsonl": (["--data.source", "{blank.jsonl}"], ["blank.jsonl", "is empty"]),
    "text too short": (["--data.source", "{tiny.txt}", "--data.seq_len", "512"], ["too short", "data.seq_len=512"]),
    "unknown preset": (["--model.preset", "gla-7b"], ["unknown preset", "gla-7b", "gla-370m"]),
    "unknown key": (["--optim.lrr", "1"], ["unknown config key", "optim.lrr", "lr"]),
    "key too deep": (["--optim.lr.warmup", "1"], ["unknown config key", "`optim.lr` takes one value",
                                                  "model.options.NAME"]),
    "wrong type": (["--train.max_steps", "many"], ["train.max_steps", "int", "'many'"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_stops_before_training(case, tmp_path, capsys):
    files = _files(tmp_path)
    overrides, expected = CASES[case]
    overrides = [str(files[arg[1:-1]]) if arg.startswith("{") else arg for arg in overrides]
    run_dir = tmp_path / "run"
    code = main(["train", "--output-dir", str(run_dir), "--eval.run_after", "false", "--tokenizer.vocab_size", "320",
                 *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    message = err.strip().splitlines()[-1]  # after any progress bar of datasets
    assert message.startswith("rotarium train: error: "), err
    assert "Traceback" not in err, err
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "final").exists()
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_tracker_that_is_not_installed_stops_before_training(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code = main(["train", "--output-dir", str(tmp_path / "run"), "--train.report_to", "[wandb]"])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "train.report_to" in message and "pip install wandb" in message
    assert main(["train", "--output-dir", str(tmp_path / "run"), "--train.report_to", "[tensorbored]"]) == 2
    assert "accelerate's trackers" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
