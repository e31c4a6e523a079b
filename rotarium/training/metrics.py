"""The metrics of a run: ``metrics.jsonl`` (one JSON object per logged step or evaluation) and its loss curve."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rotarium.utils.files import read_jsonl, write_text_atomic


def append_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, drop what the killed run logged after its checkpoint, so the file reads as one run."""
    if not path.is_file():
        return
    kept = [r for r in read_jsonl(path) if 0 < r.get("step", 0) <= start_step or (start_step and not r["step"])]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def plot_loss_curve(metrics_path: Path, png: Path) -> None:
    """Training and validation loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
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
    fig.savefig(png, dpi=120)
    plt.close(fig)
