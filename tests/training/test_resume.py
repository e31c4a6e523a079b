"""What --resume trusts. The config: a setting of the model, tokenizer or data that differs from the run's stops the
resume with the differing keys listed (exit 2, before any weights are loaded, so a shape change never reaches
load_state_dict), unless it is one that may change (max_steps, intervals) or is allowed with --allow-config-change;
without --config, --resume takes the run's own settings. The checkpoint: every file's size and SHA-256 are recorded
when it is written and checked on resume; a damaged newest checkpoint is skipped with a warning naming it."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from rotarium.cli import main
from rotarium.training.run_folder import CHECKSUMS, TRAINING_ARGS, choose_checkpoint, complete_checkpoints
from tests.training.helpers import cli_args, losses, ok, run_child

# one worker runs the module, so its finished run is trained once (a module fixture is made per worker)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]

SHORT = {"train__max_steps": 6, "train__save_every": 2, "train__eval_every": 6}


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> Path:
    """A 6-step run with checkpoints step-2 and step-4 (copy it before changing it)."""
    run_dir = tmp_path_factory.mktemp("runs") / "finished"
    ok(run_child(["train", "--output-dir", str(run_dir), *cli_args(corpus, **SHORT)]))
    return run_dir


@pytest.fixture
def run(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run"))


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------------- config
def test_resume_with_changed_settings_is_refused_with_the_keys(run, corpus):
    before = {name: (run / name).read_bytes() for name in (TRAINING_ARGS, "metrics.jsonl")}
    result = run_child(["train", "--output-dir", str(run), *cli_args(corpus, **SHORT), "--resume",
                        "--model.options.norm_eps", "0.5", "--data.seq_len", "16"])
    assert result.returncode == 2, result.stderr[-3000:]
    message = _last_line(result.stderr)
    assert message.startswith("rotarium train: error: --resume: the config differs"), message
    assert "data.seq_len 32 -> 16" in message and "model.options.norm_eps (unset) -> 0.5" in message, message
    assert "Traceback" not in result.stderr
    assert {name: (run / name).read_bytes() for name in before} == before  # training_args.json not overwritten


@pytest.mark.parametrize("change, expected", [
    (["--model.hidden_size", "64"], "model.hidden_size 32 -> 64"),  # a shape change: caught before load_state_dict
    (["--tokenizer.vocab_size", "400"], "tokenizer.vocab_size 320 -> 400"),
    (["--optim.lr", "1e-3"], "--allow-config-change KEY"),
    (["--model.hidden_size", "64", "--allow-config-change", "model.hidden_size"], "cannot change within a run"),
    (["--allow-config-change", "optim.lrr"], "optim.lrr: not a config key"),
])
def test_what_resume_refuses(run, change, expected, capsys):
    code = main(["train", "--output-dir", str(run), "--resume", *change])
    err = capsys.readouterr().err
    assert code == 2 and expected in _last_line(err), err[-3000:]
    assert "Traceback" not in err


def test_what_resume_lets_change(run, capsys, caplog):
    # --max-steps: free (the changed schedule is pointed out); optim.lr: allowed explicitly
    code = main(["train", "--output-dir", str(run), "--resume", "--max-steps", "8", "--optim.lr", "5e-3",
                 "--allow-config-change", "optim.lr"])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert sorted(losses(run)) == list(range(1, 9))
    args = json.loads((run / TRAINING_ARGS).read_text())
    assert args["train.max_steps"] == 8 and args["optim.lr"] == 5e-3 and args["model.hidden_size"] == 32
    assert "optim.lr changes from 0.01 to 0.005" in caplog.text and "learning-rate schedule" in caplog.text


# ---------------------------------------------------------------------------------------------------- checksums
@pytest.mark.parametrize("damaged", ["state/model.safetensors", "state/optimizer.bin", "model.safetensors"])
def test_a_truncated_file_of_the_newest_checkpoint_is_detected_and_skipped(run, damaged, caplog):
    assert [p.name for p in complete_checkpoints(run)] == ["step-2", "step-4"]
    path = run / "checkpoints" / "step-4" / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint(run).name == "step-2"
    assert f"skipped step-4 (corrupt: step-4/{damaged} has" in caplog.text
    with pytest.raises(ValueError, match=f"--resume-from step-4: step-4/{damaged} has"):
        choose_checkpoint(run, "step-4")


def test_resume_falls_back_from_a_corrupt_checkpoint(run, finished, corpus):
    optimizer = run / "checkpoints" / "step-4" / "state" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    result = run_child(["train", "--output-dir", str(run), *cli_args(corpus, **SHORT), "--resume"])
    ok(result)
    assert "skipped step-4 (corrupt: step-4/state/optimizer.bin has 100 bytes" in result.stderr
    mine, reference = losses(run), losses(finished)
    assert sorted(mine) == sorted(reference)
    for step in (3, 4, 5, 6):  # retrained from step-2: the same losses as the uninterrupted run
        assert abs(mine[step] - reference[step]) <= 1e-5, (step, mine[step], reference[step])


def test_a_flipped_byte_is_caught_by_the_hash_and_a_checkpoint_without_checksums_loads_unverified(run, caplog):
    weights = run / "checkpoints" / "step-4" / "state" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    (run / "checkpoints" / "step-2" / CHECKSUMS).unlink()  # as rotarium wrote checkpoints before
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint(run).name == "step-2"
    assert "state/model.safetensors does not match the SHA-256" in caplog.text
    assert "step-2 has no checksums (written by an older rotarium); loading it unverified" in caplog.text
    recorded = json.loads((run / "checkpoints" / "step-4" / CHECKSUMS).read_text())
    assert recorded["algorithm"] == "sha256"
    assert {"state/optimizer.bin", "model.safetensors", "trainer_state.json"} <= set(recorded["files"])


def test_compiling_or_not_is_free_on_resume():
    """train.compile changes how fast the blocks run, not what they compute: a run resumes with it switched."""
    from rotarium.training.resume import _policy

    assert _policy("train.compile") == "safe"
    assert _policy("train.lr") == "allowable" and _policy("model.hidden_size") == "fixed"


def test_skipping_the_shard_check_is_free_on_resume():
    """data.skip_verify decides whether the prepared folder's hashes are checked, not what the run reads: a long
    run resumes on a folder known good without rehashing it, with no --allow-config-change."""
    from rotarium.training.resume import _policy

    assert _policy("data.skip_verify") == "safe"
    assert _policy("data.source") == "allowable"
