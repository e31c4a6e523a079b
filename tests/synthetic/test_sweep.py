"""Sweeps over seeds: the median and min-max of each cell, a claim decided seed by seed by the verdict rules
(tests/evaluation/test_verdicts.py tests each rule), and resumable units (a rerun trains only what is missing)."""
import pytest

import rotarium.synthetic.sweep as sweep_module
from rotarium.cli import main
from rotarium.synthetic.runner import RunResult, RunSettings
from rotarium.synthetic.sweep import (
    CLAIMS,
    Claim,
    aggregate,
    check_claim,
    markdown_report,
    read_rows,
    sweep,
    sweep_units,
)
from rotarium.utils.files import write_csv_atomic

TINY = {"steps": 2, "hidden_size": 16, "num_heads": 2, "batch_size": 4, "eval_batches": 1, "train_length": 8,
        "eval_lengths": [8, 16]}


def row(family, position, seed, length, accuracy, lr=3e-3, task="s2", train_length=8):
    return {"task": task, "family": family, "position": position, "seed": seed, "eval_length": length,
            "accuracy": accuracy, "sequence_accuracy": accuracy / 2, "train_length": train_length, "lr": lr,
            "train_loss": 0.1, "train_seconds": 10.0, "eval_seconds": 1.0, "steps": 100, "batch_size": 8,
            "num_layers": 1, "hidden_size": 16, "num_heads": 2, "parameters": 1000, "model_options": "{}",
            "num_pairs": "", "vocab_size": "", "optim_options": ""}


def test_cells_are_median_and_min_max_over_seeds():
    rows = [row("gla", "rope", s, 8, a) for s, a in ((0, 0.5), (1, 0.9), (2, 0.7))]
    cell = aggregate(rows)[("gla", "rope", 3e-3, 8)]
    assert (cell["median"], cell["min"], cell["max"]) == (0.7, 0.5, 0.9)
    assert cell["seeds"] == [0, 1, 2] and cell["sequence_median"] == 0.35
    # an even number of seeds: the mean of the middle two
    assert aggregate(rows[:2])[("gla", "rope", 3e-3, 8)]["median"] == pytest.approx(0.7)


@pytest.mark.parametrize("selective, expected", [
    ((0.99, 0.98, 0.97), "holds (3/3 seeds)"),
    ((0.99, 0.50, 0.97), "mixed (2/3 seeds)"),
    ((0.60, 0.50, 0.55), "does not hold (0/3 seeds)"),
])
def test_a_claim_holds_only_when_it_holds_for_every_seed(selective, expected):
    claim = Claim("solves", "selective_rope", ("nope", "rope"), "train", solved=0.95)
    assert CLAIMS["s2"][0].solved == 0.99  # the word problems ask for every position
    rows = [row("gla", "selective_rope", s, 8, a) for s, a in enumerate(selective)]
    rows += [row("gla", "nope", s, 8, 0.6) for s in range(3)] + [row("gla", "rope", s, 8, 0.7) for s in range(3)]
    assert str(check_claim(claim, aggregate(rows), "gla", 3e-3, 8, 8)) == expected


def test_claims_compare_paired_seeds_not_medians():
    """RoVE's median beats RoPE's, but on seed 2 RoPE wins: the claim is mixed, not held."""
    claim = Claim("beats", "rove", ("rope",), "beyond")
    rows = [row("gla", "rove", s, 16, a) for s, a in ((0, 0.60), (1, 0.62), (2, 0.55))]
    rows += [row("gla", "rope", s, 16, a) for s, a in ((0, 0.30), (1, 0.32), (2, 0.58))]
    rows += [row("gla", o, s, 8, 0.99) for o in ("rove", "rope") for s in range(3)]  # no gap at the training length
    assert str(check_claim(claim, aggregate(rows), "gla", 3e-3, 16, 8)) == "mixed (2/3 seeds)"
    # an option beats another only by the margin: a tie is not a win
    tie = [row("gla", option, seed, 16, 0.3) for option in ("rove", "rope") for seed in range(3)]
    assert str(check_claim(claim, aggregate(tie), "gla", 3e-3, 16, 8)) == "does not hold (0/3 seeds)"
    # two seeds decide nothing, however far ahead
    ahead = [row("gla", option, seed, 16, 0.9 if option == "rove" else 0.3) for option in ("rove", "rope")
             for seed in (0, 1)]
    assert str(check_claim(claim, aggregate(ahead), "gla", 3e-3, 16, 8)) == "not measured"
    # only seeds with every option measured count
    missing = [row("gla", "rove", 0, 16, 0.9)]
    assert str(check_claim(claim, aggregate(missing), "gla", 3e-3, 16, 8)) == "not measured"


