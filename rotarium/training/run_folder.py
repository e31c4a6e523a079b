"""The run folder of ``rotarium train``: its layout, the checkpoints in it, and how a checkpoint is published.

A run folder holds::

    tokenizer/                      the tokenizer (trained once, reused on resume)
    checkpoints/step-<N>/           state/ (accelerate: weights, optimizer, RNG), a save_pretrained model and
                                    tokenizer, trainer_state.json (with the verdict ``good``), checksums.json (the
                                    size and SHA-256 of every other file), and COMPLETE, written last
    final/                          the final model and tokenizer (+ eval/ after `rotarium eval`)
    metrics.jsonl                   one JSON object per logged step / evaluation
    training_args.json, loss_curve.png
    .lock                           while a run holds the folder (:mod:`rotarium.training.lock`)
    previous/                       while an ``--overwrite`` run has no checkpoint yet: the run it replaces
    rewound-from-step-<N>/          what a ``--resume --allow-rewind`` replaced of a run that had reached step N:
                                    its final/, the checkpoints after the one resumed from, and copies of its
                                    metrics.jsonl, training_args.json and loss_curve.png

A checkpoint is written into a hidden ``.<name>.tmp`` folder and renamed into place, and only folders with
``COMPLETE`` are resumed from, so a run killed while saving never leaves a checkpoint that ``--resume`` would pick
up broken; ``checksums.json`` catches a file damaged after that (a full disk, a copy cut short).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from rotarium.utils.files import fsync_tree, read_jsonl, write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

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
CHECKSUMS = "checksums.json"
PREVIOUS = "previous"
REPLACING = ".replacing"  # what an --overwrite run writes before the old run is set aside (its tokenizer)
REWOUND = "rewound-from-step-{}"
# What `--overwrite` deletes: everything a run writes, nothing else the user keeps in the folder.
RUN_FILES = (CHECKPOINTS, FINAL, TOKENIZER, METRICS, TRAINING_ARGS, LOSS_CURVE)


def holds_run(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINTS).exists() or (run_dir / FINAL).exists()


def clear_run(run_dir: Path) -> None:
    """Deletes what a run wrote into ``run_dir`` (:data:`RUN_FILES`)."""
    for name in RUN_FILES:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def set_aside_run(run_dir: Path) -> Path:
    """Moves the run in ``run_dir`` (its :data:`RUN_FILES`) into ``run_dir/previous/`` (which must not exist), where
    it stays loadable and resumable until :func:`drop_previous_run` or :func:`restore_previous_run`."""
    aside = run_dir / PREVIOUS
    aside.mkdir()
    moved = []
    try:
        for name in RUN_FILES:
            if (run_dir / name).exists():
                os.replace(run_dir / name, aside / name)
                moved.append(name)
    except BaseException:
        for name in moved:
            os.replace(aside / name, run_dir / name)
        aside.rmdir()
        raise
    return aside


def restore_previous_run(run_dir: Path) -> None:
    """Puts the run set aside in ``run_dir/previous/`` back, deleting what the replacing run wrote."""
    clear_run(run_dir)
    aside = run_dir / PREVIOUS
    for path in aside.iterdir():
        os.replace(path, run_dir / path.name)
    aside.rmdir()


def drop_previous_run(run_dir: Path) -> None:
    shutil.rmtree(run_dir / PREVIOUS)


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


def is_good(checkpoint: Path) -> bool:
    """The checkpoint's verdict (:mod:`rotarium.training.guard`); a checkpoint with no recorded verdict counts as
    good, one whose trainer state cannot be read as not good (with a warning naming the file)."""
    try:
        return read_trainer_state(checkpoint).get("good", True)
    except CorruptCheckpoint as error:
        logger.warning("%s; it is skipped as not good", error)
        return False


def latest_good_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    good = [p for p in complete_checkpoints(run_dir) if is_good(p)]
    return good[-1] if good else None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Deletes all but the newest ``keep`` complete checkpoints and the newest good one (the one to go back to)."""
    keep_good = latest_good_checkpoint(run_dir)
    for old in complete_checkpoints(run_dir)[:-keep]:
        if old != keep_good:
            shutil.rmtree(old, ignore_errors=True)


