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
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rotarium.data.config import DataSection
from rotarium.data.prepared import PreparedCorpus

RECORD_KEY = "held_out"


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


def held_out_record(cfg: DataSection, documents: Sequence[str]) -> dict[str, Any]:
    """The record of the held-out ``documents`` of a run reading ``cfg``, for its ``training_args.json``:
    ``source`` (a local source's absolute path, else ``data.source`` as given), ``documents`` (how many) and
    ``sha256`` (:func:`documents_sha256`)."""
    local = local_source(cfg.source)
    return {"source": str(local) if local is not None else cfg.source, "documents": len(documents),
            "sha256": documents_sha256(documents)}


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


def check_held_out(record: Any, cfg: DataSection, documents: Sequence[str], where: str) -> None:
    """Raises ``ValueError`` when ``documents``, re-derived from ``cfg``, are not the documents ``record`` (from the
    file ``where``) says the run held out."""
    _, count, digest = _checked_record(record, where)
    if len(documents) == count and documents_sha256(documents) == digest:
        return
    part = (f"the stream's held-out part (its first {cfg.validation_documents} documents)" if cfg.streaming
            else "the validation split")
    hint = (" (the embedded corpus is this Python's documentation topics, and another Python version has other "
            "ones)" if cfg.source == "embedded" else "")
    raise ValueError(f"`data.source={cfg.source}` changed since training{hint}: {part} is no longer the documents "
                     f"the run held out ({len(documents)} documents, SHA-256 {documents_sha256(documents)[:12]}, "
                     f"against {count}, SHA-256 {digest[:12]}, recorded in {where}) and may hold documents the run "
                     "trained on; evaluate with the corpus the run trained on, or pass --data FILE to score another "
                     "text knowingly")


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


def check_prepared(record: Any, where: str) -> PreparedCorpus:
    """The prepared folder a run held its validation split out of, from its ``record`` (in the file ``where``),
    checked to hold that split still: the folder's fingerprint, the digest of its validation shards, and those
    shard files' own SHA-256. Raises ``ValueError`` naming the folder and what differs."""
    source, count, digest = _checked_record(record, where)
    hint = "prepare the run's source again into that folder, or pass --data FILE to score another text knowingly"
    if not Path(source).is_dir():
        raise ValueError(f"the run trained from the prepared folder {source} ({where}), which is no longer there; put "
                         f"it back at that path to score its validation split, or pass --data FILE to score another "
                         "text knowingly")
    corpus = PreparedCorpus(source)
    if corpus.fingerprint != record["prepared"] or corpus.validation.num_documents != count or (
            _validation_sha256(corpus) != digest):
        raise ValueError(f"the prepared folder {source} changed since training (fingerprint {corpus.fingerprint[:12]}, "
                         f"recorded {str(record['prepared'])[:12]} in {where}): its validation split may not be the "
                         f"documents the run held out; {hint}")
    corpus.verify(splits=("validation",))
    return corpus