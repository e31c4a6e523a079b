"""Where the Hub tools may read and write: no file read through a link that leaves its folder, no output over its
source.

``export`` and ``push`` read a checkpoint folder (and the run folder beside it), ``convert`` a source folder. A
symbolic link there that leads elsewhere would make an export publish a private file, or a conversion take in
tensors from anywhere, so every file is checked on its resolved path (:func:`confined`). The one layout whose links
leave their folder on purpose is the Hugging Face cache, where ``snapshot_download`` writes
``<cache>/models--<name>/snapshots/<revision>/<file>`` as a link to ``<cache>/models--<name>/blobs/<hash>``: links
that resolve to a file directly in that same repository's ``blobs/`` are followed, nothing else.

An output folder is checked before any work (:func:`check_output_folder`): not a file, empty unless overwritten,
writable, and apart from its source (:func:`rotarium.utils.files.check_apart`), since an overwrite moves the old
folder aside and deletes it.
"""
from __future__ import annotations

import os
from pathlib import Path

from rotarium.utils.files import check_writable_folder, resolve_path

CACHE_REPO_PREFIX = "models--"


class OutputExistsError(FileExistsError, ValueError):
    """The output folder exists and is not empty, and no overwrite was asked for: bad input (a ``ValueError``, as
    the CLI reports it) that callers of the Python API may also catch as ``FileExistsError``."""


def in_cache_blobs(root: Path, target: Path) -> bool:
    """Whether ``target`` (resolved) is a file directly in the ``blobs/`` of the Hugging Face cache repository
    whose snapshot holds the resolved folder ``root`` (``.../models--<name>/snapshots/<revision>[/...]``).

    Both paths are resolved, so ``blobs/`` and the file are real ones inside that repository: a ``blobs`` that is
    itself a link, or a blob that links further, resolves elsewhere and does not count."""
    for snapshot in (root, *root.parents):
        repo = snapshot.parent.parent
        if snapshot.parent.name == "snapshots" and repo.name.startswith(CACHE_REPO_PREFIX):
            return target.parent == repo / "blobs" and target.is_file()
    return False


def confined(path: Path, folder: Path, *, reader: str = "export",
             why: str = "a link could publish a private file") -> Path:
    """``path`` (named inside ``folder``) if what it resolves to, through any symbolic link, is inside ``folder``
    too, or in the cache blobs of :func:`in_cache_blobs`; else a one-line ``ValueError`` naming the file or the link
    that leaves. ``reader`` and ``why`` say who refuses and why, in that message."""
    root, target = resolve_path(folder), resolve_path(path)
    if target == root or root in target.parents or in_cache_blobs(root, target):
        return path
    link = next((p for p in (path, *path.parents) if p.is_symlink()), None)
    if link is None:
        raise ValueError(f"{path} resolves to {target}, outside {folder}; {reader} reads no file from outside it "
                         f"({why})")
    raise ValueError(f"{link} is a symbolic link to {os.readlink(link)!r}, outside {folder}; {reader} reads no file "
                     f"from outside it ({why}): replace the link with a copy of the file, or remove it")


def check_output_folder(out: str | os.PathLike, *, overwrite: bool, what: str) -> Path:
    """``out`` as an absolute path, after checking that a folder can be written there by renaming a finished
    sibling into place (``rotarium.utils.files.write_folder_atomic``): it is not a file (not even with
    ``overwrite``), it is empty or absent unless ``overwrite`` (else :class:`OutputExistsError`), and the folders
    the rename touches are writable. ``what`` names it in the messages (``"OUT_DIR"``)."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is a file; pass a folder path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{what} {out} exists and is not empty; pass overwrite=True (--overwrite) to "
                                "replace it")
    check_writable_folder(out, what)
    if out.exists():  # the finished folder is written beside it and renamed over it
        check_writable_folder(out.parent, f"the folder holding {what}")
    return out
