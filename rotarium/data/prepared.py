"""Prepared corpora: a source tokenised once into memory-mappable token shards (``rotarium prepare``), and the reader
of such a folder (docs/data.md).

A folder holds, per split (``train``, ``validation``), shards ``<split>/<k>.tokens.npy`` (the documents' token ids
one after the other, uint16 when the vocabulary fits, else uint32) with ``<split>/<k>.offsets.npy`` (int64, where
each document starts, then the shard's length), the tokenizer (``tokenizer/``), and ``metadata.json``, written last.
A document never spans two shards. Each document is its ids with the tokenizer's bos before them where its template
adds one, and eos after them, as training ends documents.

Which documents are held out is decided per document from its index in the source, and which shard a document goes
to from the token counts alone, so the shards are a function of the source and the settings, never of the number of
processes or of where a previous prepare was killed: ``progress.json`` records after every shard where each split
continues, and a rerun picks up there.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
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

FORMAT = "rotarium-prepared"
FORMAT_VERSION = 1
METADATA = "metadata.json"
PROGRESS = "progress.json"
TOKENIZER = "tokenizer"
SPLITS = ("train", "validation")
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


def default_num_proc() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --------------------------------------------------------------------------------------------------------------
# What is held out


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Which source documents (by index, from 0) are held out for validation.

    ``permutation`` (a source read whole): the first ``documents`` of ``randperm(n)`` seeded with ``seed + 1``, the
    rule of :func:`~rotarium.data.documents.split_documents`, so a fraction holds out what ``rotarium train`` holds
    out with the same seed. ``hash`` (a stream, by fraction): a document is held out when a seeded hash of its index
    falls below ``fraction``, which needs no look-ahead. ``first`` (a stream, by count): its first ``documents``, as
    ``rotarium train`` holds out of a stream."""
    rule: str
    seed: int
    fraction: float | None = None
    documents: int | None = None
    total: int | None = None

    def mask(self) -> np.ndarray | None:
        """``permutation``: bool ``[total]``, True where held out; else None (decided per index)."""
        if self.rule != "permutation":
            return None
        import torch

        order = torch.randperm(self.total, generator=torch.Generator().manual_seed(self.seed + 1))
        mask = np.zeros(self.total, dtype=bool)
        mask[order[:self.documents].numpy()] = True
        return mask

    def decider(self) -> Callable[[int], bool]:
        """``index -> held out``."""
        if self.rule == "permutation":
            mask = self.mask()
            return lambda index: bool(mask[index])
        if self.rule == "first":
            return lambda index: index < self.documents
        threshold = int(self.fraction * 2 ** 64)
        return lambda index: _index_hash(self.seed, index) < threshold

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _index_hash(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little")


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


# --------------------------------------------------------------------------------------------------------------
# The tokenizer and how a document is framed


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over what decides a text's ids: the normaliser, pre-tokeniser, model (vocabulary, merges) and added
    tokens of its ``tokenizer.json``, and the bos, eos and pad ids; canonical JSON (sorted keys), so a tokenizer
    saved and loaded again keeps its fingerprint."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    canonical = {key: spec.get(key) for key in ("normalizer", "pre_tokenizer", "model", "added_tokens")}
    canonical["special_ids"] = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
                                "pad": tokenizer.pad_token_id}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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


# --------------------------------------------------------------------------------------------------------------
# Writing shards


def shard_files(split: str, k: int) -> tuple[str, str]:
    """The paths, inside the folder, of shard ``k`` of ``split``: its tokens and its document offsets."""
    return f"{split}/{k:05d}.tokens.npy", f"{split}/{k:05d}.offsets.npy"


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


# --------------------------------------------------------------------------------------------------------------
# prepare


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


def _read_json(path: Path, what: str) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); {what}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not the {what} of a `rotarium prepare`; choose another folder")
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {data.get('format_version')}, this rotarium reads version "
                         f"{FORMAT_VERSION}; prepare the source again into a new folder")
    return data


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


