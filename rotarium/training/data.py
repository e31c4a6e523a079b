"""Training data: documents from the embedded corpus, local files or the Hub (``datasets``), tokenised, packed into
fixed-length sequences that keep document boundaries, a held-out validation split, and the batches.

A batch of B sequences of T tokens reaches the model as one packed row ``[1, B*T]`` with ``cu_seqlens`` listing
every document start and every sequence start, so no recurrent state or attention crosses a document (and the
model's loss skips cross-document predictions). Which sequences make step ``s`` is a pure function of
``(seed, s)``: resuming needs only the step counter, and every rank takes its own slice of the same global batch.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rotarium.training.config import DataSection

LOCAL_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                 ".parquet": "parquet"}


def embedded_documents() -> list[str]:
    """The standard library's documentation topics (``pydoc_data.topics``, ~465k characters of English prose and
    code that every Python installation carries), cut at paragraph boundaries into documents of ~2k characters."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        current: list[str] = []
        for paragraph in topics[name].split("\n\n"):
            current.append(paragraph)
            if sum(map(len, current)) > 2000:
                documents.append("\n\n".join(current).strip())
                current = []
        if current and "".join(current).strip():
            documents.append("\n\n".join(current).strip())
    return documents


def _local_files(source: str) -> tuple[str, list[str]]:
    path = Path(source)
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_FORMATS) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"`data.source={source}`: no {'/'.join(LOCAL_FORMATS)} files in that folder")
    kinds = {LOCAL_FORMATS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"`data.source={source}`: files must all be one of {', '.join(LOCAL_FORMATS)}")
    return kinds.pop(), [str(p) for p in files]


def iter_documents(cfg: DataSection, *, skip: int = 0, shuffle_seed: int | None = None) -> Iterable[str]:
    """Every document's text in a fixed order, after the first ``skip``. With ``cfg.streaming`` and a
    ``shuffle_seed``, a Hub or JSON/Parquet stream is shuffled through a ``shuffle_buffer`` after the skip (so the
    held-out first documents never reach training). Raises ``ValueError`` for a missing file or text field."""
    if cfg.source == "embedded":
        return embedded_documents()[skip:]
    import datasets

    looks_local = Path(cfg.source).exists() or Path(cfg.source).suffix in LOCAL_FORMATS or cfg.source.startswith(
        (".", "/", "~"))
    if looks_local:
        if not Path(cfg.source).exists():
            raise ValueError(f"`data.source={cfg.source}`: no such file or folder")
        kind, files = _local_files(cfg.source)
        if kind == "text":
            # One document per file separated by blank lines: a text file is a corpus of paragraphs/articles.
            return itertools.islice((doc.strip() for f in files
                                     for doc in Path(f).read_text(encoding="utf-8").split("\n\n\n")
                                     if doc.strip()), skip, None)
        try:
            dataset = datasets.load_dataset(kind, data_files=files, split="train", streaming=cfg.streaming)
        except Exception as error:  # an empty file raises StopIteration or "corresponds to no data" ValueError
            if all(not Path(f).read_bytes().strip() for f in files):
                raise ValueError(f"`data.source={cfg.source}` is empty: no {kind} rows to train on") from error
            raise ValueError(f"`data.source={cfg.source}` could not be read as {kind}: "
                             f"{type(error).__name__}: {error}") from error
    else:
        try:
            dataset = datasets.load_dataset(cfg.source, cfg.hub_config, split=cfg.split, streaming=cfg.streaming)
        except Exception as error:  # datasets raises many types (FileNotFoundError, ConnectionError, ...)
            raise ValueError(f"`data.source={cfg.source}` is not a local file and could not be opened from the "
                             f"Hub: {error}") from error
    columns = dataset.column_names
    if columns is not None and cfg.text_field not in columns:
        raise ValueError(f"`data.text_field={cfg.text_field}` is not a column of {cfg.source}; columns: {columns}")
    if cfg.streaming:
        dataset = dataset.skip(skip) if skip else dataset
        if shuffle_seed is not None and cfg.shuffle_buffer > 1:
            dataset = dataset.shuffle(seed=shuffle_seed, buffer_size=cfg.shuffle_buffer)
    elif skip:
        dataset = dataset.select(range(min(skip, len(dataset)), len(dataset)))
    return (row[cfg.text_field] for row in dataset if row.get(cfg.text_field) and row[cfg.text_field].strip())


