"""Token sequences and batches: documents tokenised and packed into fixed-length sequences that keep document
boundaries, and the batches of every step.

A batch of B sequences of T tokens reaches the model as one packed row ``[1, B*T]`` with ``cu_seqlens`` listing
every document start and every sequence start, so no recurrent state or attention crosses a document (and the
model's loss skips cross-document predictions). Which sequences make step ``s`` is a pure function of
``(seed, s)``: resuming needs only the step counter, and every rank takes its own slice of the same global batch.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
    start of the next one. The last partial sequence is dropped. Linear in the tokens, however long a document:
    the buffer is read from a moving ``head`` and compacted only once the part already cut is its larger half."""
    buffer: list[int] = []
    head = 0  # where the next sequence starts in ``buffer``
    starts: deque[int] = deque()  # where documents start in ``buffer``, from the first at or after ``head``
    for ids in token_lists:
        starts.append(len(buffer))
        buffer.extend(ids)
        buffer.append(eos_id)
        while len(buffer) - head >= seq_len:
            end = head + seq_len
            inside = []
            for start in starts:
                if start >= end:
                    break
                if start > head:
                    inside.append(start - head)
            yield buffer[head:end], inside
            head = end
            while starts and starts[0] <= head:  # a document starting at ``head`` starts the next sequence
                starts.popleft()
        if head and 2 * head >= len(buffer):
            del buffer[:head]
            starts = deque(s - head for s in starts)
            head = 0


def tokenize(tokenizer: PreTrainedTokenizerBase, documents: Iterable[str], batch: int = 256) -> Iterator[list[int]]:
    iterator = iter(documents)
    while chunk := list(itertools.islice(iterator, batch)):
        yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]


def pack_all(tokenizer: PreTrainedTokenizerBase, documents: Iterable[str], seq_len: int, what: str) -> PackedSequences:
    """Every sequence of ``documents`` (:func:`pack`), with a progress bar when it takes more than a moment."""
    from tqdm.auto import tqdm

    rows, starts = [], []
    documents = tqdm(documents, desc=f"tokenising and packing the {what} text", unit=" documents", delay=2,
                     total=len(documents) if isinstance(documents, Sized) else None, leave=False)
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
