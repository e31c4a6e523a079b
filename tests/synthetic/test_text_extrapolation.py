"""``rotarium extrapolation``: a tiny end-to-end run on a tiny local text (no download), resumability, the claims
on perplexity, and its arguments."""
import random

import pytest

import rotarium.synthetic.text as text_module
from rotarium.cli import main
from rotarium.synthetic.text import CLAIMS, aggregate, check_claim, read_rows

TINY = ["--model.hidden_size", "16", "--model.num_hidden_layers", "1", "--model.num_heads", "2",
        "--data.seq_len", "8", "--train.max_steps", "2", "--train.batch_size", "2", "--tokenizer.vocab_size", "280",
        "--multiples", "1,2", "--eval-tokens", "64", "--jobs", "1"]


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(0)
    words = ("the for statement iterates over the items of any sequence in the order that they appear " * 2).split()
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        documents = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(8)]
        (folder / f"part{i}.txt").write_text("\n\n\n".join(documents))
    return folder


def test_a_tiny_sweep_writes_table_csv_plot_and_a_rerun_trains_nothing(corpus, tmp_path, monkeypatch, capsys):
    args = ["extrapolation", "--data.source", str(corpus), "--families", "gla", "--positions", "rope,rove",
            "--seeds", "0", "--output-dir", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs"), *TINY]
    assert main(args) == 0
    rows = read_rows(tmp_path / "out" / "extrapolation.csv")
    assert sorted((r["position"], r["context_length"]) for r in rows) == [("rope", 8), ("rope", 16), ("rove", 8),
                                                                        ("rove", 16)]
    assert all(r["perplexity"] > 1 and r["windows"] >= 1 for r in rows)
    assert len({r["settings"] for r in rows}) == 1  # one table: the units differ only in family, option, seed
    table = (tmp_path / "out" / "extrapolation.md").read_text()
    assert "**complete**, all 2 runs" in table and "Context 16 (beyond training, 2x)" in table
    assert CLAIMS[0].text in table and (tmp_path / "out" / "extrapolation.png").stat().st_size > 1000
    # one tokenizer for every run
    assert (tmp_path / "runs" / "tokenizer" / "tokenizer_config.json").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(text_module, "train_and_score", no_training)
    capsys.readouterr()
    assert main(args) == 0
    assert "2 of 2 runs already done; 0 to run" in capsys.readouterr().out


def test_perplexity_claims_hold_only_for_every_seed():
    def row(position, seed, ppl, length=16):
        return {"family": "gla", "position": position, "seed": seed, "context_length": length, "perplexity": ppl}

    rove_beats_rope = CLAIMS[0]
    rows = [row("rove", s, p) for s, p in ((0, 10.0), (1, 11.0), (2, 12.0))]
    rows += [row("rope", s, p) for s, p in ((0, 20.0), (1, 20.0), (2, 12.05))]  # seed 2: within the 1% margin
    assert check_claim(rove_beats_rope, aggregate(rows), "gla", 16) == (2, 3)
    assert aggregate(rows)[("gla", "rove", 16)]["median"] == 11.0


@pytest.mark.parametrize("args, message", [
    (["--families", "mamba"], "choose among"),
    (["--seeds", "1,1"], "--seeds has a seed twice"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--multiples", "0,2"], "--multiples must be integers >= 1"),
    (["--model.family", "gla"], "--model.family is set per run here"),
    (["--train.seed", "3"], "--train.seed is set per run here"),
    (["--nonsense.key", "3"], "unknown config"),
])
def test_arguments_are_checked(args, message, corpus, tmp_path, capsys):
    try:
        code = main(["extrapolation", "--data.source", str(corpus), "--output-dir", str(tmp_path / "out"),
                     "--runs-dir", str(tmp_path / "runs"), *args])
    except SystemExit as error:  # argparse
        code = error.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_without_the_python_docs_it_says_how_to_get_them(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(text_module, "PYTHON_DOCS", str(tmp_path / "missing"))
    assert main(["extrapolation", "--output-dir", str(tmp_path / "out")]) == 2
    assert "apt-get install python3-doc" in capsys.readouterr().err
