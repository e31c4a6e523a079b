"""Loading a checkpoint's weights for use, refusing weights that do not match its config.

transformers initialises a tensor the checkpoint lacks at random, drops one the model has no place for, and only
logs a report: a model loaded that way scores, generates and fine-tunes as if it were the checkpoint's. Every
command that loads a checkpoint for use (eval, generate, train's ``--init-from``, export) refuses it instead, with
the tensors named. Tied weights (the LM head sharing the embedding's) are not missing: transformers ties them
before it reports. A folder's weights are also checked against the sizes and hashes ``rotarium train`` recorded
when it wrote them (``checksums.json``), so a damaged copy whose headers still read is not used or published, and
a folder holding the weights of two saves is refused.
"""
from __future__ import annotations

import copy
import json
import pickle
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rotarium.utils.files import file_sha256

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A checkpoint's own records: its files' sizes and hashes, and the step and tokens it was saved at (as rotarium
# train writes them; transformers' Trainer writes a trainer_state.json of the same name).
CHECKSUMS = "checksums.json"
TRAINER_STATE = "trainer_state.json"
# a checkpoint's weights in any of transformers' layouts: whole, sharded with their index, safetensors or pickle
WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)"
                          r"|(model\.safetensors|pytorch_model\.bin)\.index\.json")


def is_weights_file(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint folder) is one of its weights' files."""
    return WEIGHTS_FILE.fullmatch(name) is not None


class CorruptCheckpoint(ValueError):
    """A file of a checkpoint differs from what its ``checksums.json`` recorded, or cannot be read."""


def verify_checkpoint(checkpoint: Path, only: Callable[[str], bool] | None = None) -> bool:
    """Checks every file recorded in the checkpoint's ``checksums.json`` (those ``only`` accepts, when given):
    present, of its size (all first, which is cheap), then of its SHA-256. Returns ``True`` when verified, ``False``
    for a checkpoint without the record (written before checksums were recorded, or not by ``rotarium train``), and
    raises :class:`CorruptCheckpoint` naming the first bad file. Files added later (``eval/`` of `rotarium eval`) are
    not checked."""
    path = checkpoint / CHECKSUMS
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text())["files"]
        files = {name: expected for name, expected in files.items() if only is None or only(name)}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpoint(f"{path} is unreadable ({error})") from error
    for name, expected in files.items():
        size = (checkpoint / name).stat().st_size if (checkpoint / name).is_file() else None
        if size is None:
            raise CorruptCheckpoint(f"{checkpoint.name}/{name} is missing")
        if size != expected["bytes"]:
            raise CorruptCheckpoint(f"{checkpoint.name}/{name} has {size} bytes, {expected['bytes']} were written")
    for name, expected in files.items():
        if file_sha256(checkpoint / name) != expected["sha256"]:
            raise CorruptCheckpoint(f"{checkpoint.name}/{name} does not match the SHA-256 recorded when written")
    return True


