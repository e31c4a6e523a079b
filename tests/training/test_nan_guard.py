"""Good checkpoints: a checkpoint is marked good only if every loss since the previous good one was finite and below
the spike threshold. The guard names the last good one (not merely the last one), a slow blow-up that finishes
warns, pruning keeps the last good checkpoint, and --resume picks it (or --resume-from the one asked for)."""
from __future__ import annotations

import json
import math

import pytest

from rotarium.cli import main
from rotarium.training.config import load_config
from rotarium.training.guard import LossGuard
from rotarium.training.run_folder import complete_checkpoints, read_trainer_state
from rotarium.training.trainer import Trainer, TrainingDiverged
from tests.training.helpers import TINY, scale_losses


def _config(corpus, **extra):
    return load_config(None, {**TINY, "data.source": str(corpus), **extra})


def _verdicts(run_dir):
    return {p.name: read_trainer_state(p)["good"] for p in complete_checkpoints(run_dir)}


@pytest.mark.slow
def test_a_spike_then_nans_names_the_checkpoint_before_the_spike(corpus, tmp_path, monkeypatch):
    # step 5: a loss a million times too high, yet finite; from step 7 on: NaN
    scale_losses(monkeypatch, lambda n: 1e6 if n == 5 else math.nan if n >= 7 else 1.0)
    config = _config(corpus, **{"train.max_steps": 12, "train.save_every": 3, "train.max_bad_steps": 3})
    trainer = Trainer(config, tmp_path / "run")
    with pytest.warns(RuntimeWarning, match="step 5: loss .* above the spike threshold"), \
            pytest.raises(TrainingDiverged, match="last good checkpoint is .*step-3,") as stop:
        trainer.train()
    trainer.close()
    assert "step-6" not in str(stop.value)
    assert _verdicts(tmp_path / "run") == {"step-3": True, "step-6": False}
    assert "step 5" in read_trainer_state(tmp_path / "run" / "checkpoints" / "step-6")["why_not_good"]


@pytest.mark.slow
def test_a_slow_blow_up_warns_and_resume_goes_back_to_the_last_good_checkpoint(corpus, tmp_path, monkeypatch,
                                                                             caplog):
    scale_losses(monkeypatch, lambda n: 2.0 ** max(0, n - 6))  # doubles every step after step 6, stays finite
    run_dir = tmp_path / "run"
    settings = {"train.max_steps": 14, "train.save_every": 3, "train.spike_window": 3}
    trainer = Trainer(_config(corpus, **settings), run_dir)
    with pytest.warns(RuntimeWarning) as warned:
        result = trainer.train()
    trainer.close()
    assert result.steps == 14 and math.isfinite(result.last_val_loss)
    messages = [str(w.message) for w in warned]
    assert any(m.startswith("step 8: loss") and "spike threshold" in m for m in messages), messages
    assert any("the loss went bad since the last good checkpoint" in m and "step-6" in m for m in messages), messages
    # step-6 is neither of the 2 newest (train.keep_checkpoints) but the last good one: kept
    assert _verdicts(run_dir) == {"step-6": True, "step-9": False, "step-12": False}
    monkeypatch.undo()

    resumed = Trainer(_config(corpus, **settings), run_dir, resume=True)
    resumed.close()
    assert resumed.resume_from.name == "step-6"
    assert "skipped step-12 (not good" in caplog.text and "step-9 (not good" in caplog.text
    code = main(["train", "--output-dir", str(run_dir), "--resume-from", "step-12"])  # the run's own config
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 15))
    assert "--resume-from step-12: not a good checkpoint" in caplog.text


def test_the_guard_flags_non_finite_losses_and_spikes_over_the_lowest_running_median():
    guard = LossGuard(spike_factor=3.0, window=3, vocab_size=1000)
    assert guard.threshold == pytest.approx(3 * math.log(1000))  # before a window is full: a uniform guess
    for step, loss in enumerate([6.0, 5.0, 4.0, 3.0, 2.0], start=1):
        assert guard.observe(step, loss) is None
    assert guard.threshold == pytest.approx(9.0)  # 3 x median(4, 3, 2)
    assert guard.checkpoint_verdict() == {"good": True}
    assert guard.observe(6, 8.9) is None
    assert "spike threshold" in guard.observe(7, 9.5)
    assert "non-finite" in guard.observe(8, math.inf)
    verdict = guard.checkpoint_verdict()
    assert verdict["good"] is False and "2 bad step(s), the first at step 7" in verdict["why_not_good"]
    assert LossGuard(0.0, 3, 1000).observe(1, 1e9) is None  # spike_factor 0: only non-finite losses count
    state = guard.state_dict()
    assert json.loads(json.dumps(state)) == state  # saved with the trainer state


def test_a_checkpoint_after_a_recovered_spike_is_good_again():
    """The verdict covers the steps since the previous checkpoint: one transient spike spoils one checkpoint."""
    guard = LossGuard(spike_factor=3.0, window=3, vocab_size=1000)
    for step, loss in enumerate([4.0, 3.0, 2.0, 2.0], start=1):
        guard.observe(step, loss)
    assert "spike" in guard.observe(5, 50.0)
    assert guard.checkpoint_verdict()["good"] is False
    assert not guard.healthy_since_good  # the run is still marked troubled until a good checkpoint follows
    for step in range(6, 9):
        assert guard.observe(step, 2.0) is None
    assert guard.checkpoint_verdict() == {"good": True}
    assert guard.healthy_since_good
