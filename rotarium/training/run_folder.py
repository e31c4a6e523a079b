"""The run folder of ``rotarium train``: its layout, the checkpoints in it, and how a checkpoint is published.

A run folder holds::

    tokenizer/                      the tokenizer (trained once, reused on resume)
    checkpoints/step-<N>/           state/ (accelerate: weights, optimizer, RNG), a save_pretrained model and
                                    tokenizer, trainer_state.json (with the verdict ``good``), checksums.json (the
                                    size and SHA-256 of every other file), and COMPLETE, written last
    final/                          the final model and tokenizer (+ eval/ after `rotarium eval`)
    metrics.jsonl                   one JSON object per logged step / evaluation
    training_args.json, loss_curve.png
    data-order/                     a prepared folder's epoch orders when large (rotarium.data.batches.EpochOrder),
                                    memory-mapped by every process instead of held; a cache, rebuilt when missing
    .lock                           while a run holds the folder (:mod:`rotarium.training.lock`)
    .replacing/                     while a run that starts from step 0 is set up: its new tokenizer, moved into
                                    place once the run has its config, data and model
    previous/                       while an ``--overwrite`` run has no checkpoint yet: the run it replaces
    rewound-from-step-<N>/          what a ``--resume --allow-rewind`` replaced of a run that had reached step N:
                                    its final/, the checkpoints after the one resumed from, and copies of its
                                    metrics.jsonl, training_args.json and loss_curve.png

A checkpoint is written into a hidden ``.<name>.tmp`` folder and renamed into place, and only folders with
``COMPLETE`` are resumed from, so a run killed while saving never leaves a checkpoint that ``--resume`` would pick
up broken; ``checksums.json`` catches a file damaged after that (a full disk, a copy cut short).

A run writes only into a folder that is new, empty (but for the lock and staging of a run killed before it wrote
anything) or a run folder (:func:`is_run_folder`): any other folder, a prepared corpus given as ``--output-dir`` or a
user's folder that happens to hold a ``tokenizer/``, is refused before the lock is taken (:func:`check_output_folder`),
since ``--overwrite`` and a run's own files (``tokenizer/``, ``final/``...) would replace what is there. A run marks
its folder as a run (``training_args.json``) before it moves anything else into it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rotarium.models.loading import CHECKSUMS, TRAINER_STATE, CorruptCheckpoint, verify_checkpoint
from rotarium.training.lock import LOCK, RunLock
from rotarium.training.metrics import append_record, plot_loss_curve, truncate_metrics
from rotarium.utils.files import (
    copy_file,
    file_sha256,
    fsync_tree,
    make_folder,
    read_jsonl,
    replace_folder,
    write_json_atomic,
    write_text_atomic,
)

logger = logging.getLogger(__name__)

TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
FINAL = "final"
EVAL = "eval"
METRICS = "metrics.jsonl"
TRAINING_ARGS = "training_args.json"
LOSS_CURVE = "loss_curve.png"
ACCELERATE_STATE = "state"
COMPLETE = "COMPLETE"
PREVIOUS = "previous"
REPLACING = ".replacing"  # what an --overwrite run writes before the old run is set aside (its tokenizer)
REWOUND = "rewound-from-step-{}"
DATA_ORDER = "data-order"
# What `--overwrite` deletes: everything a run writes, nothing else the user keeps in the folder.
RUN_FILES = (CHECKPOINTS, FINAL, TOKENIZER, METRICS, TRAINING_ARGS, LOSS_CURVE, DATA_ORDER)


# What only a run writes into its folder (training_args.json first), or an --overwrite sets aside: a folder with one
# of them is a run folder.
RUN_MARKERS = (TRAINING_ARGS, METRICS, CHECKPOINTS, FINAL, PREVIOUS)


def holds_run(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINTS).exists() or (run_dir / FINAL).exists()


def is_run_folder(run_dir: Path) -> bool:
    """Whether ``run_dir`` was written by a run (:data:`RUN_MARKERS`), with or without a checkpoint yet."""
    return any((run_dir / name).exists() for name in RUN_MARKERS)


def check_output_folder(run_dir: Path) -> None:
    """Raises ``ValueError`` naming the folder and what works unless a run may write into ``run_dir``: it does not
    exist, is empty (but for the lock and staging a run killed before it wrote anything leaves), or is a run folder
    (:func:`is_run_folder`). Nothing is touched."""
    if not run_dir.is_dir() or is_run_folder(run_dir):
        return
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir() if p.name not in (LOCK, REPLACING))
    if not others:
        return
    held = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
    prepared = (" (a prepared corpus: give it as --data.source, not --output-dir)"
                if (run_dir / "metadata.json").is_file() else "")
    raise ValueError(f"--output-dir {run_dir} is not a run folder and not empty: it holds {held}{prepared}; a run "
                     "writes only into a new or empty folder or into a run's own folder (--resume continues it, "
                     "--overwrite replaces it), so choose another --output-dir")


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
    record = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    write_json_atomic(folder / CHECKSUMS, {"algorithm": "sha256", "files": record})
    write_text_atomic(folder / COMPLETE, f"{step}\n")


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


def _named_checkpoint(run_dir: Path, name: str) -> Path:
    step = checkpoint_step(Path(name if name.startswith("step-") else f"step-{name}"))
    complete = complete_checkpoints(run_dir)
    path = checkpoint_dir(run_dir, step) if step is not None else None
    if path not in complete:
        names = ", ".join(p.name for p in complete) or "none"
        raise ValueError(f"--resume-from {name}: no complete checkpoint of that name in {run_dir / CHECKPOINTS} "
                         f"(complete ones: {names})")
    return path


def choose_checkpoint(run_dir: str | os.PathLike, name: str | None = None, at_most: int | None = None
                      ) -> Path | None:
    """The checkpoint ``--resume`` continues from: ``name`` (``step-N`` or ``N``) when given, else the newest
    complete checkpoint (of a step up to ``at_most``, when given) that passes its checksums and is good, with a
    warning naming each newer one it skips; ``None`` when the run has no such complete checkpoint. A checkpoint
    without checksums (written before they were recorded) is used unverified, with a warning. Raises ``ValueError``
    when ``name`` does not verify or when every complete checkpoint is corrupt or not good."""
    run_dir = Path(run_dir)
    if name is not None:
        checkpoint = _named_checkpoint(run_dir, name)
        try:
            verified = verify_checkpoint(checkpoint)
            state = read_trainer_state(checkpoint)
        except CorruptCheckpoint as error:
            raise ValueError(f"--resume-from {name}: {error}; choose another checkpoint") from error
        if not verified:
            logger.warning("--resume-from %s: it has no checksums (written by an older rotarium); loading it "
                           "unverified", name)
        if not state.get("good", True):
            logger.warning("--resume-from %s: not a good checkpoint (%s); resuming from it as asked", name,
                           state.get("why_not_good", "?"))
        return checkpoint
    skipped = []
    for checkpoint in reversed(complete_checkpoints(run_dir)):
        if at_most is not None and checkpoint_step(checkpoint) > at_most:
            continue
        try:
            verified = verify_checkpoint(checkpoint)
            state = read_trainer_state(checkpoint)
        except (OSError, ValueError) as error:  # CorruptCheckpoint and a JSON error are ValueErrors
            skipped.append(f"{checkpoint.name} (corrupt: {error})")
            continue
        if not state.get("good", True):
            skipped.append(f"{checkpoint.name} (not good: {state.get('why_not_good', '?')}; --resume-from "
                           f"{checkpoint.name} takes it anyway)")
            continue
        if not verified:
            logger.warning("--resume: %s has no checksums (written by an older rotarium); loading it unverified",
                           checkpoint.name)
        if skipped:
            logger.warning("--resume: skipped %s; resuming from %s", "; ".join(skipped), checkpoint.name)
        return checkpoint
    if skipped:
        raise ValueError(f"--resume: no usable checkpoint in {run_dir / CHECKPOINTS}: {'; '.join(skipped)}; or "
                         "--overwrite to start over")
    return None


def _describe_reached(run_dir: Path, reached: int, final: int | None) -> str:
    return f"its final model {run_dir / FINAL}" if final == reached else f"checkpoint step-{reached}"


def check_rewind(run_dir: str | os.PathLike, checkpoint: Path | None, max_steps: int, *, named: bool,
                 allow: bool) -> int | None:
    """Whether resuming the run in ``run_dir`` from ``checkpoint`` (``None``: from step 0) up to ``max_steps`` goes
    back on work the run has done: ends before the last step it reached (its final model's or newest
    checkpoint's), or continues a finished run from a checkpoint ``named`` by ``--resume-from`` that is older than
    its newest good one (the one ``--resume`` continues, which redoes the steps after it). Such a rewind would
    replace ``final/`` and later checkpoints with other weights and cut ``metrics.jsonl`` back, so it raises
    ``ValueError`` (naming the step reached and ``--init-from``, which starts a new run from older weights) unless
    ``allow`` (``--allow-rewind``). Returns the step reached when it is an allowed rewind (what it replaces is then
    set aside, :func:`rotarium.training.run_folder.set_aside_rewound`), else ``None``."""
    run_dir = Path(run_dir)
    start = checkpoint_step(checkpoint) if checkpoint is not None else 0
    checkpoints = [checkpoint_step(p) for p in complete_checkpoints(run_dir)]
    newest = max(checkpoints, default=0)
    final = final_step(run_dir)
    finished = (run_dir / FINAL).is_dir()
    reached = max(newest, final or 0)
    usable = [s for s in checkpoints if s <= max_steps]
    older = checkpoint_dir(run_dir, max(usable)) if usable else run_dir / CHECKPOINTS / "step-N"
    good = latest_good_checkpoint(run_dir) if finished and named else None
    newest_good = checkpoint_step(good) if good is not None else 0
    if max_steps < reached:
        problem = (f"has reached step {reached} ({_describe_reached(run_dir, reached, final)}), and --max-steps "
                   f"{max_steps} would take it back")
    elif start < newest_good:
        older = checkpoint
        problem = (f"is finished (its final model {run_dir / FINAL}{f' is at step {final}' if final else ''}), "
                   f"and resuming it from {checkpoint.name} would take it back past its newest good checkpoint "
                   f"step-{newest_good}")
    else:
        return None
    aside = rewound_dir(run_dir, reached)
    if not allow:
        raise ValueError(f"--resume: the run in {run_dir} {problem}, replacing {'its final/ and ' if finished else ''}"
                         f"its later checkpoints with other weights and cutting metrics.jsonl back to step {start}. "
                         f"To train a new run from older weights, pass --init-from {older} with another --output-dir; "
                         f"to rewind this run, pass --allow-rewind (what it replaces is then kept in {aside})")
    if start > max_steps:  # a named checkpoint: an allowed rewind otherwise looks no further than max_steps
        raise ValueError(f"--resume-from {checkpoint.name} is past --max-steps {max_steps}; resume from a checkpoint "
                         f"at or before step {max_steps}, or raise --max-steps")
    if aside.exists():
        raise ValueError(f"--allow-rewind: {aside} already holds what an earlier rewind from step {reached} set "
                         "aside; move or delete it first")
    return reached


@dataclass(frozen=True)
class FolderPlan:
    """What a run does with its folder, decided once under the lock (:meth:`RunFolder.plan`)."""
    checkpoint: Path | None = None  # the checkpoint it resumes from; None: it starts at step 0
    replacing: bool = False  # an --overwrite of the run in the folder
    rewind_from: int | None = None  # an allowed rewind: the step the run had reached


class RunFolder:
    """The life of one run folder, from the lock to the last checkpoint: the one place that decides what is
    written where in it. The main process holds the lock and acts; the methods do nothing in the other processes of
    a launch (``main=False``), so that every process can call them at the same points of the loop.

    A run: :meth:`lock`, :meth:`plan` (which checkpoint to resume, whether an ``--overwrite`` replaces a run, whether
    a rewind is allowed), :meth:`begin` once its config, data and model are ready (the old run or the rewound
    history set aside), :meth:`start_log`, :meth:`log` per record, :meth:`stage` and :meth:`publish` per checkpoint
    (written, verified, renamed into place, pruned), :meth:`write_loss_curve`, :meth:`release`. :meth:`abandon` on
    a failure puts a replaced run back while this run has no checkpoint yet."""

    def __init__(self, path: str | os.PathLike, main: bool = True):
        self.path, self.main = Path(path), main
        self._lock: RunLock | None = None
        self._previous_pending = False  # an --overwrite's old run waits in previous/ for this run's first checkpoint

    # -------------------------------------------------------------------------------------------------- layout
    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def final(self) -> Path:
        return self.path / FINAL

    def checkpoint(self, step: int) -> Path:
        return checkpoint_dir(self.path, step)

    @property
    def data_order(self) -> Path:
        return self.path / DATA_ORDER

    def tokenizer_home(self, plan: FolderPlan) -> Path:
        """Where the run's ``tokenizer/`` is read or written: a run that continues a checkpoint reads the folder's;
        one that starts from step 0 writes its own apart (``.replacing/``) until :meth:`begin` (an ``--overwrite``
        must not reuse the old run's, and a run stopped during its set-up leaves nothing in the folder)."""
        return self.path if plan.checkpoint is not None else self.path / REPLACING

    def latest_good_checkpoint(self) -> Path | None:
        return latest_good_checkpoint(self.path)

    # -------------------------------------------------------------------------------------------- lock and plan
    def lock(self) -> None:
        """Takes the folder's lock (:class:`~rotarium.training.lock.RunLock`), creating the folder if needed; a
        folder that is not one a run may write into is refused first (:func:`check_output_folder`)."""
        check_output_folder(self.path)
        try:
            self._lock = RunLock(self.path)
        except OSError as error:  # a special or read-only file system that the permission bits do not show
            why = f"{error.strerror or error}: {error.filename or self.path}"
            raise ValueError(f"--output-dir {self.path} cannot be created or written ({why}); choose a folder on a "
                             "writable file system") from None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def plan(self, *, resume: bool, overwrite: bool, resume_from: str | None, allow_rewind: bool,
             max_steps: int) -> FolderPlan:
        """What this run does with the folder (under the lock). ``resume``: the checkpoint
        :func:`choose_checkpoint` picks, checked by :func:`check_rewind`; otherwise the folder must hold no run, or
        ``overwrite`` replaces the one it holds (refused while an earlier ``--overwrite``'s ``previous/`` holds
        another)."""
        previous = self.path / PREVIOUS
        if allow_rewind and not resume:
            raise ValueError("--allow-rewind applies to --resume only")
        if resume:
            checkpoint = choose_checkpoint(self.path, resume_from, at_most=max_steps if allow_rewind else None)
            rewind_from = check_rewind(self.path, checkpoint, max_steps, named=resume_from is not None,
                                       allow=allow_rewind)
            if checkpoint is None:
                shutil.rmtree(self.path / REPLACING, ignore_errors=True)  # what a run killed during its set-up staged
                logger.warning("--resume: no complete checkpoint in %s%s; starting from step 0%s", self.path,
                               f" at or before step {max_steps}" if allow_rewind else "",
                               f" ({previous} holds the run an --overwrite set aside)" if previous.exists() else "")
            return FolderPlan(checkpoint=checkpoint, rewind_from=rewind_from)
        shutil.rmtree(self.path / REPLACING, ignore_errors=True)  # what a run killed during its set-up staged
        if not holds_run(self.path):
            if previous.exists():
                logger.warning("%s holds the run an earlier --overwrite set aside (that run was stopped before its "
                               "first checkpoint); it is kept: delete it, or move it back, yourself", previous)
            return FolderPlan()
        if not overwrite:
            raise ValueError(f"--output-dir {self.path} already holds a run; pass --resume to continue it, "
                             "--overwrite to start over, or choose another --output-dir")
        if previous.exists():
            raise ValueError(f"--overwrite: {previous} holds a run an earlier --overwrite set aside, and "
                             f"{self.path} holds another; delete one (or move {previous}'s files back) first")
        return FolderPlan(replacing=True)

    # --------------------------------------------------------------------------------------- begin and abandon
    def begin(self, plan: FolderPlan, start_step: int, training_args: dict[str, Any]) -> None:
        """Once the run has its config, data and model: an ``--overwrite`` sets the old run aside in ``previous/``;
        an allowed rewind sets aside what it replaces (:func:`set_aside_rewound`); a run from step 0 writes its
        ``training_args.json``, which marks the folder as a run, then moves its own tokenizer in."""
        if not self.main:
            return
        if plan.replacing:
            set_aside_run(self.path)
            self._previous_pending = True
            logger.warning("--overwrite: the run in %s is moved to %s until this run writes its first checkpoint",
                           self.path, self.path / PREVIOUS)
        if plan.rewind_from is not None:
            aside = set_aside_rewound(self.path, start_step, plan.rewind_from)
            logger.warning("--allow-rewind: the run goes back from step %d to step %d; its final model, later "
                           "checkpoints and metrics up to step %d are kept in %s", plan.rewind_from, start_step,
                           plan.rewind_from, aside)
        if plan.checkpoint is None:
            write_json_atomic(self.path / TRAINING_ARGS, training_args)
            staged = self.tokenizer_home(plan) / TOKENIZER
            if (self.path / TOKENIZER).exists():
                logger.warning("%s is replaced by a tokenizer built from this run's config: the run starts from step "
                               "0, and only a run that continues a checkpoint reuses the folder's tokenizer",
                               self.path / TOKENIZER)
            replace_folder(staged, self.path / TOKENIZER)
            shutil.rmtree(self.tokenizer_home(plan), ignore_errors=True)

    def abandon(self) -> None:
        """The run stopped with an error: while it has no checkpoint, the run it was replacing comes back, and what
        it staged for the replacement is removed."""
        if self._previous_pending:
            restore_previous_run(self.path)
            self._previous_pending = False
            logger.warning("--overwrite: this run stopped before its first checkpoint; the previous run is back in %s",
                           self.path)
        if self._lock is not None:  # under the lock, whatever an --overwrite staged is this run's
            shutil.rmtree(self.path / REPLACING, ignore_errors=True)

    # ----------------------------------------------------------------------------------------------- metrics
    def start_log(self, start_step: int, training_args: dict[str, Any]) -> None:
        """``metrics.jsonl`` cut back to ``start_step`` (what a killed run logged after its checkpoint goes) and
        ``training_args.json`` written."""
        if self.main:
            self.path.mkdir(parents=True, exist_ok=True)
            truncate_metrics(self.metrics, start_step)
            write_json_atomic(self.path / TRAINING_ARGS, training_args)

    def log(self, record: dict[str, Any]) -> None:
        if self.main:
            append_record(self.metrics, record)

    def write_loss_curve(self) -> None:
        """``loss_curve.png``, with a copy in the final model's ``eval/``."""
        if self.main:
            plot_loss_curve(self.metrics, self.path / LOSS_CURVE)
            copy_file(self.path / LOSS_CURVE, make_folder(self.final / EVAL, inside=self.path) / LOSS_CURVE)

    # ----------------------------------------------------------------------------------------------- saving
    def stage(self, target: Path) -> Path:
        """The empty staging folder (:func:`staging_folder`) the processes write ``target`` into."""
        staged = staging_folder(target)
        if self.main:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        return staged

    def discard(self, staged: Path) -> None:
        """Removes a staging folder that will not be published (its writing failed)."""
        if self.main:
            shutil.rmtree(staged, ignore_errors=True)

    def publish(self, staged: Path, target: Path, *, step: int | None = None, state: dict[str, Any] | None = None,
                keep: int = 1) -> None:
        """Puts the written ``staged`` folder in place as ``target``: a checkpoint of ``step`` first gets its
        trainer ``state``, checksums and ``COMPLETE`` (:func:`mark_complete`) and afterwards the older checkpoints
        beyond ``keep`` are pruned. The first one published ends an ``--overwrite``'s wait: the old run goes."""
        if not self.main:
            return
        if step is not None:
            mark_complete(staged, step, state or {})
        replace_folder(staged, target)
        if self._previous_pending:
            drop_previous_run(self.path)
            self._previous_pending = False
        if step is not None:
            prune_checkpoints(self.path, keep)
