"""The training state, one owner per part (rotarium.training.state): the loop's counters, the loss guard and the data
position each save and load their own state, and trainer_state.json holds them under the keys every rotarium wrote,
so a checkpoint written before the parts had owners resumes with each part where it stood."""
from __future__ import annotations

import copy
import json

import pytest

from rotarium.data.config import DataSection
from rotarium.training.config import load_config
from rotarium.training.guard import LossGuard
from rotarium.training.resume import check_data, recorded_state
from rotarium.training.run_folder import CHECKSUMS, TRAINER_STATE, read_trainer_state
from rotarium.training.state import DataPosition, LoopCounters, TrainerState
from rotarium.training.trainer import Trainer
from rotarium.utils.files import file_sha256, write_json_atomic
from tests.training.helpers import TINY

# trainer_state.json of step-2 of a 4-step TINY run (train.spike_window 2) as the code before the state had one
# owner per part wrote it, with skipped_steps and the sequences consumed changed so that a resume shows it read them
TODAYS_STATE = {
    "step": 2, "tokens": 256, "bad_steps_in_a_row": 0, "skipped_steps": 1,
    "guard": {"recent": [5.758091926574707, 5.741464614868164], "reference": 5.7497782707214355,
              "bad_since_good": 0, "first_bad_since_good": None, "bad_since_checkpoint": 0},
    "data": {"epoch": 0, "sequences": 12, "sequences_per_epoch": 954, "seed": 0, "prepared": None,
             "tokenizer": None},
    "good": True,
}


class _Loader:
    """A loader that records what it was restored to."""

    def __init__(self):
        self.restored = None

    def position(self, step: int) -> dict:
        return {"sequences": 4 * step, "processes": ["mine"]}

    def restore(self, step: int, position: dict) -> None:
        self.restored = (step, position)


def _parts():
    counters, loader = LoopCounters(), _Loader()
    guard = LossGuard(3.0, 2, 320)
    state = TrainerState(counters, {"guard": guard, "data": DataPosition(loader, counters, lambda xs: xs * 2)})
    return state, counters, guard, loader


def test_each_part_loads_its_own_keys_and_saves_them_back_under_the_same_names():
    state, counters, guard, loader = _parts()
    state.load_state_dict(copy.deepcopy(TODAYS_STATE))
    assert counters == LoopCounters(step=2, tokens=256, bad_steps_in_a_row=0, skipped_steps=1)
    assert guard.state_dict() == TODAYS_STATE["guard"]
    assert loader.restored == (2, TODAYS_STATE["data"])  # restored at the step the counters hold
    saved = state.state_dict()
    assert list(saved) == ["step", "tokens", "bad_steps_in_a_row", "skipped_steps", "guard", "data"]
    assert saved["data"] == {"sequences": 8, "processes": ["mine", "mine"]}  # every process's, gathered
    guard.observe(3, 5.0)
    assert saved["guard"] == TODAYS_STATE["guard"]  # a copy: the guard goes on without changing what was saved


def test_a_state_without_a_part_leaves_it_fresh_and_the_data_at_the_step():
    state, counters, guard, loader = _parts()
    state.load_state_dict({"step": 4, "tokens": 512, "bad_steps_in_a_row": 0, "skipped_steps": 0})
    assert counters.step == 4 and guard.state_dict() == LossGuard(3.0, 2, 320).state_dict()
    assert loader.restored == (4, {})


def test_the_resume_checks_read_a_checkpoint_through_its_parts(tmp_path):
    """``--resume``'s checks read the step and the data position through the parts a run loads (the counters, the
    data position as saved), not the file's keys: a checkpoint an earlier rotarium wrote reads the same."""
    checkpoint = tmp_path / "step-2"
    checkpoint.mkdir()
    identified = {**TODAYS_STATE["data"], "prepared": "a" * 64, "tokenizer": "b" * 64}
    write_json_atomic(checkpoint / TRAINER_STATE, {**TODAYS_STATE, "data": identified})
    state = recorded_state(checkpoint)
    assert state.counters == LoopCounters(step=2, tokens=256, bad_steps_in_a_row=0, skipped_steps=1)
    assert state.parts["data"].state_dict()["prepared"] == "a" * 64
    with pytest.raises(ValueError, match=r"its content differs \(fingerprint aaaaaaaaaaaa -> cccccccccccc\)"):
        check_data(checkpoint, DataSection(source="folder"), {"prepared": "c" * 64, "tokenizer": "b" * 64}, set())
    write_json_atomic(checkpoint / TRAINER_STATE, {key: TODAYS_STATE[key] for key in ("step", "tokens")})
    state = recorded_state(checkpoint)  # written before the parts were saved: what is missing reads empty
    assert state.counters == LoopCounters(step=2, tokens=256) and state.parts["data"].state_dict() == {}
    assert check_data(checkpoint, DataSection(source="folder"), {"prepared": "c" * 64, "tokenizer": "b" * 64},
                      set()) is False  # no identity recorded: nothing to compare (with a warning)


@pytest.mark.slow
def test_a_checkpoint_written_in_the_format_before_resumes_with_every_part(corpus, tmp_path):
    config = load_config(None, {**TINY, "data.source": str(corpus), "train.max_steps": 4, "train.save_every": 2,
                                "train.eval_every": 4, "train.spike_window": 2})
    run_dir = tmp_path / "run"
    trainer = Trainer(config, run_dir)
    trainer.train()
    trainer.close()
    checkpoint = run_dir / "checkpoints" / "step-2"
    write_json_atomic(checkpoint / TRAINER_STATE, TODAYS_STATE)
    checksums = json.loads((checkpoint / CHECKSUMS).read_text())
    checksums["files"][TRAINER_STATE] = {"bytes": (checkpoint / TRAINER_STATE).stat().st_size,
                                         "sha256": file_sha256(checkpoint / TRAINER_STATE)}
    write_json_atomic(checkpoint / CHECKSUMS, checksums)

    resumed = Trainer(config, run_dir, resume_from="step-2", allow_rewind=True)
    try:
        assert resumed.start_step == 2
        assert resumed.counters == LoopCounters(step=2, tokens=256, bad_steps_in_a_row=0, skipped_steps=1)
        assert resumed.guard.state_dict() == TODAYS_STATE["guard"]
        assert resumed.data.train.position(2)["sequences"] == 12  # the recorded count, not 2 steps x 4 sequences
        saved = resumed.checkpoint_state.state_dict()
        assert saved == {key: value for key, value in TODAYS_STATE.items() if key != "good"}
        result = resumed.train()
    finally:
        resumed.close()
    assert result.steps == 4 and result.skipped_steps == 1
    written = read_trainer_state(run_dir / "checkpoints" / "step-2")
    assert TODAYS_STATE.keys() <= written.keys()
