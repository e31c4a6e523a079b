"""End-to-end runs of `rotarium train` in child processes: a short run learns, a SIGKILLed run resumes exactly, a kill
while saving never leaves a checkpoint that --resume trusts, --init-from fine-tunes."""
import json
import math
import shutil
import signal

import pytest

from rotarium.training.run_folder import COMPLETE, latest_checkpoint
from tests.training.helpers import cli_args, losses, ok, run_child

pytestmark = pytest.mark.slow


def test_short_run_learns_and_leaves_a_loadable_model(reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rotarium  # noqa: F401

    val = losses(reference, "val_loss")
    assert sorted(val) == [0, 6, 12]
    assert val[12] < val[0] - 0.4, val  # from ~ln(320) = 5.8 down
    train = losses(reference)
    assert sorted(train) == list(range(1, 13)) and all(math.isfinite(x) for x in train.values())
    start = json.loads((reference / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["world_size"] == 1
    final = reference / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.config.position_encoding == "selective_rope" and model.config.family == "gla"
    ids = tokenizer("The for statement", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4
    assert (reference / "loss_curve.png").stat().st_size > 1000
    assert (final / "eval" / "loss_curve.png").is_file()
    args = json.loads((reference / "training_args.json").read_text())
    assert args["train.max_steps"] == 12 and args["tokens_per_step"] == 4 * 32
    assert latest_checkpoint(reference).name == "step-6"
    assert (reference / "checkpoints" / "step-6" / "state").is_dir()
    assert AutoTokenizer.from_pretrained(reference / "checkpoints" / "step-6").vocab_size == tokenizer.vocab_size


def _compare_tail(run_dir, reference, after_step):
    mine, ref = losses(run_dir), losses(reference)
    assert sorted(mine) == sorted(ref)
    for step in range(after_step + 1, 13):
        assert abs(mine[step] - ref[step]) <= 1e-5, (step, mine[step], ref[step])
    mine_val, ref_val = losses(run_dir, "val_loss"), losses(reference, "val_loss")
    assert sorted(mine_val) == sorted(ref_val)
    assert abs(mine_val[12] - ref_val[12]) <= 1e-5


def test_sigkill_then_resume_repeats_the_uninterrupted_run(corpus, reference, tmp_path):
    run_dir = tmp_path / "killed"
    args = ["train", "--output-dir", str(run_dir), *cli_args(corpus)]
    killed = run_child(args, kill_at_step=9)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (run_dir / "final").exists() and latest_checkpoint(run_dir).name == "step-6"
    ok(run_child([*args, "--resume"]))
    _compare_tail(run_dir, reference, after_step=6)


def test_kill_while_saving_leaves_no_checkpoint_that_resume_trusts(corpus, reference, tmp_path):
    run_dir = tmp_path / "killed-saving"
    args = ["train", "--output-dir", str(run_dir), *cli_args(corpus, train__save_every=4)]
    killed = run_child(args, kill_in_save=2)  # the checkpoint of step 8, half written
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    partial = run_dir / "checkpoints" / ".step-8.tmp"
    assert (partial / "state").is_dir() and not (partial / COMPLETE).exists()
    assert latest_checkpoint(run_dir).name == "step-4"
    # a step folder without its COMPLETE marker (say, copied by hand) is not trusted either
    shutil.copytree(partial, run_dir / "checkpoints" / "step-8")
    assert latest_checkpoint(run_dir).name == "step-4"
    ok(run_child([*args, "--resume"]))
    _compare_tail(run_dir, reference, after_step=4)
    assert not partial.exists() or latest_checkpoint(run_dir).name == "step-8"


def test_init_from_starts_from_the_given_weights(corpus, reference, tmp_path):
    run_dir = tmp_path / "finetune"
    ok(run_child(["train", "--output-dir", str(run_dir), "--init-from", str(reference / "final"),
                   *cli_args(corpus, train__max_steps=2, train__eval_every=2)]))
    # the same held-out documents scored before any update: the loss the reference ended with
    assert abs(losses(run_dir, "val_loss")[0] - losses(reference, "val_loss")[12]) < 1e-5
    assert (run_dir / "tokenizer" / "tokenizer.json").read_text() == (
        reference / "final" / "tokenizer.json").read_text()


def test_an_existing_run_needs_resume_or_overwrite(corpus, reference, tmp_path):
    result = run_child(["train", "--output-dir", str(reference), *cli_args(corpus)])
    assert result.returncode == 2 and "--resume" in result.stderr and "--overwrite" in result.stderr