def split_documents(documents: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, validation): a seeded random ``fraction`` of the documents (at least one) is held out."""
    if len(documents) < 2:
        raise ValueError(f"the dataset has {len(documents)} document(s); a validation split needs at least 2")
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    n_val = max(1, round(fraction * len(documents)))
    held = set(order[:n_val])
    return ([d for i, d in enumerate(documents) if i not in held], [d for i, d in enumerate(documents) if i in held])


@dataclass
class PackedSequences:
    """``tokens`` ``[N, T]`` and, per sequence, the offsets (inside it, 0 excluded) where a new document starts."""
    tokens: torch.Tensor
    starts: list[list[int]]

    def __len__(self) -> int:
        return self.tokens.shape[0]


def pack(token_lists: Iterable[list[int]], seq_len: int, eos_id: int) -> Iterator[tuple[list[int], list[int]]]:
    """Concatenates documents (each ended by ``eos_id``) and cuts the stream into sequences of ``seq_len`` tokens,
    yielding ``(tokens, document starts inside the sequence)``; a document cut at a sequence end continues at the
    start of the next one. The last partial sequence is dropped."""
    buffer: list[int] = []
    starts: list[int] = []
    for ids in token_lists:
        starts.append(len(buffer))
        buffer.extend(ids)
        buffer.append(eos_id)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len], [s for s in starts if 0 < s < seq_len]
            buffer = buffer[seq_len:]
            starts = [s - seq_len for s in starts if s - seq_len >= 0]


def tokenize(tokenizer, documents: Iterable[str], batch: int = 256) -> Iterator[list[int]]:
    iterator = iter(documents)
    while chunk := list(itertools.islice(iterator, batch)):
        yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]


def pack_all(tokenizer, documents: Iterable[str], seq_len: int, what: str) -> PackedSequences:
    rows, starts = [], []
    for tokens, doc_starts in pack(tokenize(tokenizer, documents), seq_len, tokenizer.eos_token_id):
        rows.append(tokens)
        starts.append(doc_starts)
    if not rows:
        raise ValueError(f"the {what} text is too short for one training sequence of `data.seq_len={seq_len}` "
                         "tokens; give more text or a smaller seq_len")
    return PackedSequences(torch.tensor(rows, dtype=torch.long), starts)


def collate(tokens: torch.Tensor, starts: list[list[int]]) -> dict[str, torch.Tensor]:
    """B sequences -> one packed row ``[1, B*T]`` with ``cu_seqlens`` at every sequence and document start."""
    B, T = tokens.shape
    cu = sorted({b * T + s for b in range(B) for s in [0, *starts[b]]} | {B * T})
    input_ids = tokens.reshape(1, B * T)
    return {"input_ids": input_ids, "labels": input_ids.clone(), "cu_seqlens": torch.tensor(cu, dtype=torch.long)}


class BatchSchedule:
    """The sequences of every micro-batch of a run, from the step number alone.

    Epoch ``e`` visits the training sequences in the order ``randperm(N, seed + e)``; optimizer step ``s`` takes the
    next ``world * accum * B`` of them (wrapping into the next epoch), and rank ``r`` micro-step ``a`` takes its
    ``B``. Identical on every rank, so the ranks' data are disjoint within a step without any communication.
    """

    def __init__(self, data: PackedSequences, batch_size: int, accum: int, world: int, rank: int, seed: int):
        self.data, self.B, self.accum, self.world, self.rank, self.seed = data, batch_size, accum, world, rank, seed
        self._epoch, self._order = -1, None

    @property
    def global_batch(self) -> int:
        return self.B * self.accum * self.world

    def _index(self, position: int) -> int:
        n = len(self.data)
        epoch, i = divmod(position, n)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000003 + epoch))
        return int(self._order[i])

    def indices(self, step: int, micro: int) -> list[int]:
        first = step * self.global_batch + (micro * self.world + self.rank) * self.B
        return [self._index(p) for p in range(first, first + self.B)]

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        idx = self.indices(step, micro)
        return collate(self.data.tokens[idx], [self.data.starts[i] for i in idx])


def validation_batches(data: PackedSequences, batch_size: int, max_batches: int, world: int, rank: int
                       ) -> list[dict[str, torch.Tensor]]:
    """Fixed validation batches, this rank's share (round-robin by batch, so each rank scores different text)."""
    out = []
    for k, first in enumerate(range(0, len(data), batch_size)):
        if k >= max_batches * world:
            break
        if k % world == rank:
            idx = list(range(first, min(first + batch_size, len(data))))
            out.append(collate(data.tokens[idx], [data.starts[i] for i in idx]))
    return out


class StreamingSchedule:
    """The streaming counterpart of :class:`BatchSchedule` for corpora too large to tokenise up front (a Hub
    dataset with ``streaming``): sequences come in stream order, from ``make_stream(epoch)`` (a new pass, with its
    own shuffle, when one ends); every rank reads the stream and keeps its own slice; resuming at step ``s`` skips
    the first ``s`` global batches."""

    def __init__(self, make_stream: Callable[[int], Iterator[tuple[list[int], list[int]]]], batch_size: int,
                 accum: int, world: int, rank: int, start_step: int):
        self.make_stream, self.B, self.accum, self.world, self.rank = make_stream, batch_size, accum, world, rank
        self.global_batch = batch_size * accum * world
        self.epoch, self.sequences = 0, make_stream(0)
        for _ in range(start_step * self.global_batch):
            self._next()
        self._step, self._pending = start_step, []

    def _next(self) -> tuple[list[int], list[int]]:
        for _ in range(2):
            try:
                return next(self.sequences)
            except StopIteration:
                self.epoch += 1
                self.sequences = self.make_stream(self.epoch)
        raise ValueError("the training stream holds no complete training sequence; give more text or a smaller "
                         "`data.seq_len`")

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        if micro == 0:
            if step != self._step:
                raise RuntimeError("streaming batches must be read in order")
            self._pending = [self._next() for _ in range(self.global_batch)]
            self._step += 1
        mine = self._pending[(micro * self.world + self.rank) * self.B:][:self.B]
        return collate(torch.tensor([r[0] for r in mine]), [r[1] for r in mine])
