"""What ``--resume`` checks before it continues a run: which checkpoint to continue from (complete, verified against
its checksums, good), that the config is the run's own, and that the launch can load its state.

The number of processes may change on resume: a step's batch is a function of ``(seed, step)`` and
``train.global_batch_size`` fixes its size, so with it set one process with two micro-batches continues a
two-process run. Sharding may not: an FSDP checkpoint's weights and optimizer state are shards
(``state/pytorch_model_fsdp_0/``) that only an FSDP launch reads, and a checkpoint saved without FSDP holds whole
tensors that an FSDP launch does not read.

Which settings may differ from the run's on resume:

- freely (:data:`SAFE_ON_RESUME`): ``train.max_steps``, the logging, evaluation and checkpoint intervals, the
  guard's settings, trackers and threads, ``model.gradient_checkpointing`` and the ``eval`` section; none of them
  changes the model or the data it sees;
- with ``--allow-config-change KEY``: the ``data`` and ``optim`` sections and the other ``train`` keys (a moved
  corpus file, a lower learning rate after a blow-up);
- never (:data:`FIXED_ON_RESUME`): the ``model`` section (its weights are the checkpoint's, and a changed size or
  option would not fit them or would silently change what they compute) and the ``tokenizer`` section (the run's
  saved tokenizer is what the ids mean). A run with other such settings is a new run: ``--init-from`` a checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from rotarium.training.config import Config, field_types, flatten
from rotarium.training.run_folder import (
    ACCELERATE_STATE,
    CHECKPOINTS,
    FINAL,
    TRAINING_ARGS,
    CorruptCheckpoint,
    checkpoint_dir,
    checkpoint_step,
    complete_checkpoints,
    final_step,
    latest_good_checkpoint,
    read_trainer_state,
    rewound_dir,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

SAFE_ON_RESUME = ("train.max_steps", "train.eval_every", "train.eval_batches", "train.save_every",
                  "train.keep_checkpoints", "train.log_every", "train.max_bad_steps", "train.spike_factor",
                  "train.spike_window", "train.report_to", "train.num_threads", "model.gradient_checkpointing",
                  "eval.")
FIXED_ON_RESUME = ("model.", "tokenizer.")


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def _policy(key: str) -> str:
    if _matches(key, SAFE_ON_RESUME):
        return "safe"
    return "fixed" if _matches(key, FIXED_ON_RESUME) else "allowable"


def config_values(config: Config) -> dict[str, Any]:
    """The config as ``section.key`` values."""
    return flatten(config.to_dict())


def saved_config(training_args: dict[str, Any]) -> dict[str, Any]:
    """The config keys of a run's ``training_args.json`` as ``section.key`` values, the lists and mappings (stored as
    JSON text) decoded; keys this version does not know are left out."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    out = {}
    for key, value in training_args.items():
        section, _, name = key.partition(".")
        if section not in sections or name not in field_types(sections[section]):
            continue
        allowed = field_types(sections[section])[name]
        if isinstance(value, str) and (list in allowed or dict in allowed) and str not in allowed:
            value = json.loads(value)
        out[key] = value
    return out


def run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The config the run in ``run_dir`` last started with (its ``training_args.json``), as ``section.key`` values;
    empty when there is none. ``--resume`` without ``--config`` starts from it."""
    path = Path(run_dir) / TRAINING_ARGS
    if not path.is_file():
        return {}
    try:
        return saved_config(json.loads(path.read_text()))
    except ValueError as error:
        raise ValueError(f"--resume: {path} is unreadable ({error}); pass the run's settings with --config") from None


class _Unset:
    def __repr__(self) -> str:
        return "(unset)"


_UNSET = _Unset()


def _differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``key -> (old, new)`` for every key whose value differs, a mapping (``model.options``) key by key. Keys the
    run did not record (added to rotarium since) are not compared."""
    out = {}
    for key in old.keys() & new.keys():
        a, b = old[key], new[key]
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(a.keys() | b.keys()):
                if a.get(sub, _UNSET) != b.get(sub, _UNSET):
                    out[f"{key}.{sub}"] = (a.get(sub, _UNSET), b.get(sub, _UNSET))
        elif a != b:
            out[key] = (a, b)
    return out