def test_the_report_prints_why_a_claim_is_not_testable_or_in_distribution_only():
    """A claim beyond training whose gap is the one at the training length, and one where every cell saturates."""
    seeds = (0, 1, 2)
    rows = [row("gla", o, s, 8, a) for o, a in (("nope", 0.7), ("rope", 0.8), ("selective_rope", 0.9)) for s in seeds]
    rows += [row("gla", o, s, 32, a) for o, a in (("nope", 0.6), ("rope", 0.7), ("selective_rope", 0.8))
             for s in seeds]
    rows += [row("fox", o, s, length, 1.0) for o in ("nope", "rope", "selective_rope") for s in seeds
             for length in (8, 32)]
    text = markdown_report(rows, seeds=seeds)
    weaker_beyond = text[text.index(f"**{CLAIMS['s2'][3].text}**"):]
    assert "| gla | in distribution only (3/3 seeds) |" in weaker_beyond
    assert "| fox | not testable at this scale |" in weaker_beyond
    assert "- gla, length 32: in distribution only: selective_rope ahead of nope and rope (token accuracy) by 10.0 " \
           "points" in weaker_beyond
    assert "- fox, length 32: not testable at this scale: every compared cell at a ceiling: 100% accuracy in 9/9." \
           in weaker_beyond
    assert "How verdicts are decided" in text


def test_report_heads_with_command_and_budget_and_marks_partial_tables():
    rows = [row(f, p, s, length, 0.5 + 0.1 * s) for f in ("gla", "fox") for p in ("nope", "rope", "selective_rope")
            for s in (0, 1) for length in (8, 32)]
    rows = [r for r in rows if not (r["family"] == "fox" and r["seed"] == 1)]
    units = sweep_units(("gla", "fox"), ("nope", "rope", "selective_rope"), (3e-3,), (0, 1, 2))
    text = markdown_report(rows, "rotarium synthetic sweep s2", seeds=(0, 1, 2), units=units)
    assert text.index("Command: `rotarium synthetic sweep s2`") < text.index("Budget:") < text.index("| family")
    assert "100 steps of 8 sequences, lr 0.003" in text and "seeds 0, 1, 2" in text
    assert "**partial**, 9 of 18 runs" in text
    assert "| gla | 55.0 [50.0-60.0] (28) 2 seeds |" in text  # median, min-max, sequence median, seed count
    assert "| fox | 50.0 [50.0-50.0] (25) 1 seed |" in text
    assert "beyond training, 4x" in text and "in distribution" in text
    for claim in CLAIMS["s2"]:
        assert claim.text in text
    assert "| gla | not measured |" in text  # two of the three seeds


def test_units_are_seed_major():
    units = sweep_units(("gla", "fox"), ("nope",), (1e-3, 1e-2), (0, 1))
    assert [u.seed for u in units] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_rerun_trains_only_the_missing_units(tmp_path, monkeypatch):
    calls = []
    real = sweep_module.train_and_evaluate

    def counting(settings, progress=True):
        calls.append((settings.family, settings.position, settings.seed))
        return real(settings, progress=False)

    monkeypatch.setattr(sweep_module, "train_and_evaluate", counting)
    base = RunSettings(task="s2", **TINY)
    kwargs = {"families": ("gla",), "positions": ("nope", "rope"), "seeds": (0, 1), "lrs": (3e-3,), "jobs": 1,
              "progress": False, "log": lambda line: None}
    csv_path, md_path, png_path = sweep(base, tmp_path, **kwargs)
    assert sorted(calls) == [("gla", p, s) for p in ("nope", "rope") for s in (0, 1)]
    assert "**complete**, all 4 runs" in md_path.read_text() and png_path.stat().st_size > 1000
    calls.clear()
    sweep(base, tmp_path, **kwargs)
    assert calls == []  # everything is there with the same settings
    # a unit killed before it finished leaves no rows: only it runs again
    rows = [r for r in read_rows(csv_path) if not (r["position"] == "rope" and r["seed"] == 1)]
    write_csv_atomic(csv_path, rows, sweep_module.CSV_FIELDS)
    sweep(base, tmp_path, **kwargs)
    assert calls == [("gla", "rope", 1)]
    calls.clear()
    # other settings are other units; the rows of the first table stay in the CSV
    sweep(RunSettings(task="s2", **{**TINY, "steps": 3}), tmp_path, **{**kwargs, "seeds": (0,)})
    assert sorted(calls) == [("gla", "nope", 0), ("gla", "rope", 0)]
    assert len(read_rows(csv_path)) == 2 * 6  # 4 + 2 runs, two lengths each
    assert "3 steps" in md_path.read_text() and "**complete**, all 2 runs" in md_path.read_text()


@pytest.mark.slow  # a pool of spawned Python processes
def test_two_processes_run_the_units_and_the_parent_writes_every_row(tmp_path):
    base = RunSettings(task="s2", **TINY)
    sweep(base, tmp_path, families=("transformer",), positions=("nope", "rope"), seeds=(0,), lrs=(3e-3,), jobs=2,
          progress=False, log=lambda line: None)
    rows = read_rows(tmp_path / "s2.csv")
    assert sorted((r["position"], r["eval_length"]) for r in rows) == [("nope", 8), ("nope", 16), ("rope", 8),
                                                                      ("rope", 16)]


