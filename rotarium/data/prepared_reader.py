"""The reader of a prepared folder (:class:`PreparedCorpus`), which ``rotarium prepare`` writes
(:mod:`rotarium.data.prepared_writer`); docs/data.md.

A folder holds, per split (``train``, ``validation``), shards ``<split>/<k>.tokens.npy`` (the documents' token ids
one after the other, uint16 when the vocabulary fits, else uint32) with ``<split>/<k>.offsets.npy`` (int64, where
each document starts, then the shard's length), the tokenizer (``tokenizer/``), and ``metadata.json``, written last.
A document never spans two shards. Each document is its ids with the tokenizer's bos before them where its template
adds one, and eos after them, as training ends documents.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rotarium.data.tokenizer import load_tokenizer
from rotarium.utils.files import (
    file_sha256,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMAT = "rotarium-prepared"
FORMAT_VERSION = 1
METADATA = "metadata.json"
PROGRESS = "progress.json"
TOKENIZER = "tokenizer"
SPLITS = ("train", "validation")


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


def shard_files(split: str, k: int) -> tuple[str, str]:
    """The paths, inside the folder, of shard ``k`` of ``split``: its tokens and its document offsets."""
    return f"{split}/{k:05d}.tokens.npy", f"{split}/{k:05d}.offsets.npy"


def read_json(path: Path, what: str) -> dict[str, Any] | None:
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


def corpus_fingerprint(record: dict[str, Any]) -> str:
    """SHA-256 over the tokenizer's fingerprint, the framing and every shard file's SHA-256, in order."""
    parts = {"tokenizer": record["tokenizer"], "dtype": record["dtype"],
             "files": [[name, f["sha256"]] for split in SPLITS for shard in record["splits"][split]["shards"]
                       for name, f in shard["files"].items()]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    """A folder written by :func:`~rotarium.data.prepared_writer.prepare`, checked on opening: its
    ``metadata.json`` says it is complete and of this format version, and every shard file has its recorded size
    (:meth:`verify` checks the SHA-256 too). ``fingerprint`` identifies the folder's content; ``train`` and
    ``validation`` are its splits."""

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
    metadata = read_json(path / METADATA, "metadata")
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
    if corpus_fingerprint(metadata) != metadata["fingerprint"]:
        raise damaged("fingerprint", "is not the one of the shard files and tokenizer it lists (it was edited)")
