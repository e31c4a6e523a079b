"""What ``--resume`` checks of the config before it continues a run: that the config is the run's own, and that the
launch can load its state. Which checkpoint it continues from (complete, verified against its checksums, good) is
the run folder's decision, :meth:`rotarium.training.run_folder.RunFolder.plan`.

The number of processes may change on resume: a step's batch is a function of ``(seed, step)`` and
``train.global_batch_size`` fixes its size, so with it set one process with two micro-batches continues a
two-process run. Sharding may not: an FSDP checkpoint's weights and optimizer state are shards
(``state/pytorch_model_fsdp_0/``) that only an FSDP launch reads, and a checkpoint saved without FSDP holds whole
tensors that an FSDP launch does not read.

Which settings may differ from the run's on resume:

- freely (:data:`SAFE_ON_RESUME`): ``train.max_steps``, the logging, evaluation and checkpoint intervals, the
  guard's settings, trackers and threads, ``train.compile``, ``model.gradient_checkpointing``, ``data.num_workers``,
  ``data.prepare``, ``data.skip_verify`` and the ``eval`` section; none of them changes the model or the data it
  sees;
- with ``--allow-config-change KEY``: the ``data`` and ``optim`` sections and the other ``train`` keys (a moved
  corpus file, a lower learning rate after a blow-up); a section's name (``--allow-config-change data``) allows
  each of its keys;
- never (:data:`FIXED_ON_RESUME`): the ``model`` section (its weights are the checkpoint's, and a changed size or
  option would not fit them or would silently change what they compute) and the ``tokenizer`` section (the run's
  saved tokenizer is what the ids mean). A run with other such settings is a new run: ``--init-from`` a checkpoint.

The data itself must be what the run trained on, or the documents it holds out for validation would be derived from
another corpus and could be documents it trained on (:mod:`rotarium.data.heldout`). A run from a prepared folder
records, in every checkpoint's data position, the folder's fingerprint and its tokenizer's SHA-256 (the position
counts sequences of that content); a run from another source records, in each checkpoint's ``training_args.json``,
the identity of its files (a Hub stream's shards) and the digest of its held-out documents. :func:`check_data`
refuses a changed source before anything is read from it, naming what changed, and the trainer compares the
held-out documents derived again with their digest; ``--allow-data-change`` goes on, warning that the held-out
documents may now overlap, and the run records the step (``changed_at_steps``). A checkpoint of an older rotarium
without these records resumes with a note that its source could not be checked. A local ``data.source`` is
recorded as its absolute path, so a resume from another working directory reads the same file (an older run's
relative path is replaced by the absolute one its held-out record names). A streaming run records each process's
place in its own part of the stream, which holds only for the same number of processes and shards
(:func:`check_stream`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rotarium.data.config import DataSection
from rotarium.data.heldout import ALLOW_FLAG, RECORD_KEY, check_source
from rotarium.training.config import Config, field_types, flatten
from rotarium.training.run_folder import ACCELERATE_STATE, TRAINING_ARGS, read_trainer_state
from rotarium.training.state import LoopCounters, SavedPart, TrainerState

if TYPE_CHECKING:
    from rotarium.data.documents import StreamShards

logger = logging.getLogger(__name__)

SAFE_ON_RESUME = ("train.max_steps", "train.eval_every", "train.eval_batches", "train.save_every",
                  "train.keep_checkpoints", "train.log_every", "train.max_bad_steps", "train.spike_factor",
                  "train.spike_window", "train.report_to", "train.num_threads", "train.compile",
                  "model.gradient_checkpointing",
                  "data.num_workers", "data.prepare", "data.skip_verify", "eval.")
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
    training_args = {**training_args, **_absolute_source(training_args)}
    for key, value in training_args.items():
        section, _, name = key.partition(".")
        if section not in sections or name not in field_types(sections[section]):
            continue
        allowed = field_types(sections[section])[name]
        if isinstance(value, str) and (list in allowed or dict in allowed) and str not in allowed:
            value = json.loads(value)
        out[key] = value
    return out


def _absolute_source(training_args: dict[str, Any]) -> dict[str, Any]:
    """``{"data.source": absolute path}`` for a run that recorded a relative ``data.source`` (an older rotarium)
    with the absolute path its held-out record names, so that it resumes, and compares, as the file it read."""
    source, record = training_args.get("data.source"), training_args.get(RECORD_KEY)
    held = record.get("source") if isinstance(record, dict) else None
    if isinstance(source, str) and isinstance(held, str) and Path(held).is_absolute() and not Path(
            source).is_absolute() and Path(held).name == Path(source).name:
        return {"data.source": held}
    return {}


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


def _is_allowed(key: str, allowed: set[str]) -> bool:
    """``key`` is named by ``--allow-config-change``, itself or by its section."""
    return key in allowed or key.partition(".")[0] in allowed


def check_allowed_keys(allowed: set[str]) -> None:
    """Each ``--allow-config-change`` key is a config key, or a section, that may change on resume."""
    sections = {f.name for f in dataclasses.fields(Config)}
    known = {f"{section}.{name}" for section, cls in ((f.name, f.default_factory) for f in dataclasses.fields(Config))
             for name in field_types(cls)}
    for key in sorted(allowed):
        if key in sections:
            if _matches(f"{key}.", FIXED_ON_RESUME):
                raise ValueError(f"--allow-config-change {key}: model and tokenizer settings cannot change within a "
                                 "run; start a new run from the checkpoint's weights with --init-from CHECKPOINT")
            continue
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
    refused = {k: v for k, v in differences.items() if _policy(k) != "safe" and not _is_allowed(k, allowed)}
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
                       config.optim.schedule, recorded_state(checkpoint).counters.step)


def recorded_state(checkpoint: Path) -> TrainerState:
    """``checkpoint``'s ``trainer_state.json`` read through the parts a run loads (:class:`TrainerState`): the loop's
    counters, and the data position as the checkpoint saved it (``parts["data"]``, a :class:`SavedPart`, empty where
    an older rotarium saved none)."""
    state = TrainerState(LoopCounters(), {"data": SavedPart()})
    state.load_state_dict(read_trainer_state(checkpoint))
    return state


def recorded_held_out(checkpoint: Path) -> tuple[Any, str]:
    """The record of the held-out documents (:mod:`rotarium.data.heldout`) in ``checkpoint``'s
    ``training_args.json`` (None when it has none), and that file's path."""
    path = checkpoint / TRAINING_ARGS
    try:
        args = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, str(path)
    return (args.get(RECORD_KEY) if isinstance(args, dict) else None), str(path)


