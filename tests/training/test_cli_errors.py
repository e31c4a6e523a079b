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


def test_a_recipe_without_its_prepared_folder_names_the_prepare_to_run(tmp_path, capsys, monkeypatch):
    """A recipe loads anywhere (its folder is only read to train); training without the folder stops at once with
    the `rotarium prepare` command that writes it (the recipe's data.prepare)."""
    monkeypatch.chdir(tmp_path)  # where the recipe's relative data/ folder is not
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "gla-370m-rope", "--output-dir", str(run_dir), "--train.report_to", "[]",
                 "--train.mixed_precision", "no"])  # another test of this process set up accelerate already
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "`data.source=data/fineweb-edu-10bt-llama2` is not there" in message, message
    assert ("`rotarium prepare HuggingFaceFW/fineweb-edu data/fineweb-edu-10bt-llama2 --config sample-10BT --streaming "
            "--tokenizer fla-hub/transformer-1.3B-100B --validation-documents 2000`") in message
    assert not run_dir.exists()


def test_a_recipe_names_its_missing_folder_before_its_missing_tracker(tmp_path, capsys, monkeypatch):
    """On a fresh machine a recipe lacks both its prepared folder and tensorboard: the folder comes first, as the
    step that takes hours."""
    from rotarium.training import trainer

    monkeypatch.setitem(trainer.TRACKER_PACKAGES, "tensorboard", "a_tracker_package_that_is_not_installed")
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--config", "gla-370m-rope", "--output-dir", str(tmp_path / "run"),
                 "--train.mixed_precision", "no"])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "`data.source=data/fineweb-edu-10bt-llama2` is not there" in message, message


def test_data_prepare_names_only_its_own_folder(tmp_path, monkeypatch):
    """A recipe whose data.source is changed keeps its data.prepare, which then describes another folder: it stops
    nothing (the new source is read, or refused, as any source)."""
    from rotarium.training.build import open_prepared
    from rotarium.training.config import load_config

    monkeypatch.chdir(tmp_path)
    assert open_prepared(load_config("gla-370m-rope", {"data.source": "embedded"})) is None
    with pytest.raises(ValueError, match="fineweb-edu-10bt-llama2/` is not there"):
        open_prepared(load_config("gla-370m-rope", {"data.source": "./data/fineweb-edu-10bt-llama2/"}))
