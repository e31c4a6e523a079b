"""``rotarium prepare``'s writer: a source tokenised once into a prepared folder's memory-mappable token shards
(the format: :mod:`rotarium.data.prepared_reader`; docs/data.md).

Which documents are held out is decided per document from its index in the source, and which shard a document goes
to from the token counts alone, so the shards are a function of the source and the settings, never of the number of
processes or of where a previous prepare was killed: ``progress.json`` records after every shard where each split
continues, and a rerun picks up there.
"""
from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rotarium.data.batches import added_bos, save_array, tokenize
from rotarium.data.config import DEFAULT_SEED, DataSection
from rotarium.data.documents import iter_documents
from rotarium.data.heldout import identity_changes, local_source, source_identity
from rotarium.data.prepared_reader import (
    FORMAT,
    FORMAT_VERSION,
    METADATA,
    PROGRESS,
    SPLITS,
    TOKENIZER,
    HeldOut,
    PreparedCorpus,
    corpus_fingerprint,
    is_prepared,
    read_json,
    shard_files,
    tokenizer_fingerprint,
)
from rotarium.data.tokenizer import SPECIAL_TOKENS, TextPieces, load_tokenizer, train_bpe
from rotarium.utils.files import (
    check_apart,
    check_writable_folder,
    file_sha256,
    make_folder,
    refuse_link,
    refuse_links_inside,
    remove_temporary_files,
    write_folder_atomic,
    write_json_atomic,
)
from rotarium.utils.lock import FolderLock

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_SHARD_TOKENS = 100_000_000
# `rotarium train`'s `tokenizer.vocab_size` and `tokenizer.train_documents` defaults: that section lives with
# training, above this layer.
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_TRAIN_DOCUMENTS = 100_000
BPE_BASE_TOKENS = 256 + len(SPECIAL_TOKENS)  # a byte-level BPE holds every byte and its special tokens
# Text per task of the process pool: large enough that sending it costs nothing beside tokenising it.
TASK_CHARACTERS = 1 << 18
TASK_DOCUMENTS = 4096
# The most text the tokenizer is given at once, whose memory grows with it: a longer document is tokenised in pieces
# (rotarium.data.tokenizer.TextPieces), so a task never takes more memory than a task of short documents.
PIECE_CHARACTERS = TASK_CHARACTERS
# Where the progress record and metadata.json keep a local source's files, by size and SHA-256, which a rerun compares.
SOURCE_FILES = "source_files"


def default_num_proc() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def held_out_rule(streaming: bool, total: int | None, fraction: float | None, documents: int | None,
                  seed: int) -> HeldOut:
    """The rule holding out ``fraction`` or ``documents`` (one of them given) of a source of ``total`` documents
    (None for a stream). Raises ``ValueError`` naming the flag when nothing would be left to train on."""
    if streaming:
        if documents is not None:
            return HeldOut("first", seed, documents=documents)
        return HeldOut("hash", seed, fraction=fraction)
    if documents is None:
        documents = max(1, round(fraction * total)) if fraction > 0 else 0
        flag = f"--validation-fraction {fraction}"
    else:
        flag = f"--validation-documents {documents}"
    if documents >= total:
        raise ValueError(f"{flag} holds out {documents} of the source's {total} documents, leaving none to train "
                         "on; hold out fewer")
    return HeldOut("permutation", seed, documents=documents, total=total)


def token_dtype(tokenizer: PreTrainedTokenizerBase) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    top = max(max(tokenizer.get_vocab().values(), default=0), len(tokenizer) - 1)
    return np.dtype(np.uint16 if top < 2 ** 16 else np.uint32)