def check_one_weights_layout(folder: Path) -> None:
    """``ValueError`` when ``folder`` holds both ``model.safetensors`` and ``model.safetensors.index.json``: weights
    saved twice, sharded and whole (``save_pretrained`` leaves the other layout's files), one of them stale, and which
    is read differs (transformers loads ``model.safetensors`` first, whatever the index says)."""
    if all((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise ValueError(f"{folder} holds both model.safetensors and model.safetensors.index.json, the weights of two "
                         "saves (one of them stale: save_pretrained leaves the other layout's files); delete the "
                         "files of the one that is not the checkpoint's")


def _first(keys: Iterable[Any], shown: int = 6) -> str:
    keys = sorted(map(str, keys))
    return ", ".join(keys[:shown]) + (f", ... ({len(keys) - shown} more)" if len(keys) > shown else "")


def loading_problems(info: Mapping[str, Any]) -> list[str]:
    """What the ``info`` of ``from_pretrained(..., output_loading_info=True)`` reports wrong, each as
    ``"<n> <kind> (<first keys>)"`` (kinds: missing, unexpected, of another shape, load errors); empty when the
    weights match the config."""
    mismatched = [f"{key} {list(stored)} instead of {list(expected)}" for key, stored, expected in
                  info.get("mismatched_keys", ())]
    return [f"{len(keys)} {kind} ({_first(keys)})" for kind, keys in (
        ("missing", info.get("missing_keys", ())), ("unexpected", info.get("unexpected_keys", ())),
        ("of another shape", mismatched), ("load errors", info.get("error_msgs", ()))) if keys]


def _unreadable_weights(folder: Path) -> str | None:
    """``"<file>: <reason>"`` for the first safetensors file in ``folder`` whose header cannot be read (truncated or
    damaged), else None."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            return f"{file}: {_first_line(error)}"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_pretrained(path: str, *, flag: str, model_class: Any = None, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained(path, **kwargs)`` (``AutoModelForCausalLM`` by default) when its weights are
    whole, as written (``checksums.json``, where a local folder has one), in one layout and match its config; else
    ``ValueError`` starting with ``"<flag> <path>"``, naming the unreadable or changed file, the two layouts, or the
    missing, unexpected and misshapen tensors."""
    from safetensors import SafetensorError

    folder = Path(path)
    if folder.is_dir():
        try:
            check_one_weights_layout(folder)
        except ValueError as error:
            raise ValueError(f"{flag} {error}") from None
        try:
            verify_checkpoint(folder, only=is_weights_file)
        except CorruptCheckpoint as error:
            raise ValueError(f"{flag} {path}: {error}: the weights changed since training wrote them (a damaged disk "
                             f"or copy); copy the checkpoint again, or delete its {CHECKSUMS} to load them as they "
                             "are") from None
    if model_class is None:
        from transformers import AutoModelForCausalLM

        model_class = AutoModelForCausalLM
    try:
        # ignore_mismatched_sizes: a tensor of another shape is then reported in `info` with the others, not raised
        model, info = model_class.from_pretrained(path, output_loading_info=True, ignore_mismatched_sizes=True,
                                                  **kwargs)
    except pickle.UnpicklingError:
        # torch's own message suggests weights_only=False, which would run whatever the pickle holds
        raise ValueError(f"{flag} {path}: the weights (a pytorch_model*.bin) hold code or Python objects besides "
                         "tensors, and are not loaded: unpickling them could run that code; use a checkpoint whose "
                         "weights are safetensors") from None
    except (SafetensorError, RuntimeError) as error:
        bad = _unreadable_weights(Path(path)) if Path(path).is_dir() else None
        if bad is None:
            raise ValueError(f"{flag} {path}: the weights could not be loaded: {_first_line(error)}") from error
        raise ValueError(f"{flag} {path}: the weights could not be read ({bad}); the file is truncated or damaged: "
                         "copy or download the checkpoint again") from error
    except (OSError, ValueError) as error:
        raise ValueError(f"{flag} {path} could not be loaded as a causal LM: {_first_line(error)}") from error
    problems = loading_problems(info)
    if problems:
        raise ValueError(f"{flag} {path}: the weights do not match its config.json: {'; '.join(problems)}; loading "
                         "them would put random tensors in place of missing ones and drop unexpected ones, so they "
                         "are refused: use a checkpoint whose weights are complete")
    return model


def with_rope_parameters(model: PreTrainedModel, rope_parameters: Mapping[str, Any]) -> PreTrainedModel:
    """A copy of ``model`` whose positional layers use ``rope_parameters`` (transformers' RoPE scaling, e.g.
    ``{"rope_type": "yarn", "factor": 4}``), in eval mode on the model's device: what
    ``from_pretrained(folder, rope_parameters=...)`` gives for the saved model, without saving it. Frequencies are
    not weights, so the copy's are computed from its own config; ``ValueError`` when the scaling does not apply."""
    config = type(model.config).from_dict(model.config.to_dict(), rope_parameters=dict(rope_parameters))
    parameter = next(model.parameters())
    scaled = type(model)(config).to(device=parameter.device, dtype=parameter.dtype)
    scaled.load_state_dict(model.state_dict(), strict=True)
    # generate reads its settings (use_cache above all) from the model's, which a config rebuilt later may not match
    scaled.generation_config = copy.deepcopy(model.generation_config)
    return scaled.eval()
