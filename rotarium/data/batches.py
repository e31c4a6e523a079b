"""Token sequences and batches: documents tokenised and packed into fixed-length sequences that keep document
boundaries, and the batches of every step.

A batch of B sequences of T tokens reaches the model as one packed row ``[1, B*T]`` with ``cu_seqlens`` listing
every document start and every sequence start, so no recurrent state or attention crosses a document (and the
model's loss skips cross-document predictions). Which sequences make step ``s`` is a pure function of
``(seed, s)``: resuming needs only the step counter (or the sequences consumed, which a checkpoint records), and
every rank takes its own slice of the same global batch. The sequences are packed in memory here, or read from a
prepared folder (:mod:`rotarium.data.loader`); the schedule is the same.
"""
from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from rotarium.utils.files import make_folder, write_file_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Sequences(Protocol):
    """Training sequences a :class:`BatchSchedule` picks from: ``len()`` of them, each ``T`` tokens."""

    def __len__(self) -> int: ...

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        """The sequences at ``indices``: tokens ``[len(indices), T]`` (int64) and, per sequence, the offsets inside
        it (0 excluded) where a document starts."""
        ...


@dataclass
class PackedSequences:
    """``tokens`` ``[N, T]`` and, per sequence, the offsets (inside it, 0 excluded) where a new document starts."""
    tokens: torch.Tensor
    starts: list[list[int]]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        return self.tokens[indices], [self.starts[i] for i in indices]


class Packer:
    """Documents in, sequences of ``seq_len`` tokens out: :meth:`add` appends a document and its ``eos_id``,
    :meth:`take` cuts the next sequence while :meth:`ready` says one is complete. A document cut at a sequence end
    continues at the start of the next one. :meth:`state` is what is left (the tokens not yet cut, with the
    document starts among them), from which ``Packer(seq_len, eos_id, **state)`` goes on with the same sequences.

    Linear in the tokens, however long a document: the buffer is read from a moving ``head`` and compacted only once
    the part already cut is its larger half."""

    def __init__(self, seq_len: int, eos_id: int, tokens: Iterable[int] = (), starts: Iterable[int] = ()):
        self.seq_len, self.eos_id = seq_len, eos_id
        self.buffer: list[int] = list(tokens)
        self.head = 0  # where the next sequence starts in ``buffer``
        self.starts: deque[int] = deque(starts)  # where documents start in ``buffer``, from the first after ``head``

    def add(self, ids: list[int]) -> None:
        self.starts.append(len(self.buffer))
        self.buffer.extend(ids)
        self.buffer.append(self.eos_id)

    def ready(self) -> bool:
        return len(self.buffer) - self.head >= self.seq_len

    def take(self) -> tuple[list[int], list[int]]:
        """The next sequence and the offsets inside it (0 excluded) where a document starts."""
        head, end = self.head, self.head + self.seq_len
        inside = []
        for start in self.starts:
            if start >= end:
                break
            if start > head:
                inside.append(start - head)
        sequence = self.buffer[head:end]
        self.head = end
        while self.starts and self.starts[0] <= end:  # a document starting at ``end`` starts the next sequence
            self.starts.popleft()
        if 2 * self.head >= len(self.buffer):
            del self.buffer[:self.head]
            self.starts = deque(s - self.head for s in self.starts)
            self.head = 0
        return sequence, inside

    def state(self) -> dict[str, list[int]]:
        """``{"tokens": [...], "starts": [...]}``: the tokens not cut yet and where documents start among them."""
        return {"tokens": self.buffer[self.head:], "starts": [s - self.head for s in self.starts]}


def pack(token_lists: Iterable[list[int]], seq_len: int, eos_id: int) -> Iterator[tuple[list[int], list[int]]]:
    """Concatenates documents (each ended by ``eos_id``) and cuts the stream into sequences of ``seq_len`` tokens,
    yielding ``(tokens, document starts inside the sequence)`` (:class:`Packer`). The last partial sequence is
    dropped."""
    packer = Packer(seq_len, eos_id)
    for ids in token_lists:
        packer.add(ids)
        while packer.ready():
            yield packer.take()


