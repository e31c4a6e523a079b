"""A run from a prepared folder checks its shards against their recorded SHA-256 in a background thread (issue 42,
unsafe 4): a shard damaged in place (same size) stops the run at the next step, before anything of it is saved,
without delaying the first steps; `--data.skip_verify` trains without the check."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from rotarium.cli import main
from rotarium.data.documents import embedded_documents
from rotarium.data.prepared import PreparedCorpus, prepare
from tests.training.helpers import cli_args

RUN = {"train__max_steps": 4, "train__save_every": 1, "train__eval_every": 4}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("verify")
    (work / "docs.txt").write_text("\n\n\n".join(embedded_documents()[:40]))
    out = work / "prepared"
    prepare(str(work / "docs.txt"), out, vocab_size=320, validation_fraction=0.2, num_proc=1, progress=False)
    return out


def _damaged(folder: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``folder`` whose first training shard has its last tokens zeroed in place (the size unchanged)."""
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    shard = copy / "train" / "00000.tokens.npy"
    tokens = np.load(shard, mmap_mode="r+")
    tokens[-16:] = 0
    tokens.flush()
    del tokens
    return copy, shard


def test_a_shard_damaged_in_place_stops_the_run(folder, tmp_path, capsys):
    copy, shard = _damaged(folder, tmp_path)
    run_dir = tmp_path / "run"
    code = main(["train", "--output-dir", str(run_dir), *cli_args(copy, **RUN)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err[-10:]
    assert err[-1].startswith(f"rotarium train: error: {shard} changed since it was prepared"), err[-1]
    assert "training stopped after step" in err[-1] and "data.skip_verify" in err[-1]
    assert not (run_dir / "final").exists()
    # knowingly: the check is skipped
    code = main(["train", "--output-dir", str(tmp_path / "skipped"), *cli_args(copy, **RUN),
                 "--data.skip-verify", "true"])
    assert code == 0 and (tmp_path / "skipped" / "final" / "model.safetensors").is_file()


def test_the_check_runs_beside_the_first_steps_and_no_checkpoint_follows_a_failure(folder, tmp_path, monkeypatch,
                                                                                   capsys):
    run_dir = tmp_path / "run"

    def slow_verify(self, splits=("train", "validation")):
        while not (run_dir / "checkpoints" / "step-2").is_dir():  # the run trains and saves meanwhile
            time.sleep(0.01)
        raise ValueError(f"{self.path}/train/00000.tokens.npy changed since it was prepared")

    monkeypatch.setattr(PreparedCorpus, "verify", slow_verify)
    code = main(["train", "--output-dir", str(run_dir), *cli_args(folder, **{**RUN, "train__max_steps": 40})])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "changed since it was prepared" in err[-1], err[-10:]
    stopped = int(err[-1].split("training stopped after step ")[1].split(",")[0])
    saved = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved[-1] < stopped and {1, 2} <= set(saved), (saved, stopped)
    assert not (run_dir / "final").exists()