def test_a_sweep_tries_the_tasks_learning_rates_unless_given(tmp_path):
    base = RunSettings(task="s2", **{**TINY, "steps": 1, "eval_lengths": [8]})
    kwargs = {"families": ("gla",), "positions": ("nope",), "seeds": (0,), "progress": False, "log": lambda line: None}
    sweep(base, tmp_path, **kwargs)
    assert sorted({r["lr"] for r in read_rows(tmp_path / "s2.csv")}) == [1e-3, 3e-3, 1e-2]
    assert "| gla, lr 0.001 |" in (tmp_path / "s2.md").read_text()
    sweep(base, tmp_path / "one", lrs=(2e-3,), **kwargs)
    assert {r["lr"] for r in read_rows(tmp_path / "one" / "s2.csv")} == {2e-3}


@pytest.mark.parametrize("args, message", [
    (["--seeds", "a"], "--seeds takes integers"),
    (["--seeds", "0,0"], "--seeds names 0 more than once"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--lr", "1e-3,x"], "--lr takes numbers"),
    (["--lr", "0"], "--lr must be positive"),
])
def test_sweep_arguments_are_checked(args, message, tmp_path, capsys):
    try:
        code = main(["synthetic", "sweep", "s2", "--output-dir", str(tmp_path), *args])
    except SystemExit as error:  # argparse
        code = error.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_sweep_cli_takes_seeds_and_learning_rates(tmp_path, capsys):
    assert main(["synthetic", "sweep", "a3", "--families", "gla", "--positions", "nope", "--seeds", "3,4",
                 "--lr", "1e-3,2e-3", "--jobs", "1", "--steps", "1", "--hidden-size", "16", "--batch-size", "2",
                 "--eval-batches", "1", "--train-length", "4", "--eval-lengths", "4", "--output-dir",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 of 4 runs already done; 4 to run with 1 process(es), expected about" in out
    rows = read_rows(tmp_path / "a3.csv")
    assert sorted((r["seed"], r["lr"]) for r in rows) == [(3, 1e-3), (3, 2e-3), (4, 1e-3), (4, 2e-3)]


def test_report_only_trains_nothing_and_marks_what_is_missing(tmp_path, monkeypatch):
    base = RunSettings(task="s2", **TINY)
    kwargs = {"families": ("gla",), "seeds": (0,), "lrs": (3e-3,), "jobs": 1, "progress": False,
              "log": lambda line: None}
    sweep(base, tmp_path, positions=("nope",), **kwargs)

    def no_training(*args, **kwargs):
        raise AssertionError("--report-only trained")

    monkeypatch.setattr(sweep_module, "train_and_evaluate", no_training)
    _, md_path, _ = sweep(base, tmp_path, positions=("nope", "rope"), report_only=True, **kwargs)
    text = md_path.read_text()
    assert "**partial**, 1 of 2 runs" in text and "Running the command again trains only the missing runs" in text
    assert "| gla | " in text and " | - |" in text


def test_a_changed_number_of_evaluation_batches_is_another_unit(tmp_path, monkeypatch):
    """--eval-batches changes every accuracy of a run but was neither in the CSV nor in the resume key: a sweep
    with more evaluation batches found the old rows "done" and tabled them under its own command."""
    calls = []

    def fake(settings, progress=True):
        calls.append(settings.eval_batches)
        return RunResult(settings, 0.1, 1.0, 10, [{"length": n, "accuracy": settings.eval_batches / 10,
                                                   "sequence_accuracy": 0.0} for n in settings.eval_lengths])

    monkeypatch.setattr(sweep_module, "train_and_evaluate", fake)
    monkeypatch.setattr(sweep_module, "expected_seconds", lambda planned: 0.0)
    kwargs = {"families": ("gla",), "positions": ("nope",), "seeds": (0,), "lrs": (3e-3,), "jobs": 1,
              "progress": False, "log": lambda line: None}
    sweep(RunSettings(task="s2", **TINY), tmp_path, **kwargs)
    _, md_path, _ = sweep(RunSettings(task="s2", **{**TINY, "eval_batches": 2}), tmp_path, **kwargs)
    assert calls == [1, 2]
    assert "| gla | 20.0 [20.0-20.0] (0) |" in md_path.read_text()  # the table of 2 batches, not of 1
    assert sorted(r["eval_batches"] for r in read_rows(tmp_path / "s2.csv")) == [1, 1, 2, 2]
    # a CSV without the column holds runs evaluated on the 4 batches every sweep used before it was written
    rows = read_rows(tmp_path / "s2.csv")
    write_csv_atomic(tmp_path / "s2.csv", [r for r in rows if r["eval_batches"] == 1],
                     [f for f in sweep_module.CSV_FIELDS if f != "eval_batches"])
    sweep(RunSettings(task="s2", **{**TINY, "eval_batches": 4}), tmp_path, **kwargs)
    assert calls == [1, 2]
    sweep(RunSettings(task="s2", **TINY), tmp_path, **kwargs)
    assert calls == [1, 2, 1]