class DocumentEncoder:
    """Texts -> their ids as training sees them, flat: ``(tokens [sum of lengths], lengths [len(texts)])``, each
    document ``[bos] + ids + [eos]`` (:func:`~rotarium.data.batches.tokenize`, bos where the tokenizer's template
    adds one, and the eos :func:`~rotarium.data.batches.pack` ends a document with). A text longer than
    ``piece_characters`` is tokenised in pieces with the ids of the whole
    (:class:`~rotarium.data.tokenizer.TextPieces`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, dtype: np.dtype, piece_characters: int = PIECE_CHARACTERS):
        self.tokenizer, self.dtype = tokenizer, np.dtype(dtype)
        self.tail = [tokenizer.eos_token_id]
        self.pieces = TextPieces(tokenizer, piece_characters)
        self.head = [] if (bos := added_bos(tokenizer)) is None else [bos]

    def _short(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = list(tokenize(self.tokenizer, texts, batch=max(1, len(texts))))
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        flat = itertools.chain.from_iterable(itertools.chain(x, self.tail) for x in ids)
        return np.fromiter(flat, dtype=self.dtype, count=int(lengths.sum())), lengths

    def _long(self, text: str) -> np.ndarray:
        parts = [np.array(self.head, dtype=self.dtype)]
        for piece in self.pieces(text):
            parts.append(np.array(self.tokenizer(piece, add_special_tokens=False)["input_ids"], dtype=self.dtype))
        parts.append(np.array(self.tail, dtype=self.dtype))
        return np.concatenate(parts)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if all(len(text) <= self.pieces.size for text in texts):
            return self._short(texts)
        tokens, lengths, start = [], [], 0
        for i, text in enumerate([*texts, None]):
            if text is not None and len(text) <= self.pieces.size:
                continue
            if start < i:  # the short texts before this one, together
                flat, counts = self._short(texts[start:i])
                tokens.append(flat)
                lengths.append(counts)
            if text is not None:
                ids = self._long(text)
                tokens.append(ids)
                lengths.append(np.array([len(ids)], dtype=np.int64))
            start = i + 1
        return np.concatenate(tokens), np.concatenate(lengths)


_WORKER_ENCODER: DocumentEncoder | None = None


def _start_worker(encoder: DocumentEncoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _WORKER_ENCODER(texts)


def encode_ordered(encoder: DocumentEncoder, tasks: Iterator[list[str]], num_proc: int
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``encoder(task)`` for every task, in order, in ``num_proc`` processes (this one when 1). At most two tasks per
    process are in flight, so a large source is never read ahead into memory."""
    if num_proc == 1:
        yield from map(encoder, tasks)
        return
    # fork: a worker starts at once with the tokenizer already loaded (spawn would import torch in each)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(num_proc, _start_worker, (encoder,)) as pool:
        pending: deque = deque()
        for texts in tasks:
            pending.append(pool.apply_async(_encode_in_worker, (texts,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


@contextmanager
def one_thread_per_process() -> Iterator[None]:
    """Each process tokenises on one core (``--num-proc`` counts the cores): tokenizers' own thread pool, which it
    reads ``TOKENIZERS_PARALLELISM`` for, stays off for the duration."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


class _SplitWriter:
    """One split's pending documents and its complete shards."""

    def __init__(self, out: Path, name: str, dtype: np.dtype, shard_tokens: int, shards: list[dict]):
        self.out, self.name, self.dtype, self.shard_tokens = out, name, dtype, shard_tokens
        self.shards = shards
        self.chunks: list[np.ndarray] = []
        self.first: int | None = None  # the source index of the first pending document
        self._tokens = 0

    @property
    def pending_tokens(self) -> int:
        return self._tokens

    def add(self, index: int, ids: np.ndarray) -> bool:
        """Adds one document; first writes the pending ones as a shard when this one would take the shard beyond
        ``shard_tokens`` tokens, and then returns True."""
        flushed = False
        if self.chunks and self._tokens + len(ids) > self.shard_tokens:
            self.flush()
            flushed = True
        if not self.chunks:
            self.first = index
        self.chunks.append(ids)
        self._tokens += len(ids)
        return flushed

    def flush(self) -> None:
        if not self.chunks:
            return
        lengths = np.fromiter(map(len, self.chunks), dtype=np.int64, count=len(self.chunks))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(self.chunks).astype(self.dtype, copy=False)
        make_folder(self.out / self.name, "the split folder", inside=self.out)
        files = {}
        for relative, array in zip(shard_files(self.name, len(self.shards)), (tokens, offsets)):
            save_array(self.out / relative, array)
            files[relative] = _file_record(self.out / relative)
        self.shards.append({"tokens": len(tokens), "documents": len(lengths), "files": files})
        self.chunks, self.first, self._tokens = [], None, 0


def _settings(cfg: DataSection, tokenizer: str | None, vocab_size: int, train_documents: int, shard_tokens: int,
              validation_fraction: float | None, validation_documents: int | None, seed: int,
              max_tokens: int | None = None) -> dict[str, Any]:
    """What identifies a prepare: the same settings give the same folder."""
    local = Path(cfg.source).absolute() if cfg.source != "embedded" and Path(cfg.source).exists() else None
    tokenizer_path = Path(tokenizer).absolute() if tokenizer is not None and Path(tokenizer).exists() else None
    return {
        "source": str(local) if local is not None else cfg.source, "config": cfg.hub_config, "split": cfg.split,
        "text_field": cfg.text_field, "streaming": cfg.streaming,
        "tokenizer": str(tokenizer_path) if tokenizer_path is not None else tokenizer,
        "vocab_size": vocab_size if tokenizer is None else None,
        "train_documents": train_documents if tokenizer is None else None,
        "shard_tokens": shard_tokens, "validation_fraction": validation_fraction,
        "validation_documents": validation_documents, "seed": seed, "max_tokens": max_tokens,
    }


FLAGS = {"source": "SOURCE", "config": "--config", "split": "--split", "text_field": "--text-field",
         "streaming": "--streaming", "tokenizer": "--tokenizer", "vocab_size": "--vocab-size",
         "train_documents": "--train-documents", "shard_tokens": "--shard-tokens",
         "validation_fraction": "--validation-fraction", "validation_documents": "--validation-documents",
         "seed": "--seed", "max_tokens": "--max-tokens"}


def _check_arguments(num_proc: int, shard_tokens: int, vocab_size: int, train_documents: int,
                     validation_fraction: float | None, validation_documents: int | None, seed: int,
                     tokenizer: str | None) -> None:
    if num_proc < 1:
        raise ValueError(f"--num-proc must be at least 1, got {num_proc}")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if tokenizer is None and vocab_size < BPE_BASE_TOKENS:
        raise ValueError(f"--vocab-size must be at least {BPE_BASE_TOKENS} for the trained byte-level BPE (256 bytes "
                         f"and {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    if tokenizer is None and train_documents < 1:
        raise ValueError(f"--train-documents must be at least 1, got {train_documents}")
    if validation_fraction is not None and validation_documents is not None:
        raise ValueError("give --validation-fraction or --validation-documents, not both")
    # a folder without validation documents is one no run can train from (it validates on them)
    if validation_fraction is not None and not 0 < validation_fraction < 1:
        raise ValueError(f"--validation-fraction must be in (0, 1), got {validation_fraction}: a run from the "
                         "folder validates on the documents held out")
    if validation_documents is not None and validation_documents < 1:
        raise ValueError(f"--validation-documents must be at least 1, got {validation_documents}: a run from the "
                         "folder validates on the documents held out")
    if seed < 0:
        raise ValueError(f"--seed must be at least 0, got {seed}")


def _check_max_tokens(max_tokens: float | None) -> int | None:
    if max_tokens is None:
        return None
    if not math.isfinite(max_tokens) or max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1 and finite (a number of tokens, such as 27e9), got "
                         f"{max_tokens}")
    return int(max_tokens)


def _check_source(cfg: DataSection, out: Path) -> None:
    """What can be told of SOURCE before it is read: not a prepared folder, no ``--config`` for a local one, and
    apart from OUT."""
    local = cfg.source == "embedded" or Path(cfg.source).exists()
    if local and cfg.hub_config is not None:
        what = "the embedded corpus" if cfg.source == "embedded" else "a local file or folder"
        raise ValueError(f"--config {cfg.hub_config} names a configuration of a Hub dataset, but SOURCE {cfg.source} "
                         f"is {what}, which has none: drop --config")
    if cfg.source == "embedded" or not local:
        return
    if is_prepared(cfg.source):
        raise ValueError(f"SOURCE {cfg.source} is a prepared folder (written by `rotarium prepare`), not text to "
                         f"prepare: train from it with `--data.source {cfg.source}`, or give the source it was "
                         "prepared from")
    check_apart(out, cfg.source, "OUT", "SOURCE", why="prepared files there would be read as documents of the "
                "SOURCE by every later prepare or run of it")


def _check_out(out: Path) -> None:
    """``out`` is a folder this process may write, holding nothing but a prepare's own files (or nothing), and no
    link: whatever prepare writes or removes in it is never elsewhere."""
    refuse_link(out, "OUT")
    check_writable_folder(out, "OUT")
    if not out.is_dir():
        return
    refuse_links_inside(out, f"OUT {out} holds a link:")
    ours = {METADATA, PROGRESS, TOKENIZER, *SPLITS}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours and not p.name.startswith("."))
    if foreign:
        raise ValueError(f"OUT {out} holds files that are not a prepared corpus ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder")


def _refuse_other_settings(recorded: dict[str, Any], settings: dict[str, Any], out: Path) -> None:
    changed = [f"{FLAGS.get(key, key)} {recorded.get(key)!r} (now {value!r})" for key, value in settings.items()
               if recorded.get(key) != value]
    if changed:
        raise ValueError(f"OUT {out} holds a prepare with other settings: {'; '.join(changed)}; rerun with its "
                         "settings to continue it, or choose another OUT")


def _peek(cfg: DataSection) -> None:
    """Raises ``ValueError`` when the source holds no document."""
    if next(iter(iter_documents(cfg)), None) is None:
        raise ValueError(f"SOURCE {cfg.source} holds no documents (every `{cfg.text_field}` is empty); give a source "
                         "with text")


def _count(cfg: DataSection, progress: bool) -> int:
    from tqdm.auto import tqdm

    count = 0
    for _ in tqdm(iter_documents(cfg), desc="counting documents", unit=" documents", delay=2, disable=not progress,
                  leave=False):
        count += 1
    if count == 0:
        raise ValueError(f"SOURCE {cfg.source} holds no documents (every `{cfg.text_field}` is empty); give a source "
                         "with text")
    return count


def _load_named(name: str) -> PreTrainedTokenizerBase:
    """``--tokenizer NAME``, which prepare needs fast."""
    tokenizer = load_tokenizer(name, "--tokenizer")
    if not tokenizer.is_fast:
        raise ValueError(f"--tokenizer {name} loads as a slow (Python) tokenizer; prepare needs a fast one "
                         "(tokenizer.json, the `tokenizers` library)")
    return tokenizer


def _write_progress(out: Path, record: dict[str, Any]) -> None:
    write_json_atomic(out / PROGRESS, record)


def prepare(source: str, out: str | os.PathLike, *, tokenizer: str | None = None,
            vocab_size: int = DEFAULT_VOCAB_SIZE, train_documents: int = DEFAULT_TRAIN_DOCUMENTS,
            hub_config: str | None = None, split: str = "train", text_field: str = "text", streaming: bool = False,
            num_proc: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            validation_fraction: float | None = None, validation_documents: int | None = None,
            seed: int = DEFAULT_SEED, max_tokens: float | None = None, progress: bool = True) -> PreparedCorpus:
    """Tokenises ``source`` (anything ``data.source`` reads) into the prepared folder ``out`` and returns its reader.

    ``tokenizer``: a Hub name or folder, else a byte-level BPE of ``vocab_size`` trained on the first
    ``train_documents`` training documents. ``validation_fraction`` or ``validation_documents`` (default: the
    ``data.validation_fraction`` default) is held out by document, seeded by ``seed`` (see :class:`HeldOut`).
    Shards hold at most ``shard_tokens`` tokens unless one document alone is longer. ``num_proc`` processes
    tokenise (default: every core); the folder is the same for any number. ``max_tokens`` stops reading the source
    at the first document boundary where the training split holds that many tokens (a run needs no more than it
    trains on); the documents not read are neither trained on nor held out.

    A folder a killed prepare left continues where its last complete shard ended, and the result is the one an
    uninterrupted prepare writes; a complete folder with the same settings is returned as it is. The prepare holds
    ``out``'s lock (:class:`~rotarium.utils.lock.FolderLock`) while it runs, and writes nothing through a link.
    Raises ``ValueError`` with one line for bad input, before ``out`` is touched where it can be told up front: an
    empty source, a file that is not UTF-8, a missing text field, a tokenizer that does not load or has no eos, a
    source that is a prepared folder or overlaps ``out``, ``hub_config`` with a local source, a split left without
    documents, an ``out`` that is a file, not writable, a link or holding one, in use by another prepare, or
    holding another prepare or other files."""
    num_proc = default_num_proc() if num_proc is None else num_proc
    if validation_fraction is None and validation_documents is None:
        validation_fraction = DataSection.validation_fraction
    _check_arguments(num_proc, shard_tokens, vocab_size, train_documents, validation_fraction, validation_documents,
                     seed, tokenizer)
    max_tokens = _check_max_tokens(max_tokens)
    cfg = DataSection(source=source, hub_config=hub_config, split=split, text_field=text_field, streaming=streaming)
    out = Path(out)
    _check_source(cfg, out)
    settings = _settings(cfg, tokenizer, vocab_size, train_documents, shard_tokens, validation_fraction,
                         validation_documents, seed, max_tokens)
    _check_out(out)
    lock = FolderLock(out, "OUT", "prepare")  # made here if new, and removed again if nothing was written into it
    try:
        finished = read_json(out / METADATA, "metadata")
        if finished is not None:
            _refuse_other_settings(finished["settings"], settings, out)
            _refuse_changed_source(cfg, finished, out)
            if tokenizer is not None:
                _refuse_changed_tokenizer(_load_named(tokenizer), finished, f"--tokenizer {tokenizer}", out)
        else:
            _prepare(cfg, out, settings, num_proc, progress)
    finally:
        lock.release()
    return PreparedCorpus(out)


def _refuse_changed_tokenizer(tokenizer: PreTrainedTokenizerBase, record: dict[str, Any], what: str,
                              out: Path) -> None:
    """``what`` names the tokenizer: ``--tokenizer NAME``, or the folder's own copy."""
    now, recorded = tokenizer_fingerprint(tokenizer), record["tokenizer"]["sha256"]
    if now != recorded:
        raise ValueError(f"{what} is not the tokenizer OUT {out} was prepared with (its SHA-256 is {now[:12]}, the "
                         f"prepare recorded {recorded[:12]}): it changed since; choose another OUT")


def _refuse_changed_source(cfg: DataSection, record: dict[str, Any], out: Path) -> None:
    """A local source's files must be those the prepare in ``out`` began with (by size and SHA-256,
    :func:`~rotarium.data.heldout.source_identity`): a finished folder would be returned holding the old text, and an
    unfinished one would go on with the new text after the old. A folder prepared before the record is not checked
    (nor a Hub source, whose document count an unfinished prepare compares)."""
    recorded = record.get(SOURCE_FILES)
    if recorded is None:
        return
    changes = identity_changes(recorded, source_identity(cfg))
    if changes:
        raise ValueError(f"SOURCE {cfg.source} changed since OUT {out} was prepared from it: {'; '.join(changes)}; "
                         f"choose another OUT (or remove {out} to prepare the source as it is now)")


def _prepare(cfg: DataSection, out: Path, settings: dict[str, Any], num_proc: int, progress: bool) -> None:
    record = read_json(out / PROGRESS, "progress record")
    if record is not None:
        _refuse_other_settings(record["settings"], settings, out)
        _refuse_changed_source(cfg, record, out)
    # a named tokenizer is loaded before the source is read, which may take long, so that a wrong name fails at once
    named = _load_named(settings["tokenizer"]) if settings["tokenizer"] is not None else None
    total = None if cfg.streaming else _count(cfg, progress)
    if cfg.streaming:
        _peek(cfg)
    if record is not None and record["documents"] != total:
        raise ValueError(f"SOURCE {cfg.source} holds {total} documents, but the prepare in OUT {out} began with "
                         f"{record['documents']}: the source changed; choose another OUT")
    held_out = held_out_rule(cfg.streaming, total, settings["validation_fraction"], settings["validation_documents"],
                             settings["seed"])
    held = held_out.decider()
    remove_temporary_files(out, "OUT")
    for name in SPLITS:
        remove_temporary_files(out / name, "the split folder")
    if record is None:
        if named is not None:
            tokenizer = named
        else:
            training = (text for index, text in enumerate(iter_documents(cfg)) if not held(index))
            tokenizer = train_bpe(itertools.islice(training, settings["train_documents"] or DEFAULT_TRAIN_DOCUMENTS),
                                  settings["vocab_size"] or DEFAULT_VOCAB_SIZE)
        write_folder_atomic(out / TOKENIZER, tokenizer.save_pretrained)
        tokenizer = load_tokenizer(str(out / TOKENIZER))
        dtype = token_dtype(tokenizer)
        record = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "complete": False, "settings": settings,
            SOURCE_FILES: source_identity(cfg) if local_source(cfg.source) is not None else None,
            "documents": total, "held_out": held_out.record(), "dtype": dtype.name,
            "tokenizer": {"folder": TOKENIZER, "sha256": tokenizer_fingerprint(tokenizer),
                          "vocab_size": len(tokenizer), "bos_id": added_bos(tokenizer),
                          "eos_id": tokenizer.eos_token_id},
            "splits": {name: {"tokens": 0, "documents": 0, "shards": [], "resume": 0} for name in SPLITS},
        }
        _write_progress(out, record)
    else:
        tokenizer = load_tokenizer(str(out / TOKENIZER))
        _refuse_changed_tokenizer(tokenizer, record, str(out / TOKENIZER), out)
        if named is not None:
            _refuse_changed_tokenizer(named, record, f"--tokenizer {settings['tokenizer']}", out)
        dtype = np.dtype(record["dtype"])
    with one_thread_per_process():
        _tokenise(cfg, out, record, held, DocumentEncoder(tokenizer, dtype), num_proc, progress)


def _tokenise(cfg: DataSection, out: Path, record: dict[str, Any], held: Callable[[int], bool],
              encoder: DocumentEncoder, num_proc: int, progress: bool) -> None:
    """Reads the source from where ``record`` says each split continues, writes the shards and then the metadata."""
    from tqdm.auto import tqdm

    splits = record["splits"]
    limit = record["settings"].get("max_tokens")
    resume = [splits[name]["resume"] for name in SPLITS]
    writers = [_SplitWriter(out, name, encoder.dtype, record["settings"]["shard_tokens"], splits[name]["shards"])
               for name in SPLITS]
    start = min(resume)
    tasks_of: deque[tuple[list[int], list[int]]] = deque()  # (indices, splits) of each task sent, in order

    def tasks() -> Iterator[list[str]]:
        indices, which, texts, size = [], [], [], 0
        for index, text in itertools.islice(enumerate(iter_documents(cfg)), start, None):
            split = int(held(index))
            if index < resume[split]:
                continue  # already in a complete shard
            indices.append(index)
            which.append(split)
            texts.append(text)
            size += len(text)
            if size >= TASK_CHARACTERS or len(texts) >= TASK_DOCUMENTS:
                tasks_of.append((indices, which))
                yield texts
                indices, which, texts, size = [], [], [], 0
        if texts:
            tasks_of.append((indices, which))
            yield texts

    def checkpoint(position: int) -> None:
        for name, writer in zip(SPLITS, writers):
            splits[name]["resume"] = writer.first if writer.chunks else position
            splits[name]["tokens"] = sum(s["tokens"] for s in writer.shards)
            splits[name]["documents"] = sum(s["documents"] for s in writer.shards)
        _write_progress(out, record)

    def train_tokens() -> int:
        writer = writers[SPLITS.index("train")]
        return sum(s["tokens"] for s in writer.shards) + writer.pending_tokens

    # position: the source documents read; a resumed prepare re-adds its pending documents in the same order, so the
    # limit cuts at the same document
    position, tokens, began, cut = start, 0, time.perf_counter(), False
    with tqdm(desc="prepare", total=record["documents"], initial=start, unit=" documents", disable=not progress,
              dynamic_ncols=True) as bar:
        for flat, lengths in encode_ordered(encoder, tasks(), num_proc):
            indices, which = tasks_of.popleft()
            ends = np.cumsum(lengths)
            for index, split, end, length in zip(indices, which, ends.tolist(), lengths.tolist()):
                if writers[split].add(index, flat[end - length:end]):
                    checkpoint(index)
                tokens += length
                bar.update(index + 1 - position)
                position = index + 1
                if limit is not None and SPLITS[split] == "train" and train_tokens() >= limit:
                    cut = True
                    break
            rate = tokens / max(time.perf_counter() - began, 1e-9)
            bar.set_postfix_str(f"{tokens / 1e6:.1f}M tokens, {rate / 1e6:.2f}M tokens/s", refresh=False)
            if cut:
                break
    for writer in writers:
        writer.flush()
    checkpoint(position)
    if not splits["train"]["documents"]:
        raise ValueError(f"SOURCE {cfg.source} leaves no training documents after holding out validation; hold out "
                         f"fewer (--validation-fraction / --validation-documents); OUT {out} cannot be completed: "
                         "remove it")
    if not splits["validation"]["documents"]:
        read = "" if limit is None or not cut else f" of the {position} read before --max-tokens {limit}"
        raise ValueError(f"SOURCE {cfg.source}: no document{read} was held out for validation, and a run from the "
                         "folder validates on them; hold out more (--validation-fraction / --validation-documents)"
                         f"{' or raise --max-tokens' if read else ''}; OUT {out} cannot be completed: remove it")
    record["documents"] = position if record["documents"] is None or cut else record["documents"]
    record["complete"] = True
    for name in SPLITS:
        del splits[name]["resume"]
    record["fingerprint"] = corpus_fingerprint(record)
    write_json_atomic(out / METADATA, record)
    (out / PROGRESS).unlink(missing_ok=True)
