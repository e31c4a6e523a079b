"""metrics.jsonl is strict JSON: a non-finite metric is written as null and named in the record's `non_finite`, and
every reader of the file (loss curve, resume, model card) takes the null."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rotarium.data.documents import embedded_documents
from rotarium.hub import export_checkpoint
from rotarium.training.config import load_config
from rotarium.training.metrics import append_record, plot_loss_curve, truncate_metrics
from rotarium.training.trainer import Trainer
from tests.training.helpers import TINY, scale_losses


def strict_records(path: Path) -> list[dict]:
    """The records as a strict JSON parser reads them (NaN and Infinity are not JSON)."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_run_with_a_nan_step_writes_strict_json(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n\n".join(embedded_documents()[:40]))
    # the third training forward: step 3's loss is NaN, its update skipped
    scale_losses(monkeypatch, lambda n: float("nan") if n == 3 else 1.0)
    config = load_config(None, {**TINY, "data.source": str(corpus), "train.max_steps": 4, "train.eval_every": 4})
    run = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="non-finite"):
        Trainer(config, run).train()
    records = strict_records(run / "metrics.jsonl")
    bad = next(r for r in records if r["step"] == 3 and "loss" in r)
    assert bad["loss"] is None and bad["non_finite"]["loss"] == "nan"
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r and r["step"] != 3)
    assert (run / "loss_curve.png").stat().st_size > 0  # drawn around the gap
    # and the run's card: the data file by its name only (no path of this machine)
    card = (export_checkpoint(run / "final", tmp_path / "exported") / "README.md").read_text()
    assert str(tmp_path) not in card and "| data.source | corpus.txt |" in card


def test_writers_and_readers_of_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_record(path, {"step": 1, "loss": 2.5, "grad_norm": float("inf"), "fingerprints": [1, float("-inf")]})
    assert strict_records(path) == [{"step": 1, "loss": 2.5, "grad_norm": None, "fingerprints": [1, None],
                                     "non_finite": {"grad_norm": "inf", "fingerprints[1]": "-inf"}}]
    # a file written before (bare NaN) still reads; resuming rewrites it as strict JSON
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": NaN}\n{"step": 3, "loss": 2.0}\n')
    truncate_metrics(path, 2)
    assert strict_records(path) == [{"step": 1, "loss": 3.0},
                                    {"step": 2, "loss": None, "non_finite": {"loss": "nan"}}]
    append_record(path, {"step": 3, "val_loss": float("nan")})
    plot_loss_curve(path, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.parametrize("first, last, expected", [
    (5.0, 4.0, "validation loss 5.000 -> 4.000 (20% lower; perplexity 54.6) after 3 steps"),
    (5.0, 5.5, "validation loss 5.000 -> 5.500 (10% higher; perplexity 244.7) after 3 steps"),
])
def test_the_closing_line_says_whether_the_validation_loss_fell_or_rose(first, last, expected, tmp_path, capsys,
                                                                        monkeypatch):
    """A loss that rose was printed as "-10% lower"."""
    import types

    from rotarium.cli import main
    from rotarium.training import trainer

    result = trainer.TrainResult(tmp_path / "run", tmp_path / "run" / "final", 3, first, last, 0)
    fake = types.SimpleNamespace(train=lambda: result, close=lambda: None,
                                 accelerator=types.SimpleNamespace(is_main_process=True))
    monkeypatch.setattr(trainer, "Trainer", lambda *args, **kwargs: fake)
    assert main(["train", "--output-dir", str(tmp_path / "run"), "--eval.run_after", "false"]) == 0
    assert expected in capsys.readouterr().out
