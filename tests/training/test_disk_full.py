"""A full disk while a checkpoint is written stops the run with one line naming that checkpoint: the checkpoints
before it stay whole (and verified), and the half-written one is cleared away."""
from __future__ import annotations

import errno

import pytest

from rotarium.cli import main
from rotarium.training import trainer as trainer_module
from rotarium.training.run_folder import complete_checkpoints, verify_checkpoint
from tests.training.helpers import cli_args

FULL = {"torch": RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                              "data/3: file write failed"),
        "os": OSError(errno.ENOSPC, "No space left on device")}


@pytest.mark.parametrize("kind", sorted(FULL))
def test_a_full_disk_during_a_checkpoint_is_one_line_and_loses_nothing(kind, corpus, tmp_path, monkeypatch, capsys):
    original = trainer_module.Trainer._save_model

    def save_model(self, folder):
        if folder.name == ".step-4.tmp":
            (folder / "model.safetensors").write_bytes(b"half")
            raise FULL[kind]
        return original(self, folder)

    monkeypatch.setattr(trainer_module.Trainer, "_save_model", save_model)
    run_dir = tmp_path / "run"
    code = main(["train", "--output-dir", str(run_dir), *cli_args(corpus, train__max_steps=6, train__save_every=2,
                                                                   train__eval_every=6)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err[-10:]
    assert err[-1].startswith("rotarium train: error: ") and "Traceback" not in "\n".join(err), err[-10:]
    assert f"{run_dir / 'checkpoints' / 'step-4'}" in err[-1] and "no space left" in err[-1], err[-1]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-2"]
    assert verify_checkpoint(run_dir / "checkpoints" / "step-2")
    assert not (run_dir / "checkpoints" / ".step-4.tmp").exists()
