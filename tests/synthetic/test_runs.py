"""Smoke tests: every task trains and evaluates through the CLI in seconds; a sweep writes its table, CSV and plot
and skips finished combinations when run again."""
import json

import pytest
import torch

from rotarium.cli import main
from rotarium.synthetic.runner import RunSettings, train_and_evaluate
from rotarium.synthetic.sweep import read_rows
from rotarium.synthetic.tasks import IGNORE, TASKS

TINY = ["--steps", "3", "--hidden-size", "16", "--heads", "2", "--batch-size", "4", "--eval-batches", "1"]
SHORT = {"mqar": ["--train-length", "32", "--num-pairs", "4", "--vocab-size", "32", "--eval-lengths", "32"],
         "copying": ["--train-length", "8", "--eval-lengths", "8,16"],
         "s2": ["--train-length", "16", "--eval-lengths", "16,64"],
         "a3": ["--train-length", "16", "--eval-lengths", "16,64"]}


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_runs_from_the_cli(task, capsys):
    assert main(["synthetic", task, "--family", "gla", "--position", "selective_rope", "--json", *TINY,
                 *SHORT[task]]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lengths = [e["length"] for e in result["evaluations"]]
    assert lengths == [int(x) for x in SHORT[task][SHORT[task].index("--eval-lengths") + 1].split(",")]
    assert all(0 <= e["accuracy"] <= 1 and 0 <= e["sequence_accuracy"] <= 1 for e in result["evaluations"])
    assert result["settings"]["steps"] == 3


def test_training_learns_parity_of_short_words():
    """Not a claim about any option: a 1-layer model must be able to fit parity over 4 tokens in 300 steps."""
    result = train_and_evaluate(RunSettings(task="s2", family="transformer", position="rope", steps=300,
                                            hidden_size=32, train_length=4, eval_lengths=[4], batch_size=32,
                                            lr=1e-2), progress=False)
    assert result.accuracy(4) > 0.9, result.evaluations


def test_sweep_writes_table_csv_plot_and_resumes(tmp_path, capsys):
    args = ["synthetic", "sweep", "s2", "--families", "gla,transformer", "--positions", "nope,selective_rope",
            "--output-dir", str(tmp_path), "--seeds", "0", "--lr", "3e-3", "--jobs", "1", *TINY, *SHORT["s2"]]
    assert main(args) == 0
    rows = read_rows(tmp_path / "s2.csv")
    assert {(r["family"], r["position"]) for r in rows} == {
        ("gla", "nope"), ("gla", "selective_rope"), ("transformer", "nope"), ("transformer", "selective_rope")}
    assert sorted({r["eval_length"] for r in rows}) == [16, 64]
    table = (tmp_path / "s2.md").read_text()
    assert "| gla |" in table and "| transformer |" in table and "beyond training" in table
    assert (tmp_path / "s2.png").stat().st_size > 1000
    before = (tmp_path / "s2.csv").read_text()
    assert main(args) == 0  # every combination is already there with the same settings: nothing reruns
    assert (tmp_path / "s2.csv").read_text() == before


@pytest.mark.parametrize("args, message", [
    (["synthetic", "s2", "--family", "mamba"], "invalid choice"),
    (["synthetic", "sweep", "s2", "--positions", "alibi"], "choose among"),
    (["synthetic", "mqar", "--train-length", "16", "--num-pairs", "8", *TINY], "num_pairs"),
    (["synthetic", "s2", "--steps", "0"], "--steps"),
    (["synthetic", "s2", "--option", "rope_theta"], "KEY=VALUE"),
])
def test_bad_input_gets_a_clear_message(args, message, capsys):
    try:
        code = main(args)
    except SystemExit as error:  # argparse
        code = error.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["synthetic", "mqar", *SHORT["mqar"][:-1], "32,8"], "--eval-lengths 8: MQAR needs 1 <= num_pairs <= seq_len / 4"),
    (["synthetic", "mqar", "--train-length", "8", "--num-pairs", "4"], "--train-length 8: MQAR needs"),
    (["synthetic", "mqar", *SHORT["mqar"][:4], "--vocab-size", "8"], "--train-length 32: MQAR needs vocab_size >= "),
    (["synthetic", "copying", "--train-length", "1"], "--train-length 1: copying needs"),
    (["synthetic", "sweep", "mqar", "--families", "gla", "--positions", "rope", "--seeds", "0", *SHORT["mqar"][:-1],
      "12"], "--eval-lengths 12: MQAR needs"),
])
def test_a_length_the_task_cannot_generate_is_refused_before_any_training(args, message, capsys, monkeypatch,
                                                                          tmp_path):
    """An evaluation length too short for MQAR's pairs was found only when the trained model was evaluated."""
    def no_training(*args, **kwargs):
        raise AssertionError("trained before the lengths were checked")

    monkeypatch.setattr("rotarium.synthetic.runner.train_model", no_training)
    monkeypatch.setattr("rotarium.synthetic.sweep.train_and_evaluate", no_training)
    monkeypatch.setattr("rotarium.synthetic.sweep.seconds_per_step", no_training)
    if args[1] == "sweep":
        args = [*args, "--output-dir", str(tmp_path)]
    assert main([*args, *TINY]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("task, lengths", [("mqar", [32, 64]), ("copying", [8, 16]), ("s2", [16, 32]),
                                           ("a3", [16, 32])])
def test_every_family_and_option_of_a_seed_is_scored_on_the_same_samples_none_trained_on(task, lengths, monkeypatch):
    """Paired comparison: a (task, seed, length) evaluates every family x option x lr on the same samples, of that
    length, drawn apart from the training batches; another seed draws other samples."""
    from rotarium.synthetic import runner

    seen = []
    real = runner._batch

    def recording(settings, length, generator, train):
        x, y = real(settings, length, generator, train)
        seen.append((settings.seed, train, length, x, y))
        return x, y

    monkeypatch.setattr(runner, "_batch", recording)
    drawn = {}
    for family, position, lr, seed in (("gla", "nope", 1e-3, 0), ("transformer", "selective_rope", 1e-2, 0),
                                       ("deltanet", "rove", 3e-3, 1)):
        seen.clear()
        train_and_evaluate(RunSettings(task=task, family=family, position=position, lr=lr, seed=seed, steps=2,
                                       hidden_size=16, num_heads=2, batch_size=4, eval_batches=2,
                                       train_length=lengths[0], eval_lengths=lengths,
                                       **({"num_pairs": 4, "vocab_size": 32} if task == "mqar" else {})),
                           progress=False)
        drawn[family] = seen[:]
    a, b, other_seed = drawn["gla"], drawn["transformer"], drawn["deltanet"]
    evals = [(length, x, y) for _, train, length, x, y in a if not train]
    assert [length for length, _, _ in evals] == [lengths[0]] * 2 + [lengths[1]] * 2
    assert all((y != IGNORE).any(1).all() for _, _, y in evals)
    for (_, train, length, x, y), (_, train_b, length_b, x_b, y_b) in zip(a, b, strict=True):
        assert (train, length) == (train_b, length_b) and torch.equal(x, x_b) and torch.equal(y, y_b)
    for length in lengths:
        if length == lengths[0]:  # the training batches are at the training length
            trained = {tuple(row) for _, train, _, x, _ in a if train for row in x.tolist()}
            assert not trained & {tuple(row) for n, x, _ in evals if n == length for row in x.tolist()}
        mine = [x for n, x, _ in evals if n == length]
        theirs = [x for _, train, n, x, _ in other_seed if not train and n == length]
        assert not any(torch.equal(p, q) for p, q in zip(mine, theirs))


def test_accuracy_pools_the_scored_tokens_of_every_sample_and_a_sequence_needs_every_one(monkeypatch):
    """Hand-worked: 8 scored tokens over two batches with 3 and 1 scored per row, 6 right (75%, where a mean of
    per-sample means or of per-batch means gives 66.7%); unscored positions count neither way; 2 of 4 rows whole."""
    from types import SimpleNamespace

    from rotarium.synthetic import runner

    n = IGNORE
    batches = [(torch.tensor([[2, 1, 1, 1], [2, 0, 0, 1]]), torch.tensor([[n, 1, 0, 1], [n, 0, 0, 1]])),
               (torch.tensor([[2, 0, 1, 0], [2, 1, 1, 0]]), torch.tensor([[n, n, 1, n], [n, n, 0, n]]))]
    predictions = [torch.tensor([[0, 1, 0, 1], [1, 0, 1, 1]]), torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0]])]

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, use_cache):
            return SimpleNamespace(logits=torch.nn.functional.one_hot(predictions.pop(0), 3).float())

    monkeypatch.setattr(runner, "_batch", lambda settings, length, generator, train: batches.pop(0))
    settings = RunSettings(task="s2", eval_batches=2).resolved()
    assert runner.evaluate(Fixed(), settings, 3) == {"length": 3, "accuracy": 0.75, "sequence_accuracy": 0.5}


@pytest.mark.parametrize("task, length, tokens", [("copying", 8, 18), ("s2", 16, 17), ("a3", 16, 17), ("mqar", 32, 32)])
def test_the_model_is_told_its_training_context_in_tokens(task, length, tokens):
    """max_position_embeddings is the original length of a RoPE scaling (--option rope_parameters=...; "dynamic"
    rescales beyond it): it was the task's length (letters, words), shorter than the sequences trained on."""
    from rotarium.synthetic.runner import build_model

    settings = RunSettings(task=task, family="transformer", position="rope", hidden_size=16, num_heads=2,
                           train_length=length, eval_lengths=[length], num_pairs=4 if task == "mqar" else None,
                           model_options={"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}).resolved()
    assert build_model(settings).config.max_position_embeddings == tokens
