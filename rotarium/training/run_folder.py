"""The run folder of ``rotarium train``: its layout, the checkpoints in it, and how a checkpoint is published.

A run folder holds::

    tokenizer/                      the tokenizer (trained once, reused on resume)
    checkpoints/step-<N>/           state/ (accelerate: weights, optimizer, RNG), a save_pretrained model and
                                    tokenizer, trainer_state.json, and COMPLETE, written last
    final/                          the final model and tokenizer (+ eval/ after `rotarium eval`)
    metrics.jsonl                   one JSON object per logged step / evaluation
    training_args.json, loss_curve.png

A checkpoint is written into a hidden ``.<name>.tmp`` folder and renamed into place, and only folders with
``COMPLETE`` are resumed from, so a run killed while saving never leaves a checkpoint that ``--resume`` would pick
up broken.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from rotarium.utils.files import write_json_atomic, write_text_atomic

TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
FINAL = "final"
EVAL = "eval"
METRICS = "metrics.jsonl"
TRAINING_ARGS = "training_args.json"
LOSS_CURVE = "loss_curve.png"
ACCELERATE_STATE = "state"
TRAINER_STATE = "trainer_state.json"
COMPLETE = "COMPLETE"
# What `--overwrite` deletes: everything a run writes, nothing else the user keeps in the folder.
RUN_FILES = (CHECKPOINTS, FINAL, TOKENIZER, METRICS, TRAINING_ARGS, LOSS_CURVE)


def holds_run(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINTS).exists() or (run_dir / FINAL).exists()


def clear_run(run_dir: Path) -> None:
    """Deletes what a previous run wrote into ``run_dir`` (:data:`RUN_FILES`)."""
    for name in RUN_FILES:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step}"


def checkpoint_step(path: Path) -> int | None:
    """``N`` for a folder named ``step-<N>``, else ``None``."""
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if checkpoint_step(p) is not None and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Deletes all but the newest ``keep`` complete checkpoints."""
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def staging_folder(target: Path) -> Path:
    """Where ``target`` is written before it is renamed into place: a fixed name, so that every process of a run
    finds it without communicating, and the next save clears what a killed one left."""
    return target.parent / f".{target.name}.tmp"


def mark_complete(folder: Path, step: int, state: dict[str, Any]) -> None:
    """Writes the trainer state, then ``COMPLETE``: the last file of a checkpoint, present only when the rest is."""
    write_json_atomic(folder / TRAINER_STATE, state)
    write_text_atomic(folder / COMPLETE, f"{step}\n")


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / TRAINER_STATE).read_text())
