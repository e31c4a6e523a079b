"""What identifies the documents a run holds out for validation, so that ``rotarium eval`` scores those documents
and no others.

Evaluation re-derives the held-out documents from the corpus, and the split depends on the corpus as a whole
(:func:`~rotarium.data.documents.split_documents` draws positions among all the documents; a stream holds out its
first ``validation_documents``): a corpus that grew, shrank or was edited since training gives another split, which
may hold documents the run trained on. So the run records, in its ``training_args.json`` under :data:`RECORD_KEY`,
how many documents it held out and a SHA-256 over their texts, with a local ``data.source`` as an absolute path (a
relative one names another file, or a Hub dataset, from another working directory). ``rotarium eval`` reads the
corpus from that path and refuses documents whose digest differs.

A run from a prepared folder holds out the folder's validation split, decided when the folder was prepared. Its
record (:func:`prepared_record`) names the folder (absolute path), its fingerprint, and a SHA-256 over its
validation shards' recorded SHA-256; :func:`check_prepared` opens the folder there, compares both, and checks the
validation shard files' own SHA-256 (the split is small), so ``rotarium eval`` scores the tokens the run held out.

The record also identifies the source itself (:func:`source_identity`): a local file or folder by each file's path
(relative to ``data.source``), size and SHA-256 (of its first and last :data:`END_BLOCK` bytes and its size, above
:data:`LARGE_FILE`, so a resume does not read a large corpus whole to check it); a stream from the Hub by its shard
files' names and sizes. A resume (:func:`rotarium.training.resume.check_data`) and ``rotarium eval`` compare it with
the source as it is now before anything is derived from it (:func:`check_source`), and refuse a changed source,
naming what changed; then the held-out documents derived again are compared with their digest
(:func:`check_held_out`), which also covers the sources without files (the embedded corpus, a Hub dataset read
whole). ``--allow-data-change`` goes on with a warning that the held-out documents may now overlap the documents
the run trained on, and the run records the step where that happened (``changed_at_steps``), which ``rotarium
eval`` repeats.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rotarium.data.config import DataSection
from rotarium.data.documents import _local_files
from rotarium.data.prepared_reader import PreparedCorpus
from rotarium.utils.files import file_sha256

if TYPE_CHECKING:
    from rotarium.data.documents import StreamShards

logger = logging.getLogger(__name__)

RECORD_KEY = "held_out"
# A file above LARGE_FILE bytes is identified by its size and a SHA-256 of its first and last END_BLOCK bytes.
LARGE_FILE = 64 << 20
END_BLOCK = 1 << 20
ALLOW_FLAG = "--allow-data-change"


def documents_sha256(documents: Iterable[str]) -> str:
    """SHA-256 over the documents in order, each prefixed with its length, so that no two different lists of texts
    share a digest by where one text ends and the next begins."""
    digest = hashlib.sha256()
    for text in documents:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def local_source(source: str) -> Path | None:
    """The absolute path of ``data.source`` when it names an existing local file or folder (as
    :func:`~rotarium.data.documents.iter_documents` reads it), else ``None`` (the embedded corpus, a Hub dataset)."""
    if source == "embedded" or not Path(source).exists():
        return None
    return Path(source).absolute()


def absolute_source(cfg: DataSection) -> DataSection:
    """``cfg`` with a local ``data.source`` as its absolute path, as a run records and reads it: a relative one
    would name another file, or a Hub dataset, from another working directory."""
    local = local_source(cfg.source)
    return cfg if local is None or str(local) == cfg.source else dataclasses.replace(cfg, source=str(local))


def _file_identity(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size <= LARGE_FILE:
        return {"bytes": size, "sha256": file_sha256(path)}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(END_BLOCK))
        f.seek(size - END_BLOCK)
        digest.update(f.read(END_BLOCK))
    return {"bytes": size, "ends_sha256": digest.hexdigest()}


def _stream_files(stream: StreamShards) -> list[str] | None:
    """The files a ``datasets`` stream reads, as its examples iterable lists them (None where it does not)."""
    iterable = getattr(stream.dataset, "_ex_iterable", None)
    files = getattr(iterable, "kwargs", {}).get("original_files") if iterable is not None else None
    return [str(f) for f in files] if isinstance(files, (list, tuple)) else None


def stream_identity(stream: StreamShards) -> dict[str, Any] | None:
    """A stream's shard files (from the dataset's file listing) by name and size (``None`` where the size cannot
    be had), or ``None`` for a stream without such a listing."""
    from datasets.utils.file_utils import xgetsize

    files = _stream_files(stream)
    if files is None:
        return None
    shards = {}
    for name in files:
        try:
            shards[name] = {"bytes": xgetsize(name)}
        except Exception:  # noqa: BLE001  (a listing without sizes still names the shards)
            shards[name] = {"bytes": None}
    return {"shards": shards}


def source_identity(cfg: DataSection, stream: StreamShards | None = None) -> dict[str, Any] | None:
    """What identifies the source ``cfg`` names (see the module docstring): a local file or folder's ``files``
    (path relative to ``data.source`` -> size and SHA-256), a Hub stream's ``shards`` (name -> size; ``stream``: the
    stream when it is open already), else ``None`` (the embedded corpus, a Hub dataset read whole: their held-out
    digest is what is checked)."""
    local = local_source(cfg.source)
    if local is not None:
        files = [Path(name) for name in _local_files(str(local))[1]]
        return {"root": str(local.resolve()), "files": {
            (path.relative_to(local).as_posix() if local.is_dir() else path.name): _file_identity(path)
            for path in files}}
    if cfg.streaming and cfg.source != "embedded":
        from rotarium.data.documents import StreamShards

        return stream_identity(stream if stream is not None else StreamShards(cfg))
    return None


def _size(entry: dict[str, Any]) -> str:
    return "?" if entry.get("bytes") is None else f"{entry['bytes']} bytes"


def identity_changes(old: Mapping[str, Any], new: Mapping[str, Any] | None) -> list[str]:
    """What differs between two :func:`source_identity` records: files or shards gone, added, resized or with
    other content."""
    kind = "files" if "files" in old else "shards"
    before, after = dict(old.get(kind) or {}), dict((new or {}).get(kind) or {})
    changes = [f"{name} is gone" for name in sorted(before.keys() - after.keys())]
    changes += [f"{name} is new" for name in sorted(after.keys() - before.keys())]
    for name in sorted(before.keys() & after.keys()):
        a, b = before[name], after[name]
        if a.get("bytes") != b.get("bytes"):
            changes.append(f"{name} has {_size(b)}, {_size(a)} were recorded")
        elif a.get("sha256", a.get("ends_sha256")) != b.get("sha256", b.get("ends_sha256")):
            changes.append(f"{name} has other content of the same size")
    return changes


def _overlap_warning(what: str) -> None:
    logger.warning("%s; going on as %s allows: the held-out documents may now include documents the run trained on, "
                   "so its validation numbers may be too good", what, ALLOW_FLAG)


def check_source(record: Any, cfg: DataSection, where: str, *, allow: bool = False,
                 stream: StreamShards | None = None, prefix: str = "", hint: str = "") -> bool:
    """Raises ``ValueError`` (starting with ``prefix``; ``hint``: another way out) naming what changed when the
    source ``cfg`` names is not the one ``record`` (from the file ``where``) identifies; with ``allow``
    (``--allow-data-change``) it warns instead, and returns ``True``. A record without an identity (written by an
    older rotarium) is noted: nothing can be checked."""
    if not isinstance(record, Mapping) or "identity" not in record:
        logger.warning("%s%s records no identity of `data.source=%s` (written by an older rotarium): whether the "
                       "source changed since cannot be checked", prefix, where, cfg.source)
        return False
    recorded = record["identity"]
    if not isinstance(recorded, Mapping):
        return False
    changes = identity_changes(recorded, source_identity(cfg, stream))
    if not changes:
        return False
    listed = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
    what = f"{prefix}`data.source={cfg.source}` is not the source recorded in {where}: {listed}"
    if allow:
        _overlap_warning(what)
        return True
    raise ValueError(f"{what}; the held-out documents derived from it may include documents the run trained on: put "
                     f"the source back as it was, pass {ALLOW_FLAG} to go on knowingly (the held-out documents may "
                     f"then overlap the training documents){', ' + hint if hint else ''}")


def held_out_record(cfg: DataSection, documents: Sequence[str], *, stream: StreamShards | None = None
                    ) -> dict[str, Any]:
    """The record of the held-out ``documents`` of a run reading ``cfg``, for its ``training_args.json``:
    ``source`` (a local source's absolute path, else ``data.source`` as given), ``documents`` (how many),
    ``sha256`` (:func:`documents_sha256`) and ``identity`` (:func:`source_identity`, of the opened ``stream`` when
    streaming). A run that went on with a changed source adds ``changed_at_steps``."""
    local = local_source(cfg.source)
    return {"source": str(local) if local is not None else cfg.source, "documents": len(documents),
            "sha256": documents_sha256(documents), "identity": source_identity(cfg, stream)}


def changed_at_steps(record: Any) -> list[int]:
    """The steps at which a resume went on with a changed source (``--allow-data-change``), from ``record``."""
    steps = record.get("changed_at_steps") if isinstance(record, Mapping) else None
    return [s for s in steps if isinstance(s, int)] if isinstance(steps, list) else []


def warn_if_changed(record: Any, where: str) -> None:
    """Repeats, for ``rotarium eval``, that the run went on with a changed source."""
    steps = changed_at_steps(record)
    if steps:
        logger.warning("the run went on with a changed `data.source` at step %s (%s, recorded in %s): its held-out "
                       "documents may include documents it trained on", ", ".join(map(str, steps)), ALLOW_FLAG, where)


def _checked_record(record: Any, where: str) -> tuple[str, int, str]:
    fields = (record.get("source"), record.get("documents"), record.get("sha256")) if isinstance(
        record, Mapping) else (None, None, None)
    source, count, digest = fields
    whole = isinstance(source, str) and isinstance(count, int) and isinstance(digest, str)
    if not whole:
        raise ValueError(f"{where}: `{RECORD_KEY}` is not a record of the held-out documents (a source, a count and "
                         f"a sha256); evaluate on a text of your choice with --data FILE")
    return source, count, digest


def recorded_source(record: Any, cfg: DataSection, where: str) -> DataSection:
    """``cfg`` with ``source`` as the run read it: a local source at the absolute path in ``record``. Raises
    ``ValueError`` naming ``where`` (the file holding the record) when that path no longer exists."""
    source, _, _ = _checked_record(record, where)
    if source == cfg.source or not Path(source).is_absolute():
        return cfg
    if not Path(source).exists():
        raise ValueError(f"`data.source={cfg.source}` was {source} when the run trained ({where}), and that is no "
                         "longer there; put the corpus back at that path to score the documents the run held out, "
                         "or pass --data FILE to score another text knowingly")
    return dataclasses.replace(cfg, source=source)


def check_held_out(record: Any, cfg: DataSection, documents: Sequence[str], where: str, *, allow: bool = False,
                   prefix: str = "", hint: str = "or pass --data FILE to score another text knowingly") -> bool:
    """Raises ``ValueError`` (starting with ``prefix``; ``hint``: the other ways out) when ``documents``, re-derived
    from ``cfg``, are not the documents ``record`` (from the file ``where``) says the run held out; with ``allow``
    (``--allow-data-change``) it warns instead, and returns ``True``."""
    _, count, digest = _checked_record(record, where)
    if len(documents) == count and documents_sha256(documents) == digest:
        return False
    part = (f"the stream's held-out part (its first {cfg.validation_documents} documents)" if cfg.streaming
            else "the validation split")
    python = (" (the embedded corpus is this Python's documentation topics, and another Python version has other "
              "ones)" if cfg.source == "embedded" else "")
    what = (f"{prefix}`data.source={cfg.source}` changed since training{python}: {part} is no longer the documents "
            f"the run held out ({len(documents)} documents, SHA-256 {documents_sha256(documents)[:12]}, against "
            f"{count}, SHA-256 {digest[:12]}, recorded in {where})")
    if allow:
        _overlap_warning(what)
        return True
    raise ValueError(f"{what} and may hold documents the run trained on; use the corpus the run trained on, pass "
                     f"{ALLOW_FLAG} to go on knowingly, {hint}")


def _validation_sha256(corpus: PreparedCorpus) -> str:
    """SHA-256 over the validation shard files' names and recorded SHA-256, in order."""
    digest = hashlib.sha256()
    for shard in corpus.validation.record["shards"]:
        for name, file in shard["files"].items():
            digest.update(f"{name}:{file['sha256']}\n".encode())
    return digest.hexdigest()


def prepared_record(corpus: PreparedCorpus) -> dict[str, Any]:
    """The record of a prepared run's held-out documents, its folder's validation split: ``source`` (the folder's
    absolute path), ``prepared`` (its fingerprint), ``documents`` and ``sha256`` (:func:`_validation_sha256`)."""
    return {"source": str(corpus.path.absolute()), "prepared": corpus.fingerprint,
            "documents": corpus.validation.num_documents, "sha256": _validation_sha256(corpus)}


def is_prepared_record(record: Any) -> bool:
    return isinstance(record, Mapping) and "prepared" in record


def check_prepared(record: Any, where: str, *, allow: bool = False) -> PreparedCorpus:
    """The prepared folder a run held its validation split out of, from its ``record`` (in the file ``where``),
    checked to hold that split still: the folder's fingerprint, the digest of its validation shards, and those
    shard files' own SHA-256. Raises ``ValueError`` naming the folder and what differs; a changed folder only warns
    with ``allow`` (``--allow-data-change``), its shard files must still be the ones its metadata records."""
    source, count, digest = _checked_record(record, where)
    hint = "prepare the run's source again into that folder, or pass --data FILE to score another text knowingly"
    if not Path(source).is_dir():
        raise ValueError(f"the run trained from the prepared folder {source} ({where}), which is no longer there; put "
                         f"it back at that path to score its validation split, or pass --data FILE to score another "
                         "text knowingly")
    corpus = PreparedCorpus(source)
    if corpus.fingerprint != record["prepared"] or corpus.validation.num_documents != count or (
            _validation_sha256(corpus) != digest):
        what = (f"the prepared folder {source} changed since training (fingerprint {corpus.fingerprint[:12]}, "
                f"recorded {str(record['prepared'])[:12]} in {where})")
        if not allow:
            raise ValueError(f"{what}: its validation split may not be the documents the run held out; {hint}, or "
                             f"pass {ALLOW_FLAG} to score it knowingly")
        _overlap_warning(what)
    corpus.verify(splits=("validation",))
    return corpus