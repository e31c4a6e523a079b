"""Where ``rotarium eval`` writes its results, and the check that it can, made before any work.

An evaluation under ``--rope-scaling`` measures another model than the checkpoint as trained, so its files are named
after the scaling (``perplexity.rope-yarn-x4.json`` beside the model's own ``perplexity.json``) and never replace
the unscaled results, which ``rotarium export`` puts in the model card.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SAFE = re.compile(r"[A-Za-z0-9.+_-]+")
NAMED_KEYS = ("rope_type", "type", "factor")  # named first; "type" is the legacy spelling of rope_type
LONGEST_NAME = 120  # past this the keys beyond rope_type and factor are named by a hash of the whole scaling


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


def _word(value: Any) -> str:
    """``value`` as a file-name part: a number as ``%g`` writes it, a short plain string as it is, anything else (a
    list of factors, a string with other characters) as a hash of its JSON, so that two values never share a name."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        text = f"{value:g}"
    else:
        text = value if isinstance(value, str) else ""
    return text if SAFE.fullmatch(text) and len(text) <= 32 else _digest(value)


def scaling_name(scaling: dict[str, Any]) -> str:
    """``rope-<rope_type>-x<factor>``, then ``-<key>=<value>`` for each other key given (in key order):
    ``{"rope_type": "yarn", "factor": 4}`` is ``rope-yarn-x4``. Only letters, digits and ``.+_-=`` appear."""
    parts = ["rope", _word(scaling.get("rope_type", scaling.get("type")))]
    if "factor" in scaling:
        parts.append(f"x{_word(scaling['factor'])}")
    extra = [f"{_word(key)}={_word(value)}" for key, value in sorted(scaling.items()) if key not in NAMED_KEYS]
    name = "-".join(parts + extra)
    return name if len(name) <= LONGEST_NAME else "-".join([*parts, _digest(scaling)])


def result_path(folder: str | os.PathLike, name: str, rope_scaling: dict[str, Any] | None = None) -> Path:
    """``folder/name``, or under a RoPE scaling ``folder/<stem>.<scaling_name>.<extension>``."""
    if rope_scaling is None:
        return Path(folder) / name
    stem, extension = name.rsplit(".", 1)
    return Path(folder) / f"{stem}.{scaling_name(rope_scaling)}.{extension}"


def check_result_paths(folder: str | os.PathLike, names: Sequence[str], rope_scaling: dict[str, Any] | None,
                       what: str) -> None:
    """Raises ``ValueError`` starting with ``what`` when a folder stands where one of the files ``names`` would be
    written (a file or a link there is replaced). With :func:`rotarium.utils.files.check_writable_folder` on
    ``folder``, what the results need is checked before any scoring."""
    for name in names:
        path = result_path(folder, name, rope_scaling)
        if path.is_dir() and not path.is_symlink():
            raise ValueError(f"{what} {Path(folder)} holds a folder named {path.name}, where eval writes that file; "
                             f"move the folder away or choose another --output-dir")
