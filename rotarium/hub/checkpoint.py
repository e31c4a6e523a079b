"""What the Hub tools read from a checkpoint folder, and the check that a folder is a rotarium checkpoint.

A checkpoint is a folder written by ``save_pretrained`` of a rotarium model: ``config.json`` with a
``rotarium_*`` model type and the weights (``model.safetensors``, a sharded ``model.safetensors.index.json``, or
``pytorch_model.bin`` / its index). Optional files, used when present:

- tokenizer files (:data:`TOKENIZER_FILES`) and ``generation_config.json``, in the checkpoint folder;
- training metadata, in the checkpoint folder or else its parent (a run folder holding ``checkpoint-*/`` or
  ``final/``), or the run folder of ``rotarium train``'s ``<run>/checkpoints/step-<N>/``:
  ``training_args.json`` (one JSON object; ``dataset`` or ``dataset_name`` is a Hub dataset id, ``tokens`` /
  ``total_tokens`` / ``tokens_seen`` / ``max_tokens`` the number of training tokens; every scalar entry is listed
  in the card) and ``metrics.jsonl`` (one JSON object a line; the last line's ``tokens`` / ``tokens_seen``,
  ``step`` and ``loss`` are reported);
- the step the weights were saved at, for a checkpoint taken during a run: ``trainer_state.json`` in the checkpoint
  folder (``step`` and ``tokens`` as ``rotarium train`` writes them, ``global_step`` and ``num_input_tokens_seen``
  as transformers' Trainer does), else the folder's name (``step-<N>``, ``checkpoint-<N>``). The run's
  ``metrics.jsonl`` goes on after the checkpoint, and its ``training_args.json`` totals are the run's plan, so the
  card then reports the records up to that step and the tokens the checkpoint saw, never the run's later ones;
- evaluation results, in ``eval/`` in the checkpoint folder or else its parent: every ``*.json`` there is a
  table (a list of flat objects, e.g. ``[{"context_length": 2048, "perplexity": 17.3}]``; an object with a
  ``rows`` list; an object of equal-length columns; or one flat object), titled by its file name (for example
  ``eval/perplexity.json``), and every ``*.png`` a plot, copied into the export and shown in the card.

Export never reads through a symbolic link that leaves the folder it is in (the checkpoint folder, or the run folder
the metadata is found in): a link to a private file would publish it. Such a link is refused with a ``ValueError``
naming it; links inside the folder, and those of a real Hugging Face cache snapshot into its own repository's
``blobs/`` (checked on resolved paths, :mod:`rotarium.hub.paths`), are followed.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub.utils import HFValidationError, validate_repo_id

from rotarium.data.config import DataSection
from rotarium.data.documents import LOCAL_FORMATS
from rotarium.data.prepared import METADATA, is_prepared
from rotarium.hub.paths import confined
from rotarium.models import CONFIGS
from rotarium.models.loading import TRAINER_STATE, check_one_weights_layout
from rotarium.utils.files import read_jsonl

MODEL_TYPES = {config.model_type: family for family, config in CONFIGS.items()}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
TRAINING_ARGS = "training_args.json"
METRICS = "metrics.jsonl"
EVAL_DIR = "eval"
DATASET_KEYS = ("dataset", "dataset_name")
SOURCE_KEY = "data.source"  # rotarium train's, in training_args.json
TOKEN_KEYS = ("tokens", "total_tokens", "tokens_seen", "max_tokens", "train_tokens")
STEP_KEYS = ("step", "global_step")  # rotarium train's trainer_state.json, transformers' Trainer's
STATE_TOKEN_KEYS = ("tokens", "num_input_tokens_seen")
PLANNED_STEP_KEYS = ("train.max_steps", "max_steps")  # the run's last step, in training_args.json
CHECKPOINT_NAME = re.compile(r"(?:step|checkpoint)-(\d+)")


@dataclass
class Checkpoint:
    """A validated checkpoint folder and the optional metadata found with it."""

    path: Path
    config: dict[str, Any]
    family: str
    tokenizer_files: list[Path] = field(default_factory=list)
    training_args: dict[str, Any] | None = None
    last_metrics: dict[str, Any] | None = None  # the last record with a training loss
    last_validation: dict[str, Any] | None = None  # the last record with a validation loss
    eval_tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    eval_plots: list[Path] = field(default_factory=list)
    step: int | None = None  # the step of a checkpoint taken during a run; None for a final model
    state_tokens: int | None = None  # the tokens its trainer state says it was trained on

    @property
    def has_tokenizer(self) -> bool:
        return any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
                   for p in self.tokenizer_files)

    @property
    def datasets(self) -> list[str]:
        """Hub dataset ids the training metadata names: its ``dataset`` keys (transformers' Trainer's), else the
        ``data.source`` of ``rotarium train`` where that is a Hub id, or a prepared folder, still on this machine,
        that ``rotarium prepare`` made from one (as every recipe trains)."""
        args = self.training_args or {}
        for key in DATASET_KEYS:
            value = args.get(key)
            values = [value] if isinstance(value, str) else value
            if isinstance(values, list) and values and all(isinstance(v, str) and v for v in values):
                return [v for v in values if is_hub_id(v)]
        source = args.get(SOURCE_KEY)
        if not isinstance(source, str) or source == DataSection().source:
            return []
        if is_prepared(source):
            try:
                source = json.loads((Path(source) / METADATA).read_text(encoding="utf-8"))["settings"]["source"]
            except (OSError, ValueError, KeyError, TypeError):  # unfinished or damaged: nothing to name
                return []
        return [source] if isinstance(source, str) and is_hub_id(source) else []

    @property
    def training_tokens(self) -> int | None:
        if self.state_tokens is not None:
            return self.state_tokens
        args = self.training_args or {}
        if self.step is not None and not any(args.get(key) == self.step for key in PLANNED_STEP_KEYS):
            args = {}  # the totals of a run that went on past this checkpoint (max_tokens: what it planned)
        for source in (self.last_metrics or {}, args):
            for key in TOKEN_KEYS:
                value = source.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    return int(value)
        return None


def is_hub_id(value: str) -> bool:
    """Whether ``value`` is a Hub repository id (``name`` or ``namespace/name``, of the Hub's characters only) and
    no local path: only such a value may become a link or metadata in a published card."""
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return not looks_like_local_path(value)


def looks_like_local_path(value: str) -> bool:
    """Whether ``value`` names a local file or folder rather than a Hub id (``name`` or ``namespace/name``): it is
    absolute (``/x``, ``~/x``, ``C:\\x``, ``\\\\host\\x``), dot-relative (``./x``), a path of more than two parts
    without spaces (``runs/a/final``; text with spaces, such as a prompt, is not a path), a data file
    (``data/corpus.jsonl``), or exists here."""
    return (value.startswith(("/", "~", "./", "../", "\\\\")) or re.match(r"[A-Za-z]:[\\/]", value) is not None
            or (value.count("/") > 1 and not any(c.isspace() for c in value))
            or (os.path.splitext(value)[1] in LOCAL_FORMATS and " " not in value) or os.path.exists(value))


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{what} {path} is not readable JSON: {error}") from None


def _find(checkpoint: Path, name: str) -> Path | None:
    folders = [checkpoint, checkpoint.parent]
    if checkpoint.parent.name == "checkpoints":  # `rotarium train`'s <run>/checkpoints/step-<N>/: the run folder
        folders.append(checkpoint.parent.parent)
    for folder in folders:
        if (folder / name).exists() or (folder / name).is_symlink():
            return confined(folder / name, folder)
    return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _checkpoint_step(path: Path) -> tuple[int | None, int | None]:
    """``(step, tokens)`` of a checkpoint taken during a run (see the module docstring), ``None`` where unknown."""
    if (path / TRAINER_STATE).is_file():
        state = _read_json(path / TRAINER_STATE, "trainer state")
        state = state if isinstance(state, dict) else {}
        steps = [_count(state.get(key)) for key in STEP_KEYS]
        tokens = [_count(state.get(key)) for key in STATE_TOKEN_KEYS]
        step = next((s for s in steps if s is not None), None)
        if step is not None:
            return step, next((t for t in tokens if t), None)
    match = CHECKPOINT_NAME.fullmatch(path.name)
    return (int(match.group(1)) if match else None), None


def _final_then_newest(folder: Path) -> tuple[bool, int, str]:
    match = CHECKPOINT_NAME.fullmatch(folder.name)
    return folder.name != "final", -int(match.group(1)) if match else 1, str(folder)


def table_rows(data: Any) -> list[dict[str, Any]] | None:
    """The rows of an evaluation table in any of the accepted layouts, or None when ``data`` is not a table."""
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        data = data["rows"]
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) == 1:
            data = [dict(zip(data, values)) for values in zip(*data.values())]
    if isinstance(data, dict):
        data = [data]
    if (isinstance(data, list) and data and all(isinstance(r, dict) for r in data)
            and all(not isinstance(v, (dict, list)) for r in data for v in r.values())):
        return data
    return None


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Validates ``path`` as a rotarium checkpoint (``ValueError`` saying what is missing) and collects the
    optional metadata described in this module's docstring."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a folder; pass the folder written by save_pretrained "
                         "(it holds config.json and the weights)")
    for entry in sorted(path.iterdir()):  # what export reads or copies: the files at the top (weights, tokenizer)
        if not entry.is_dir():
            confined(entry, path)
    if not (path / "config.json").is_file():
        # a run folder (<run>/final/, <run>/checkpoints/step-<N>/, a Trainer's <run>/checkpoint-<N>/) holds them
        inside = sorted({c.parent for c in (*path.glob("*/config.json"), *path.glob("*/*/config.json"))},
                        key=_final_then_newest)
        hint = (f"; pass one of the checkpoints in it: {', '.join(map(str, inside[:3]))}"
                f"{f' ({len(inside) - 3} more)' if len(inside) > 3 else ''}") if inside else ""
        raise ValueError(f"{path} is not a rotarium checkpoint: it has no config.json (a save_pretrained folder "
                         f"holds config.json and model.safetensors){hint}")
    config = _read_json(path / "config.json", "config")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path} is not a rotarium checkpoint: config.json has model_type {model_type!r}, "
                         f"expected one of {sorted(MODEL_TYPES)}")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{path} is not a rotarium checkpoint: no weights (expected one of {list(WEIGHT_FILES)})")
    check_one_weights_layout(path)
    step, state_tokens = _checkpoint_step(path)
    checkpoint = Checkpoint(path=path, config=config, family=MODEL_TYPES[model_type], step=step,
                            state_tokens=state_tokens,
                            tokenizer_files=[path / n for n in TOKENIZER_FILES if (path / n).is_file()])
    if (args_path := _find(path, TRAINING_ARGS)) is not None:
        args = _read_json(args_path, "training metadata")
        checkpoint.training_args = args if isinstance(args, dict) else None
    if (metrics_path := _find(path, METRICS)) is not None:
        records = [r for r in read_jsonl(metrics_path) if isinstance(r, dict)
                   and (step is None or _count(r.get("step")) is None or r["step"] <= step)]
        # the run's last records are its final validation, then (with a trailing evaluation) other events
        checkpoint.last_metrics = next((r for r in reversed(records) if "loss" in r), None)
        checkpoint.last_validation = next((r for r in reversed(records) if "val_loss" in r), None)
    eval_dir = _find(path, EVAL_DIR)
    if eval_dir is not None and eval_dir.is_dir():
        for entry in sorted(eval_dir.iterdir()):
            confined(entry, eval_dir.parent)
        for table in sorted(eval_dir.glob("*.json")):
            rows = table_rows(_read_json(table, "evaluation table"))
            if rows is not None:
                checkpoint.eval_tables[table.stem] = rows
        checkpoint.eval_plots = sorted(eval_dir.glob("*.png"))
    return checkpoint
