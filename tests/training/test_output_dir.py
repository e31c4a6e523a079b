"""A run writes only into a new or empty folder, a folder holding a run (of its own, or with --overwrite another),
never into a folder of something else: a prepared folder given as --output-dir (an easy mix-up with data.source),
or a user's folder with a tokenizer/ of their own, is refused in one line before anything in it is touched."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rotarium.cli import main
from tests.training.helpers import cli_args


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def _prepared_like(folder: Path) -> Path:
    """What `rotarium prepare` leaves: metadata, a tokenizer and the splits' shards."""
    for name, data in {"metadata.json": json.dumps({"complete": True}), "tokenizer/tokenizer.json": "{}",
                       "tokenizer/tokenizer_config.json": "{}", "train/00000.tokens.npy": "x",
                       "validation/00000.tokens.npy": "y"}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(data)
    return folder


def _users_folder(folder: Path) -> Path:
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "tokenizer" / "my_notes.json").write_text('{"mine": true}')
    return folder


@pytest.mark.parametrize("make", [_prepared_like, _users_folder], ids=["prepared folder", "user's folder"])
@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume"]], ids=["new run", "overwrite", "resume"])
def test_a_folder_that_is_not_a_run_is_refused_untouched(make, flags, corpus, tmp_path, capsys):
    folder = make(tmp_path / "mydocs")
    before = _tree(folder)
    code = main(["train", "--output-dir", str(folder), *flags, *cli_args(corpus, train__max_steps=1)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err[-5:]
    assert len(err) == 1 and err[0].startswith(f"rotarium train: error: --output-dir {folder} "), err
    assert "not a run" in err[0] and "empty" in err[0], err[0]
    assert _tree(folder) == before  # not even a lock file


def test_an_empty_folder_or_a_new_one_takes_a_run(corpus, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "new" / "run"):
        assert main(["train", "--output-dir", str(folder), *cli_args(corpus, train__max_steps=1)]) == 0
        assert (folder / "final" / "model.safetensors").is_file()


def test_what_a_run_killed_during_its_set_up_leaves_is_no_obstacle(tmp_path):
    from rotarium.training.lock import LOCK
    from rotarium.training.run_folder import REPLACING, check_output_folder

    folder = tmp_path / "run"
    (folder / REPLACING / "tokenizer").mkdir(parents=True)
    (folder / LOCK).write_text("{}")
    check_output_folder(folder)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not a run folder and not empty: it holds notes.txt; "):
        check_output_folder(folder)
    (folder / "training_args.json").write_text("{}")  # a run's folder, with the user's notes beside it
    check_output_folder(folder)
