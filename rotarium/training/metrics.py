"""The metrics of a run: ``metrics.jsonl`` (one JSON object per logged step or evaluation) and its loss curve.

The file is strict JSON, which has no NaN or infinity: a non-finite metric is written as ``null``, and the record's
``non_finite`` maps its name to the value it had (``{"loss": "nan"}``). Readers take a ``null`` as "no value"."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rotarium.utils.files import append_text, read_jsonl, refuse_link, without_non_finite, write_text_atomic
from rotarium.utils.plots import save_figure


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite float (at any depth) replaced by ``None`` and named in ``non_finite``."""
    non_finite: dict[str, str] = {}
    out = without_non_finite(record, non_finite)
    if non_finite:
        out["non_finite"] = {**out.get("non_finite", {}), **non_finite}
    return out


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Appends ``record`` to the JSON Lines file ``path`` as strict JSON (see the module docstring)."""
    append_text(path, json.dumps(strict_record(record), allow_nan=False) + "\n")


def metric_points(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of the records with a finite ``key`` (a null or, in files written before, a NaN is a gap)."""
    return [(r["step"], r[key]) for r in records
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and "step" in r]


def truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, drop what the killed run logged after its checkpoint, so the file reads as one run. Called as a
    run starts, so it also refuses a link in the file's place then, rather than at the first append."""
    refuse_link(path, "the run's metrics")
    if not path.is_file():
        return
    kept = [r for r in read_jsonl(path) if 0 < r.get("step", 0) <= start_step or (start_step and not r["step"])]
    write_text_atomic(path, "".join(json.dumps(strict_record(r), allow_nan=False) + "\n" for r in kept))


def plot_loss_curve(metrics_path: Path, png: Path) -> None:
    """Training and validation loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(metrics_path)
    train, val = metric_points(records, "loss"), metric_points(records, "val_loss")
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(f"{metrics_path.parent.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, png)
