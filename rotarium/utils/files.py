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
import stat
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


def make_folder(path: str | os.PathLike, what: str = "", *, inside: str | os.PathLike | None = None) -> Path:
    """``path`` as an existing folder (created with its parents if needed), refusing a link in its place (see
    :func:`refuse_link`): for the folders rotarium makes inside one it owns. With ``inside`` (that folder, which
    ``path`` lies in), a link at any level between the two is refused too, and each level is made in turn, so
    nothing is created through a link."""
    path = Path(path)
    if inside is None:
        refuse_link(path, what)
        path.mkdir(parents=True, exist_ok=True)
        return path
    level = Path(inside)
    for part in path.relative_to(inside).parts:
        level = level / part
        refuse_link(level, what)
        level.mkdir(parents=True, exist_ok=True)
    return path


def refuse_links_inside(folder: str | os.PathLike, what: str = "") -> None:
    """Raises ``ValueError`` (:func:`refuse_link`) naming the first symbolic link found at any depth inside
    ``folder`` (none is followed): for a folder rotarium writes into as a whole, checked before it touches it."""
    for root, folders, files in os.walk(folder):
        for name in sorted(folders + files):
            refuse_link(Path(root) / name, what)


def _is_temporary(name: str) -> bool:
    """Whether ``name`` is one a killed :func:`write_file_atomic` (``.<name>.<random>.tmp``) or
    :func:`write_folder_atomic` (``.<name>.tmp-<random>``) left."""
    return name.startswith(".") and (name.endswith(".tmp") or ".tmp-" in name)


def remove_temporary_files(folder: str | os.PathLike, what: str = "") -> None:
    """Removes the hidden temporary files and folders that killed atomic writes left directly in ``folder``,
    following no link: a link in place of ``folder`` is refused (:func:`refuse_link`), and a link named like a
    temporary file is removed itself, never what it points to."""
    folder = Path(folder)
    refuse_link(folder, what)
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if _is_temporary(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


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
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        raise _naming(error, path, tmp) from error
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _naming(error: OSError, target: Path, tmp: str | os.PathLike) -> OSError:
    """``error`` naming the file of ``target`` it is about, where it names no file (a full disk fails a write, which
    names none) or one of the hidden temporary ``tmp`` written in its place."""
    tmp, name = Path(tmp), error.filename
    if isinstance(name, (str, os.PathLike)) and (Path(name) == tmp or tmp in Path(name).parents):
        where = target / Path(name).relative_to(tmp)
    elif name is None:
        where = target
    else:
        return error
    if error.errno is None:
        return OSError(f"{' '.join(str(error).split())} ({where})")
    return OSError(error.errno, error.strerror or str(error), str(where))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` (as given, no newline translation) to ``path`` with :func:`write_file_atomic`."""
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)

    write_file_atomic(path, write)


def copy_file(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """``source``'s content as ``target``, with :func:`write_file_atomic` (so a link at ``target`` is replaced, never
    followed, and ``target`` gets a plain file's permissions, not ``source``'s)."""
    write_file_atomic(target, lambda tmp: shutil.copyfile(source, tmp))


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


def without_non_finite(data: Any, found: dict[str, str] | None = None, name: str = "") -> Any:
    """``data`` with every non-finite float, at any depth, replaced by ``None``; with ``found``, each one's place
    (``name.key[index]``) and value are added to it."""
    if isinstance(data, float) and not math.isfinite(data):
        if found is not None:
            found[name] = str(data)
        return None
    if isinstance(data, dict):
        return {key: without_non_finite(value, found, f"{name}.{key}" if name else str(key))
                for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [without_non_finite(value, found, f"{name}[{i}]") for i, value in enumerate(data)]
    return data


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """``data`` as indented JSON ending with a newline, written with :func:`write_text_atomic`. JSON has no NaN or
    infinity (a strict reader refuses the bare ``NaN`` Python would write): a non-finite number is written as
    ``null``."""
    write_text_atomic(path, json.dumps(without_non_finite(data), indent=2, allow_nan=False) + "\n")


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


def resolve_path(path: str | os.PathLike) -> Path:
    """``path`` with every symbolic link resolved; a link loop raises a one-line ``ValueError`` naming it."""
    path = Path(path)
    try:
        return path.resolve()
    except (OSError, RuntimeError) as error:  # a link loop
        raise ValueError(f"{path} cannot be resolved ({error}); replace the link with the file it should name") \
            from None


def check_apart(out: str | os.PathLike, source: str | os.PathLike, out_name: str, source_name: str,
                why: str | None = None) -> None:
    """``ValueError`` when the folder ``out`` is, contains or lies inside ``source``, compared on resolved paths:
    writing ``out`` (with an overwrite, moving the old folder aside and deleting it) would replace or delete the
    source, or write into it. ``why`` says what that would do, in the message (default: replace or delete it)."""
    out_path, source_path = resolve_path(Path(out).absolute()), resolve_path(Path(source).absolute())
    if out_path == source_path:
        relation = "the same folder"
    elif out_path in source_path.parents:
        relation = f"it contains the {source_name}"
    elif source_path in out_path.parents:
        relation = f"it lies inside the {source_name}"
    else:
        return
    why = why or f"writing it could replace or delete the {source_name}"
    raise ValueError(f"{out_name} {str(out)!r} overlaps the {source_name} {str(source_path)!r} ({relation}): "
                     f"{why}; write to a folder outside it")


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


def plain_permissions(folder: str | os.PathLike) -> None:
    """Gives every file under ``folder`` (links aside) the permissions a plain ``open`` gives under this umask:
    some writers make theirs private (safetensors writes its files 0600), and a published model's weights should
    read as its other files do."""
    mode = 0o666 & ~_umask()
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            status = os.lstat(path)
            if stat.S_ISREG(status.st_mode) and stat.S_IMODE(status.st_mode) != mode:
                os.chmod(path, mode)


def replace_folder(finished: str | os.PathLike, target: str | os.PathLike) -> None:
    """Renames the complete folder ``finished`` to ``target`` (a sibling path).

    An existing ``target`` is first moved into a hidden ``.<name>.old-*`` sibling and deleted only once the new one
    is in place (and moved back if that rename fails), so a kill at any moment leaves the old or the new folder
    whole. The files of ``finished`` first get the permissions plain ones would (:func:`plain_permissions`)."""
    finished, target = Path(finished), Path(target)
    plain_permissions(finished)
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
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _naming(error, target, tmp) from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
