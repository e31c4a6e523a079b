"""Writing files and folders so that a reader, or a run killed half-way, never sees a half-written one.

Everything is written beside its target under a hidden name and renamed into place, since a rename within a folder
is atomic. This module imports the standard library only: exported checkpoints bundle it with the model code.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def refuse_link(path: str | os.PathLike, what: str = "") -> None:
    """Raises ``ValueError`` when ``path`` is a symbolic link. For the files rotarium opens in place (a lock, a log
    it appends to) and the folders it writes into: writing through a link would change a file elsewhere, one the
    link's maker chose."""
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"{what + ' ' if what else ''}{path} is a symbolic link (to {os.readlink(path)}); rotarium "
                         "never writes through a link: remove the link, or choose another folder")


def make_folder(path: str | os.PathLike, what: str = "") -> Path:
    """``path`` as an existing folder (created with its parents if needed), refusing a link in its place (see
    :func:`refuse_link`): for the folders rotarium makes inside one it owns."""
    path = Path(path)
    refuse_link(path, what)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_file_atomic(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Calls ``write(tmp)`` on a new temporary file beside ``path``, syncs it and renames it over ``path``; on failure
    the temporary file is removed and ``path`` is untouched. A link at ``path`` is replaced by the file, never
    followed. The file gets the permissions a plain ``open`` would give it (the temporary file is private until
    renamed). Every file rotarium writes goes through here."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        os.close(fd)
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` (as given, no newline translation) to ``path`` with :func:`write_file_atomic`."""
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)

    write_file_atomic(path, write)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Appends ``text`` to ``path`` (created if missing), refusing a link in its place (:func:`refuse_link`): a log
    grows by appends, which cannot go through a rename."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError:
        refuse_link(path)
        raise
    with os.fdopen(fd, "a", encoding="utf-8", newline="") as f:
        f.write(text)


def write_csv_atomic(path: str | os.PathLike, rows: list[dict], fieldnames: Sequence[str]) -> None:
    """``rows`` as a CSV with the columns ``fieldnames`` (missing values empty, others ignored), written atomically:
    a process killed half-way leaves the previous file whole."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(fieldnames), restval="", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(path, text.getvalue())


def read_csv_rows(path: str | os.PathLike, *, ints: Sequence[str] = (), floats: Sequence[str] = (),
                  optional_floats: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The rows of a CSV written by :func:`write_csv_atomic` (none when the file does not exist), with the columns
    ``ints`` and ``floats`` converted, and ``optional_floats`` too where not empty (else ``None``; a column absent
    from an older file reads as empty)."""
    if not Path(path).is_file():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ints:
            row[key] = int(row[key])
        for key in floats:
            row[key] = float(row[key])
        for key in optional_floats:
            value = row.get(key)
            row[key] = float(value) if value not in (None, "", "None") else None
    return rows


def _finite(data: Any) -> Any:
    """``data`` with every non-finite float, at any depth, replaced by ``None``."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON ending with a newline, written with :func:`write_text_atomic`. JSON has no NaN or
    infinity (a strict reader refuses the bare ``NaN`` Python would write): a non-finite number is written as
    ``null``."""
    write_text_atomic(path, json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """The records of a JSON Lines file (none when it does not exist), skipping a line a kill cut short."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the file at ``path`` (hex), read in chunks: checkpoints and prepared shards record it so that
    ``sha256sum`` can check a copy by hand."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def check_writable_folder(path: str | os.PathLike, what: str) -> None:
    """Raises ``ValueError`` starting with ``what`` when ``path`` cannot be a folder this process writes into: it,
    or the nearest part of it that exists, is a file, or that part is a folder it may not write (permissions, or a
    read-only file system). Nothing is created."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == path else f": {existing} is a file"
        raise ValueError(f"{what} {path} is not a folder{where}; pass a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing}, where it would be created)"
        raise ValueError(f"{what} {path} is not writable{where}; check its permissions or choose another folder")


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flushes every file and folder under ``folder`` to disk, so that a rename after it publishes whole files."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_folder(finished: str | os.PathLike, target: str | os.PathLike) -> None:
    """Renames the complete folder ``finished`` to ``target`` (a sibling path).

    An existing ``target`` is first moved into a hidden ``.<name>.old-*`` sibling and deleted only once the new one
    is in place (and moved back if that rename fails), so a kill at any moment leaves the old or the new folder
    whole."""
    finished, target = Path(finished), Path(target)
    aside = None
    if target.exists():
        aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.replace(target, aside / target.name)
    try:
        os.replace(finished, target)
    except BaseException:
        if aside is not None:
            os.replace(aside / target.name, target)
            aside.rmdir()
        raise
    if aside is not None:
        shutil.rmtree(aside)


def write_folder_atomic(target: str | os.PathLike, write: Callable[[Path], T]) -> T:
    """Calls ``write(folder)`` on a new hidden ``.<name>.tmp-*`` sibling of ``target``, syncs it and puts it in
    place with :func:`replace_folder`; returns what ``write`` returns. If anything fails the temporary folder is
    removed and ``target`` is untouched. The folder gets the permissions ``mkdir`` would give it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        result = write(tmp)
        fsync_tree(tmp)
        replace_folder(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