def check_data(checkpoint: Path, cfg: DataSection, now: dict[str, Any] | None, allowed: set[str], *,
               allow_change: bool = False, layout: dict[str, Any] | None = None,
               stream: StreamShards | None = None) -> bool:
    """Refuses to resume ``checkpoint`` when its data source (``cfg``) is not the one it trained on, naming what
    changed; with ``allow_change`` (``--allow-data-change``) it warns and returns ``True``. A prepared folder:
    ``now`` is its ``{"prepared": fingerprint, "tokenizer": SHA-256}`` (None for another source), compared with the
    data position the checkpoint recorded. Another source: its identity (files, or a Hub stream's shards) compared
    with the one in the checkpoint's held-out record (:func:`~rotarium.data.heldout.check_source`). A streaming run
    (``layout``: the layout of its ``stream`` now, :func:`~rotarium.data.stream.stream_layout`) is also checked by
    :func:`check_stream`."""
    recorded = recorded_state(checkpoint).parts["data"].state_dict()
    if layout is not None:
        check_stream(checkpoint, recorded, layout, cfg.source, allowed)
    if now is None:
        record, where = recorded_held_out(checkpoint)
        return check_source(record, cfg, where, allow=allow_change, stream=stream, prefix="--resume: ")
    if not isinstance(recorded, dict) or not recorded.get("prepared"):
        logger.warning("--resume: %s records no identity of the prepared folder (written by an older rotarium): "
                       "whether `data.source=%s` changed since cannot be checked", checkpoint.name, cfg.source)
        return False
    changed = []
    if recorded.get("tokenizer") != now["tokenizer"]:
        changed.append(f"its tokenizer differs (SHA-256 {str(recorded.get('tokenizer'))[:12]} -> "
                       f"{now['tokenizer'][:12]})")
    if recorded["prepared"] != now["prepared"]:
        changed.append(f"its content differs (fingerprint {recorded['prepared'][:12]} -> {now['prepared'][:12]})")
    if not changed:
        return False
    what = (f"`data.source={cfg.source}` is not the prepared folder {checkpoint.name} was trained on: "
            f"{' and '.join(changed)}")
    if allow_change:
        logger.warning("--resume: %s; going on as %s allows, at the run's position (%d sequences) in the folder as "
                       "it is now: its validation split may now include documents the run trained on", what,
                       ALLOW_FLAG, recorded.get("sequences", 0))
        return True
    raise ValueError(f"--resume: {what}, so the run's position in it would point at other tokens and its validation "
                     f"split may hold documents the run trained on; point data.source at the folder the run trained "
                     f"on, or pass {ALLOW_FLAG} to go on with this one")


def check_stream(checkpoint: Path, recorded: Any, stream: dict[str, Any], source: str, allowed: set[str]) -> None:
    """A streaming run continues each process's recorded position only under the layout the positions belong to:
    as many processes, over as many shards (each process reads its own shards, or keeps its own rows of every
    shard). Another layout is refused, naming it, unless ``--allow-config-change data``, which (as a checkpoint
    without a stream position) reads the stream again from its start, with a warning."""
    old = recorded.get("stream") if isinstance(recorded, dict) else None
    if not isinstance(old, dict):
        logger.warning("--resume: %s records no position in the stream (written by an older rotarium, or by a run "
                       "that did not stream); `data.source=%s` is read again from its start", checkpoint.name, source)
        return
    if old == stream:
        return
    changed = [f"{old.get(key)} {what} -> {stream[key]}" for key, what in (("processes", "processes"),
                                                                         ("shards", "shards of the stream"))
               if old.get(key) != stream[key]]
    what = (f"{checkpoint.name} recorded each of its processes' own place in the stream, and the stream's layout "
            f"changed ({', '.join(changed)})")
    if "data" in allowed:
        logger.warning("--resume: %s; going on as --allow-config-change data allows, reading `data.source=%s` again "
                       "from its start", what, source)
        return
    raise ValueError(f"--resume: {what}; resume with {old.get('processes')} processes on the same stream, or pass "
                     "--allow-config-change data to read the stream again from its start (or train from a prepared "
                     "folder, `rotarium prepare`, whose position holds for any number of processes)")


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