def added_bos(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The bos id when the tokenizer's own template starts a text with it (Llama's does, GPT-2's and rotarium's BPE do
    not), else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    with_special = tokenizer("a")["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if with_special[:1] == [bos] and without[:1] != [bos] else None


def document_start(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token a document's first token follows in training: the template's bos where it adds one
    (:func:`added_bos`), else the eos :func:`pack` ends the document before with. A text scored or continued from
    nothing (an empty prompt or context) starts after it."""
    bos = added_bos(tokenizer)
    return bos if bos is not None else tokenizer.eos_token_id


def tokenize(tokenizer: PreTrainedTokenizerBase, documents: Iterable[str], batch: int = 256) -> Iterator[list[int]]:
    """Each document's ids as training reads them, before the eos :func:`pack` ends it with: the text's ids, after
    the tokenizer's bos where its own template starts a text with one. A model pretrained so sees a document start
    as generation and evaluation prompts start (``tokenizer(prompt)`` adds that bos); only the bos is taken from the
    template, since the eos comes from packing and a template's other tokens (an eos of its own) would double it.
    ``rotarium prepare`` frames documents with this function too, so a prepared folder and a run that tokenises
    its text hold the same ids."""
    head = [bos] if (bos := added_bos(tokenizer)) is not None else []
    iterator = iter(documents)
    while chunk := list(itertools.islice(iterator, batch)):
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            yield head + ids if head else ids


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


# The cached order of an epoch is what a process maps instead of holding: from this many sequences on (32 MB of
# int64 per process, from about 8B tokens at 2048 a sequence), below it the order is computed in memory.
CACHE_ORDER_FROM = 1 << 22
ORDER_FILE = "order-{n}-{seed}-{epoch}.npy"


def save_array(path: str | os.PathLike, array: np.ndarray) -> None:
    """``array`` as the ``.npy`` file ``path``, written atomically (:func:`~rotarium.utils.files.write_file_atomic`)."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: given a path without .npy, np.save would append the suffix
            np.save(f, array, allow_pickle=False)

    write_file_atomic(path, write)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """int64 ``[n]``: the order in which epoch ``epoch`` visits ``n`` sequences, ``randperm(n)`` seeded with
    ``seed * 1000003 + epoch``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch)).numpy()


class EpochOrder:
    """``order(epoch)``: :func:`epoch_order` of ``n`` sequences, one epoch at a time (the newest kept).

    With a ``cache`` folder and at least ``cache_from`` sequences, an epoch's order is written there once
    (``order-<n>-<seed>-<epoch>.npy``, uint32 when ``n`` fits) and memory-mapped: every process of a machine then
    shares its pages instead of each holding a copy, and none recomputes it on resume. Processes that miss the file
    at the same time each write the same content under their own temporary name and rename it into place."""

    def __init__(self, n: int, seed: int, cache: str | os.PathLike | None = None,
                 cache_from: int = CACHE_ORDER_FROM):
        self.n, self.seed = n, seed
        self.cache = Path(cache) if cache is not None and n >= cache_from else None
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def path(self, epoch: int) -> Path | None:
        """Where epoch ``epoch``'s order is cached, or None when it is computed in memory."""
        return self.cache / ORDER_FILE.format(n=self.n, seed=self.seed, epoch=epoch) if self.cache else None

    def __call__(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order, self._epoch = self._load(epoch), epoch
        return self._order

    def _load(self, epoch: int) -> np.ndarray:
        path = self.path(epoch)
        if path is None:
            return epoch_order(self.n, self.seed, epoch)
        if path.is_file():
            try:
                order = np.load(path, mmap_mode="r", allow_pickle=False)
                if order.shape == (self.n,):
                    return order
            except ValueError:  # not an array file (replaced by hand): written again below
                pass
        order = epoch_order(self.n, self.seed, epoch)
        make_folder(self.cache, "the data-order cache")
        save_array(path, order.astype(np.uint32) if self.n < 2 ** 32 else order)
        return np.load(path, mmap_mode="r", allow_pickle=False)


class BatchSchedule:
    """The sequences of every micro-batch of a run, from the step number alone.

    ``data``: the training sequences, in memory (:class:`PackedSequences`) or read from a prepared folder
    (:class:`rotarium.data.loader.PreparedSequences`). Epoch ``e`` visits them in the order of
    :class:`EpochOrder`; optimizer step ``s`` takes the next ``world * accum * B`` of them (wrapping into the next
    epoch), and rank ``r`` micro-step ``a`` takes its ``B``. Identical on every rank, so the ranks' data are disjoint
    within a step without any communication, and finding the batch of any step takes the same time.

    The run's position in the data is the number of sequences consumed: ``start_sequences`` before ``start_step``
    (default ``start_step * global_batch``, which makes the batch of step ``s`` a function of ``(seed, s)`` alone; a
    resumed run passes the count its checkpoint recorded, so a changed global batch continues where the data
    stopped). ``order_cache``: see :class:`EpochOrder`.
    """

    def __init__(self, data: Sequences, batch_size: int, accum: int, world: int, rank: int, seed: int, *,
                 start_step: int = 0, start_sequences: int | None = None,
                 order_cache: str | os.PathLike | None = None):
        self.data, self.B, self.accum, self.world, self.rank, self.seed = data, batch_size, accum, world, rank, seed
        if len(data) < 1:
            raise ValueError("no training sequence to schedule")
        self.order = EpochOrder(len(data), seed, order_cache)
        self.restore(start_step, start_sequences)

    def restore(self, step: int, sequences: int | None = None) -> None:
        """Goes on from step ``step`` with ``sequences`` consumed before it (default ``step * global_batch``)."""
        self.start_step = step
        self.start_sequences = step * self.global_batch if sequences is None else sequences

    @property
    def global_batch(self) -> int:
        return self.B * self.accum * self.world

    def consumed(self, step: int) -> int:
        """Sequences the run has consumed before optimizer step ``step`` (0-based), all ranks together."""
        return self.start_sequences + (step - self.start_step) * self.global_batch

    def position(self, step: int) -> dict[str, int]:
        """The data position before step ``step``, as a checkpoint records it: ``epoch``, ``sequences`` (consumed
        since the run began), ``sequences_per_epoch`` and ``seed``."""
        consumed = self.consumed(step)
        return {"epoch": consumed // len(self.data), "sequences": consumed, "sequences_per_epoch": len(self.data),
                "seed": self.seed}

    def indices(self, step: int, micro: int) -> list[int]:
        """This rank's sequences of micro-batch ``micro`` of step ``step``."""
        n = len(self.data)
        first = self.consumed(step) + (micro * self.world + self.rank) * self.B
        out = []
        for position in range(first, first + self.B):
            epoch, i = divmod(position, n)
            out.append(int(self.order(epoch)[i]))
        return out

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """This rank's micro-batch ``micro`` of step ``step``, collated (:func:`collate`)."""
        return collate(*self.data.rows(self.indices(step, micro)))


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