def check_allowed_keys(allowed: set[str]) -> None:
    """Each ``--allow-config-change`` key is a config key that may change on resume."""
    known = {f"{section}.{name}" for section, cls in ((f.name, f.default_factory) for f in dataclasses.fields(Config))
             for name in field_types(cls)}
    for key in sorted(allowed):
        if key not in known and not key.startswith("model.options."):
            raise ValueError(f"--allow-config-change {key}: not a config key (see `rotarium train --help`)")
        if _policy(key) == "fixed":
            raise ValueError(f"--allow-config-change {key}: model and tokenizer settings cannot change within a run; "
                             "start a new run from the checkpoint's weights with --init-from CHECKPOINT")


def check_config(checkpoint: Path, config: Config, allowed: set[str]) -> None:
    """Refuses to resume ``checkpoint`` with a config that differs from the one it was trained with in a key that is
    not :data:`SAFE_ON_RESUME` (nor in ``allowed``), listing every such key with its old and new value. Logs the
    changes it lets through."""
    path = checkpoint / TRAINING_ARGS
    if not path.is_file():
        logger.warning("--resume: %s has no %s; its config cannot be compared with this one", checkpoint,
                       TRAINING_ARGS)
        return
    try:
        saved = saved_config(json.loads(path.read_text(encoding="utf-8")))
    except ValueError as error:
        raise ValueError(f"--resume: {path} is unreadable ({error}); choose another checkpoint with "
                         "--resume-from step-N") from None
    differences = _differences(saved, config_values(config))
    refused = {k: v for k, v in differences.items() if _policy(k) != "safe" and k not in allowed}
    if refused:
        listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in sorted(refused.items()))
        fixed = [k for k in refused if _policy(k) == "fixed"]
        hint = ("model and tokenizer settings are fixed for a run (a different model is a new run: --init-from "
                f"{checkpoint} fine-tunes its weights)" if fixed else "")
        if len(fixed) < len(refused):
            hint += ("; " if hint else "") + ("a data, optimiser or batch setting changes with "
                                               "--allow-config-change KEY")
        raise ValueError(f"--resume: the config differs from the one {checkpoint.name} was trained with: {listed}; "
                         f"{hint} (or pass the run's settings; without --config, --resume reads them from "
                         f"{TRAINING_ARGS})")
    for key, (old, new) in sorted(differences.items()):
        logger.warning("--resume: %s changes from %r to %r", key, old, new)
    if "train.max_steps" in differences and config.optim.schedule != "constant":
        logger.warning("--resume: train.max_steps changes, and with it the %s learning-rate schedule from step %d on",
                       config.optim.schedule, read_trainer_state(checkpoint)["step"])


FSDP_SHARDS = "pytorch_model_fsdp_0"  # where accelerate's save_state puts an FSDP model's sharded weights


def check_launch(checkpoint: Path, fsdp: bool) -> None:
    """Raises ``ValueError`` when ``checkpoint``'s accelerate state was saved with FSDP and this launch is not FSDP,
    or the other way round (see the module docstring)."""
    sharded = (checkpoint / ACCELERATE_STATE / FSDP_SHARDS).is_dir()
    if sharded and not fsdp:
        raise ValueError(f"{checkpoint} was saved by an FSDP run (its weights are shards in "
                         f"{ACCELERATE_STATE}/{FSDP_SHARDS}/); resume it under an FSDP launch (`accelerate launch "
                         "--config_file rotarium/configs/accelerate/fsdp_gpu.yaml` or fsdp_cpu.yaml), or start a new "
                         f"run from its consolidated weights with --init-from {checkpoint}")
    if fsdp and not sharded:
        raise ValueError(f"{checkpoint} was saved without FSDP; resume it without FSDP (one process or a DDP "
                         f"config), or start an FSDP run from its weights with --init-from {checkpoint}")


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