def staging_folder(target: Path) -> Path:
    """Where ``target`` is written before it is renamed into place: a fixed name, so that every process of a run
    finds it without communicating, and the next save clears what a killed one left."""
    return target.parent / f".{target.name}.tmp"


def mark_complete(folder: Path, step: int, state: dict[str, Any]) -> None:
    """Writes the trainer state, syncs every file to disk, records their sizes and hashes in ``checksums.json``,
    then writes ``COMPLETE``: the last file of a checkpoint, present only when the rest is."""
    write_json_atomic(folder / TRAINER_STATE, state)
    fsync_tree(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (CHECKSUMS, COMPLETE))
    record = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    write_json_atomic(folder / CHECKSUMS, {"algorithm": "sha256", "files": record})
    write_text_atomic(folder / COMPLETE, f"{step}\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class CorruptCheckpoint(ValueError):
    """A file of a checkpoint differs from what its ``checksums.json`` recorded, or cannot be read."""


def verify_checkpoint(checkpoint: Path) -> bool:
    """Checks every file recorded in the checkpoint's ``checksums.json``: present, of its size (all first, which is
    cheap), then of its SHA-256. Returns ``True`` when verified, ``False`` for a checkpoint without the record
    (written before checksums were recorded), and raises :class:`CorruptCheckpoint` naming the first bad file.
    Files added later (``eval/`` of `rotarium eval`) are not checked."""
    path = checkpoint / CHECKSUMS
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpoint(f"{path} is unreadable ({error})") from error
    for name, expected in files.items():
        size = (checkpoint / name).stat().st_size if (checkpoint / name).is_file() else None
        if size is None:
            raise CorruptCheckpoint(f"{checkpoint.name}/{name} is missing")
        if size != expected["bytes"]:
            raise CorruptCheckpoint(f"{checkpoint.name}/{name} has {size} bytes, {expected['bytes']} were written")
    for name, expected in files.items():
        if _sha256(checkpoint / name) != expected["sha256"]:
            raise CorruptCheckpoint(f"{checkpoint.name}/{name} does not match the SHA-256 recorded when written")
    return True


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``; raises :class:`CorruptCheckpoint` naming it when it is missing,
    not JSON or has no step."""
    path = checkpoint / TRAINER_STATE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # a JSON or UTF-8 error is a ValueError
        raise CorruptCheckpoint(f"{checkpoint.name}/{TRAINER_STATE} is unreadable ({error})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CorruptCheckpoint(f"{checkpoint.name}/{TRAINER_STATE} is damaged: it records no step")
    return state


def final_step(run_dir: Path) -> int | None:
    """The step of the run's final model: the ``train.max_steps`` it was saved with, else the last step of
    ``metrics.jsonl``; ``None`` when there is no final model or neither says."""
    if not (run_dir / FINAL).is_dir():
        return None
    try:
        step = json.loads((run_dir / FINAL / TRAINING_ARGS).read_text(encoding="utf-8")).get("train.max_steps")
    except (OSError, ValueError, AttributeError):
        step = None
    if isinstance(step, int):
        return step
    steps = [r["step"] for r in read_jsonl(run_dir / METRICS) if isinstance(r, dict) and isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def rewound_dir(run_dir: Path, reached: int) -> Path:
    return run_dir / REWOUND.format(reached)


def set_aside_rewound(run_dir: Path, start_step: int, reached: int) -> Path:
    """Moves what a run resumed at ``start_step`` would replace of the history that reached step ``reached`` into
    :func:`rewound_dir` (which must not exist): ``final/`` and every checkpoint after ``start_step``, with copies of
    the run's metrics, arguments and loss curve (which the resumed run cuts back and rewrites)."""
    aside = rewound_dir(run_dir, reached)
    aside.mkdir()
    for name in (METRICS, TRAINING_ARGS, LOSS_CURVE):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, aside / name)
    if (run_dir / FINAL).exists():
        os.replace(run_dir / FINAL, aside / FINAL)
    checkpoints = run_dir / CHECKPOINTS
    later = [p for p in checkpoints.iterdir() if (checkpoint_step(p) or 0) > start_step] if checkpoints.is_dir() else []
    if later:
        (aside / CHECKPOINTS).mkdir()
        for path in sorted(later, key=checkpoint_step):
            os.replace(path, aside / CHECKPOINTS / path.name)
    return aside
