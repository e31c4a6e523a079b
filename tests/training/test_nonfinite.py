"""A non-finite loss skips the step; too many in a row stop the run with the last good checkpoint named."""
import math

import pytest
import torch

from rotarium.training.config import load_config
from rotarium.training.run_folder import latest_checkpoint
from rotarium.training.trainer import Trainer, TrainingDiverged
from tests.training.helpers import TINY, scale_losses

pytestmark = pytest.mark.slow


def _config(corpus, **extra):
    return load_config(None, {**TINY, "data.source": str(corpus), **extra})


def test_a_nan_step_is_skipped(corpus, tmp_path, monkeypatch):
    scale_losses(monkeypatch, lambda n: float("nan") if n in (3, 4) else 1.0)
    trainer = Trainer(_config(corpus, **{"train.max_steps": 6}), tmp_path / "run")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        result = trainer.train()
    assert result.skipped_steps == 2 and result.steps == 6
    assert math.isfinite(result.last_val_loss)
    for p in trainer.accelerator.unwrap_model(trainer.model).parameters():
        assert torch.isfinite(p).all()


def test_too_many_bad_steps_stop_with_the_last_checkpoint(corpus, tmp_path, monkeypatch):
    scale_losses(monkeypatch, lambda n: float("nan") if n >= 5 else 1.0)
    config = _config(corpus, **{"train.max_steps": 12, "train.save_every": 3, "train.max_bad_steps": 4})
    trainer = Trainer(config, tmp_path / "run")
    with pytest.warns(RuntimeWarning), pytest.raises(TrainingDiverged, match="step-3"):
        trainer.train()
    assert latest_checkpoint(tmp_path / "run").name == "step-3"  # steps 4.. were bad: no checkpoint saved after
    assert not (tmp_path / "run" / "final").exists()