def _corpus_fingerprint(record: dict[str, Any]) -> str:
    """SHA-256 over the tokenizer's fingerprint, the framing and every shard file's SHA-256, in order."""
    parts = {"tokenizer": record["tokenizer"], "dtype": record["dtype"],
             "files": [[name, f["sha256"]] for split in SPLITS for shard in record["splits"][split]["shards"]
                       for name, f in shard["files"].items()]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
        finished = _read_json(out / METADATA, "metadata")
        if finished is not None:
            _refuse_other_settings(finished["settings"], settings, out)
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


def _prepare(cfg: DataSection, out: Path, settings: dict[str, Any], num_proc: int, progress: bool) -> None:
    record = _read_json(out / PROGRESS, "progress record")
    if record is not None:
        _refuse_other_settings(record["settings"], settings, out)
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
    record["fingerprint"] = _corpus_fingerprint(record)
    write_json_atomic(out / METADATA, record)
    (out / PROGRESS).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------------------
# Reading


class PreparedSplit:
    """One split of a prepared folder: its documents one after the other as one token stream of ``num_tokens``
    tokens, read through memory maps of the shards (none is read whole)."""

    def __init__(self, root: Path, name: str, record: dict[str, Any], dtype: np.dtype):
        self.root, self.name, self.record, self.dtype = root, name, record, dtype
        self.num_tokens: int = record["tokens"]
        self.num_documents: int = record["documents"]
        self.shard_sizes = np.array([s["tokens"] for s in record["shards"]], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self.shard_documents = np.concatenate(
            [[0], np.cumsum([s["documents"] for s in record["shards"]])]).astype(np.int64)
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._offsets: np.ndarray | None = None

    @property
    def num_shards(self) -> int:
        return len(self.record["shards"])

    def shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard ``k`` as memory maps: ``(tokens [n_k], offsets [d_k + 1])``, offsets from 0 to ``n_k``. A file
        that is not the array its record describes raises a one-line ``ValueError`` naming it."""
        if k not in self._maps:
            self._maps[k] = tuple(_open_array(self.root, name, *_expected(self.record, self.dtype, name, k))
                                  for name in shard_files(self.name, k))
        return self._maps[k]

    def document_offsets(self) -> np.ndarray:
        """int64 ``[num_documents + 1]``: where each document starts in the split's token stream, then its end."""
        if self._offsets is None:
            parts = [np.asarray(self.shard(k)[1][:-1]) + self.shard_starts[k] for k in range(self.num_shards)]
            self._offsets = np.concatenate([*parts, [self.num_tokens]]).astype(np.int64)
        return self._offsets

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s ids ``[length]``, with its bos (where the folder adds one) and eos."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} of the {self.name} split, which has {self.num_documents}")
        k = int(np.searchsorted(self.shard_documents, i, side="right") - 1)
        tokens, offsets = self.shard(k)
        j = i - int(self.shard_documents[k])
        return np.asarray(tokens[offsets[j]:offsets[j + 1]])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """The ids at positions ``[start, stop)`` of the token stream, ``[stop - start]``, across shards."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) of the {self.name} split, which has {self.num_tokens}")
        parts = []
        k = int(np.searchsorted(self.shard_starts, start, side="right") - 1)
        while start < stop:
            base = int(self.shard_starts[k])
            end = min(stop, base + int(self.shard_sizes[k]))
            parts.append(self.shard(k)[0][start - base:end - base])
            start, k = end, k + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """int64: the documents starting strictly inside ``(start, stop)``, relative to ``start`` (the
        ``cu_seqlens`` material of a window of the stream). Searches the shards' own offset maps, so reading a
        window holds no index of the whole split in memory."""
        parts = []
        k = int(np.searchsorted(self.shard_starts, start, side="right") - 1)
        while k < self.num_shards and self.shard_starts[k] < stop:
            base = int(self.shard_starts[k])
            starts = self.shard(k)[1][:-1]  # a shard starts with a document and ends where the next shard starts
            lo = np.searchsorted(starts, start - base, side="right")
            hi = np.searchsorted(starts, stop - base, side="left")
            parts.append(np.asarray(starts[lo:hi], dtype=np.int64) + (base - start))
            k += 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a DataLoader worker) without its maps, which the worker opens again: a memory map pickles
        as its whole content."""
        return {**self.__dict__, "_maps": {}, "_offsets": None}

    def __len__(self) -> int:
        return self.num_documents

    def __iter__(self) -> Iterator[np.ndarray]:
        for k in range(self.num_shards):
            tokens, offsets = self.shard(k)
            for j in range(len(offsets) - 1):
                yield np.asarray(tokens[offsets[j]:offsets[j + 1]])


class PreparedCorpus:
    """A folder written by :func:`prepare`, checked on opening: its ``metadata.json`` says it is complete and of
    this format version, and every shard file has its recorded size (:meth:`verify` checks the SHA-256 too).
    ``fingerprint`` identifies the folder's content; ``train`` and ``validation`` are its splits."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.metadata = _read_metadata(self.path)
        self.fingerprint: str = self.metadata["fingerprint"]
        self.dtype = np.dtype(self.metadata["dtype"])
        self.bos_id: int | None = self.metadata["tokenizer"]["bos_id"]
        self.eos_id: int = self.metadata["tokenizer"]["eos_id"]
        self.tokenizer_sha256: str = self.metadata["tokenizer"]["sha256"]
        self.splits = {name: PreparedSplit(self.path, name, self.metadata["splits"][name], self.dtype)
                       for name in SPLITS}
        for split in self.splits.values():
            for k, shard in enumerate(split.record["shards"]):
                for name, file in shard["files"].items():
                    _check_size(self.path, name, file["bytes"])
                    _check_header(self.path, name, *_expected(split.record, self.dtype, name, k))

    @property
    def identity(self) -> dict[str, str]:
        """What a run records of the folder, to know it again: its ``fingerprint`` and its tokenizer's SHA-256."""
        return {"prepared": self.fingerprint, "tokenizer": self.tokenizer_sha256}

    @property
    def train(self) -> PreparedSplit:
        return self.splits["train"]

    @property
    def validation(self) -> PreparedSplit:
        return self.splits["validation"]

    def held_out(self) -> HeldOut:
        """The rule that chose the validation documents, by their index in the source."""
        return HeldOut(**self.metadata["held_out"])

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The folder's tokenizer, refused when it is not the one the shards were made with."""
        tokenizer = load_tokenizer(str(self.path / TOKENIZER))
        now, recorded = tokenizer_fingerprint(tokenizer), self.metadata["tokenizer"]["sha256"]
        if now != recorded:
            raise ValueError(f"{self.path / TOKENIZER} is not the tokenizer {self.path} was prepared with (SHA-256 "
                             f"{now[:12]}, recorded {recorded[:12]}); prepare the source again into a new folder")
        return tokenizer

    def decode(self, ids: np.ndarray, tokenizer: PreTrainedTokenizerBase) -> str:
        """A document's text from its ids (its bos and eos dropped)."""
        ids = ids.tolist()
        if self.bos_id is not None and ids[:1] == [self.bos_id]:
            ids = ids[1:]
        if ids[-1:] == [self.eos_id]:
            ids = ids[:-1]
        return tokenizer.decode(ids)

    def verify(self, splits: tuple[str, ...] = SPLITS) -> None:
        """Raises ``ValueError`` naming the first shard file of ``splits`` whose SHA-256 is not the recorded one."""
        for split in (self.splits[name] for name in splits):
            for shard in split.record["shards"]:
                for name, file in shard["files"].items():
                    if file_sha256(self.path / name) != file["sha256"]:
                        raise ValueError(f"{self.path / name} changed since it was prepared (its SHA-256 is not the "
                                         f"one in {METADATA}): the folder is damaged; prepare the source again into "
                                         "a new folder")


def is_prepared(source: str | os.PathLike) -> bool:
    """Whether ``source`` (a ``data.source``) names a prepared folder, finished or not: a folder holding
    ``metadata.json`` or a prepare's ``progress.json`` (:class:`PreparedCorpus` refuses an unfinished one)."""
    path = Path(source)
    return path.is_dir() and ((path / METADATA).is_file() or (path / PROGRESS).is_file())


def _expected(record: dict[str, Any], dtype: np.dtype, name: str, k: int) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype the file ``name`` of shard ``k`` of a split (its ``record``) holds."""
    shard = record["shards"][k]
    if name.endswith(".tokens.npy"):
        return (shard["tokens"],), dtype
    return (shard["documents"] + 1,), np.dtype(np.int64)


def _damaged(path: Path, reason: str) -> ValueError:
    return ValueError(f"shard file {path} is damaged ({reason}); prepare the source again into a new folder "
                      "(PreparedCorpus(FOLDER).verify() checks every shard's SHA-256)")


def _check_header(root: Path, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """The ``.npy`` header of ``root / name`` describes ``shape`` and ``dtype``: the counts ``metadata.json``
    records are those of the files, read without reading the arrays."""
    path = root / name
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            found, fortran, found_dtype = read(f)
    except (OSError, ValueError, EOFError) as error:
        raise _damaged(path, f"not a .npy array: {' '.join(str(error).split())[:120]}") from None
    if found != shape or found_dtype != dtype or fortran:
        raise _damaged(path, f"it holds {found_dtype}{list(found)}, {root / METADATA} records {dtype}{list(shape)}")


def _open_array(root: Path, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    _check_header(root, name, shape, dtype)
    try:
        return np.load(root / name, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise _damaged(root / name, " ".join(str(error).split())[:120]) from None


def _check_size(root: Path, name: str, size: int) -> None:
    path = root / name
    if not path.is_file():
        raise ValueError(f"{path} is missing, which {root / METADATA} lists; the folder is damaged: prepare the "
                         "source again into a new folder")
    if path.stat().st_size != size:
        raise ValueError(f"{path} has {path.stat().st_size} bytes, {root / METADATA} records {size}; the folder is "
                         "damaged: prepare the source again into a new folder")


def _read_metadata(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder; give a folder written by `rotarium prepare`")
    metadata = _read_json(path / METADATA, "metadata")
    if metadata is None:
        if (path / PROGRESS).is_file():
            raise ValueError(f"{path} is a prepare that did not finish (no {METADATA}); rerun `rotarium prepare` with "
                             "the same arguments to complete it")
        raise ValueError(f"{path} has no {METADATA}: it is not a prepared folder; run `rotarium prepare SOURCE "
                         f"{path}` first")
    if metadata.get("complete") is not True or "fingerprint" not in metadata:
        raise ValueError(f"{path / METADATA} does not describe a complete prepare; rerun `rotarium prepare` with the "
                         "same arguments to complete it")
    _check_metadata(path / METADATA, metadata)
    return metadata


def _check_metadata(where: Path, metadata: dict[str, Any]) -> None:
    """Raises a one-line ``ValueError`` naming the first field of ``metadata.json`` (read from ``where``) that the
    reader cannot use, or whose counts disagree with its shards'; the fingerprint, over the file list and the
    tokenizer, catches an edit to the rest."""
    def damaged(field: str, why: str) -> ValueError:
        return ValueError(f"{where} is damaged: `{field}` {why}; prepare the source again into a new folder")

    def count(value: Any, field: str, least: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise damaged(field, f"is {value!r}, not a whole number of at least {least}")
        return value

    def text(value: Any, field: str) -> None:
        if not isinstance(value, str):
            raise damaged(field, f"is {value!r}, not a string")

    if metadata.get("dtype") not in ("uint16", "uint32"):
        raise damaged("dtype", f"is {metadata.get('dtype')!r}, not uint16 or uint32")
    text(metadata["fingerprint"], "fingerprint")
    tokenizer = metadata.get("tokenizer")
    if not isinstance(tokenizer, dict):
        raise damaged("tokenizer", f"is {tokenizer!r}, not an object")
    text(tokenizer.get("sha256"), "tokenizer.sha256")
    count(tokenizer.get("eos_id"), "tokenizer.eos_id")
    if tokenizer.get("bos_id") is not None:
        count(tokenizer["bos_id"], "tokenizer.bos_id")
    held = metadata.get("held_out")
    rules = {"permutation": ("documents", "total"), "first": ("documents",), "hash": ("fraction",)}
    fields = {field.name for field in dataclasses.fields(HeldOut)}
    if not isinstance(held, dict) or not isinstance(held.get("rule"), str) or held["rule"] not in rules or (
            set(held) - fields):
        raise damaged("held_out", f"is {held!r}, not a rule of {', '.join(rules)}")
    count(held.get("seed"), "held_out.seed")
    for key in rules[held["rule"]]:
        if key == "fraction":
            if not isinstance(held.get(key), float) or not 0 <= held[key] <= 1:
                raise damaged("held_out.fraction", f"is {held.get(key)!r}, not a fraction")
        else:
            count(held.get(key), f"held_out.{key}")
    splits = metadata.get("splits")
    if not isinstance(splits, dict):
        raise damaged("splits", f"is {splits!r}, not an object")
    for name in SPLITS:
        split = splits.get(name)
        if not isinstance(split, dict) or not isinstance(split.get("shards"), list):
            raise damaged(f"splits.{name}", "is not a split (tokens, documents, shards)")
        for k, shard in enumerate(split["shards"]):
            field, names = f"splits.{name}.shards[{k}]", shard_files(name, k)
            files = shard.get("files") if isinstance(shard, dict) else None
            if not isinstance(files, dict) or set(files) != set(names):
                raise damaged(field, f"does not list the files {' and '.join(names)}")
            count(shard.get("tokens"), f"{field}.tokens", 1)
            count(shard.get("documents"), f"{field}.documents", 1)
            for file_name, file in shard["files"].items():
                if not isinstance(file, dict):
                    raise damaged(f"{field}.files.{file_name}", "is not an object (bytes, sha256)")
                count(file.get("bytes"), f"{field}.files.{file_name}.bytes")
                text(file.get("sha256"), f"{field}.files.{file_name}.sha256")
        for key in ("tokens", "documents"):
            total = sum(shard[key] for shard in split["shards"])
            if count(split.get(key), f"splits.{name}.{key}") != total:
                raise damaged(f"splits.{name}.{key}", f"is {split[key]}, but its shards hold {total}")
    if _corpus_fingerprint(metadata) != metadata["fingerprint"]:
        raise damaged("fingerprint", "is not the one of the shard files and tokenizer it lists (it was edited)")
