"""Training on a stream without preparing it (``data.streaming``): each process reads its own shards of the stream,
DataLoader worker processes tokenise, and every checkpoint records where each process stands, so a resume goes on
from there instead of reading the stream again from its start.

**What a process reads.** The stream's shards are its files (:class:`~rotarium.data.documents.StreamShards`). When
their count is a multiple of the number of processes, process ``r`` reads shards ``r, r + W, ...``, the assignment
``datasets.distributed.split_dataset_by_node`` makes; otherwise every process reads every shard and keeps one row in
``W`` (tokenising only those), which is logged. The shards are read one at a time with ``IterableDataset.shard`` and
resumed with ``.skip``, never after a node split (``skip`` after ``split_dataset_by_node`` divides its count between
the nodes, pytorch/torchtitan#809), and never through ``IterableDataset.shuffle``: in datasets 5 a shuffled stream
reports fewer shards than it has, so the node split silently falls back to every node reading everything
(huggingface/datasets#8669), and its shuffle buffer is lost on resume.

**The order.** Epoch ``e`` of a process visits its shards in a seeded order, and each shard's training rows (after
the held-out ones at the stream's head) in blocks of ``data.shuffle_buffer`` rows, each block in a seeded order; so
the row at a position ``(epoch, shard in the epoch's order, row in that shard's shuffled rows)`` is a function of the
seed alone, and a resume re-reads at most the current block. The process's documents are packed into sequences
(:class:`~rotarium.data.batches.Packer`) in that order, ``train.batch_size`` to a micro-batch.

**Workers.** Every worker of the process's DataLoader reads the process's rows and tokenises every ``W``-th chunk
of :data:`CHUNK_DOCUMENTS` documents, so the documents reach the training thread in the stream's order whatever
``data.num_workers`` is; the training thread only packs them. Reading every row in each worker costs far less
than tokenising (decoding JSON or Parquet rows against running a BPE over them).

**The position.** :meth:`StreamLoader.state` is the position after the last document packed and the tokens the
packer holds (at most a sequence and the rest of the document it cut). It is taken when a checkpoint is written,
nowhere else, and a loader built with it yields the micro-batches the interrupted one would have.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rotarium.data.batches import Packer, collate, tokenize
from rotarium.data.config import LoaderSettings
from rotarium.data.documents import StreamShards
from rotarium.data.heldout import held_out_record
from rotarium.data.loader import MicroBatchOrder, as_is
from rotarium.data.prepared_writer import one_thread_per_process

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Documents a worker tokenises at a time (one batch encode): the unit the workers take turns on.
CHUNK_DOCUMENTS = 64

Position = tuple[int, int, int]  # (epoch, shard in the epoch's order, row in the shard's shuffled training rows)


@dataclass(frozen=True)
class StreamPlan:
    """The rows one process reads: of the stream's ``shards`` it reads (indices of
    :class:`~rotarium.data.documents.StreamShards`), each shard's training rows after its first ``held[shard]``
    (the validation documents), of which, in their shuffled order, those at ``t`` with ``t % stride == offset``."""
    shards: tuple[int, ...]
    stride: int
    offset: int
    held: tuple[int, ...]

    @property
    def own_shards(self) -> bool:
        """Whether the process reads only its own shards (else every shard, one row in ``stride``)."""
        return self.stride == 1


def plan_stream(num_shards: int, world: int, rank: int, held: list[int]) -> StreamPlan:
    """Process ``rank`` of ``world``: the shards ``split_dataset_by_node`` assigns it when ``num_shards`` is a
    multiple of ``world``, else every shard and one row in ``world``."""
    if num_shards % world == 0:
        return StreamPlan(tuple(range(rank, num_shards, world)), 1, 0, tuple(held))
    return StreamPlan(tuple(range(num_shards)), world, rank, tuple(held))


def stream_layout(num_shards: int, world: int) -> dict[str, Any]:
    """What a stream's recorded positions are positions in: ``shards``, ``processes``, and ``own_shards`` (whether
    each process reads only its own). A resume continues the positions only under the same layout."""
    return {"shards": num_shards, "processes": world, "own_shards": num_shards % world == 0}


def shard_order(count: int, seed: int, epoch: int, shuffle: int) -> list[int]:
    """The order in which epoch ``epoch`` visits a process's ``count`` shards (as read, with ``shuffle`` 1)."""
    if shuffle <= 1:
        return list(range(count))
    return np.random.default_rng([seed, epoch]).permutation(count).tolist()


def shuffled_rows(source: StreamShards, shard: int, held: int, seed: int, epoch: int, shuffle: int, start: int, *,
                  warn: bool = True) -> Iterator[tuple[int, str | None]]:
    """``(t, text)`` of shard ``shard``'s training rows (those after its first ``held``) in epoch ``epoch``'s order
    from position ``t = start`` on: blocks of ``shuffle`` rows, each in a seeded order. Reads from the start of the
    block holding ``start``."""
    first = start - start % shuffle
    rows = source.rows(shard, held + first, warn=warn)
    while block := list(itertools.islice(rows, shuffle)):
        order = (np.random.default_rng([seed, epoch, shard, first // shuffle]).permutation(len(block))
                 if shuffle > 1 else [0])
        for k, j in enumerate(order):
            if first + k >= start:
                yield first + k, block[j]
        first += len(block)


def stream_documents(source: StreamShards, plan: StreamPlan, seed: int, shuffle: int, start: Position, *,
                     warn: bool = True) -> Iterator[tuple[str, Position]]:
    """A process's documents from position ``start`` on, each with the position after it; endless (epoch after
    epoch). Raises ``ValueError`` when a whole epoch holds no document for the process."""
    epoch, at, row = start
    while True:
        whole, found = at == 0 and row == 0, False
        order = shard_order(len(plan.shards), seed, epoch, shuffle)
        for position in range(at, len(order)):
            shard = plan.shards[order[position]]
            begin = row if position == at else 0
            for t, text in shuffled_rows(source, shard, plan.held[shard], seed, epoch, shuffle, begin, warn=warn):
                if text is not None and t % plan.stride == plan.offset:
                    found = True
                    yield text, (epoch, position, t + 1)
        if whole and not found:
            raise ValueError(f"`data.source={source.cfg.source}`: a pass over the stream holds no training document "
                             f"for this process (of its {len(plan.shards)} shard(s), after the "
                             f"`data.validation_documents` held out); give more text or fewer processes")
        epoch, at, row = epoch + 1, 0, 0


class _Chunks(torch.utils.data.IterableDataset):
    """``(chunk, ids, lengths, positions)`` of every chunk of :data:`CHUNK_DOCUMENTS` documents of a process's
    stream that this worker tokenises (the ``k``-th of ``n`` workers: chunks ``k, k + n, ...``): the documents' ids
    one after the other, their lengths, and the position after each (``[n, 3]``); or ``(chunk, None, None,
    message)`` for bad data, which the training thread raises.

    Tensors, because a DataLoader worker hands tensors over in shared memory and only their handles through the pipe
    its results share: a worker whose process is killed must not be left blocked on a write to that pipe."""

    def __init__(self, source: StreamShards, plan: StreamPlan, seed: int, shuffle: int, start: Position,
                 tokenizer: PreTrainedTokenizerBase):
        self.source, self.plan, self.seed, self.shuffle, self.start = source, plan, seed, shuffle, start
        self.tokenizer = tokenizer

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor | None, torch.Tensor | None, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        documents = stream_documents(self.source, self.plan, self.seed, self.shuffle, self.start, warn=worker == 0)
        chunk = 0
        try:
            for chunk in itertools.count():
                part = list(itertools.islice(documents, CHUNK_DOCUMENTS))
                if chunk % workers == worker:
                    ids = list(tokenize(self.tokenizer, [text for text, _ in part], batch=len(part)))
                    yield (chunk, torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long),
                           torch.tensor([len(x) for x in ids], dtype=torch.long),
                           torch.tensor([after for _, after in part], dtype=torch.long))
        except ValueError as error:
            yield chunk, None, None, str(error)


class StreamLoader:
    """This process's micro-batches of a stream (see the module docstring), in the loop's order (:meth:`batch`),
    read by ``data.num_workers`` DataLoader workers (0: on this thread), a :class:`~rotarium.data.loader.TrainLoader`
    built from ``settings``. ``layout``: what its positions are positions in (:func:`stream_layout`);
    ``held_out``: the documents held out at the stream's head, which :meth:`describe` records. From ``start_step``
    and ``state`` (where an earlier loader of this process stopped, its :meth:`state`), else the stream's start."""
    schedule = None  # the batches come from the stream, not from a schedule

    def __init__(self, source: StreamShards, plan: StreamPlan, tokenizer: PreTrainedTokenizerBase,
                 settings: LoaderSettings, *, layout: dict[str, Any] | None = None,
                 held_out: list[str] | None = None, start_step: int = 0, state: dict[str, Any] | None = None,
                 prefetch: int = 2):
        self.source, self.plan, self.tokenizer, self.settings = source, plan, tokenizer, settings
        self.seq_len, self.batch_size = settings.data.seq_len, settings.batch_size
        self.layout, self.held_out, self.prefetch = layout, held_out or [], prefetch
        self._iterator: Iterator | None = None
        self._start(start_step, state)

    def _start(self, step: int, state: dict[str, Any] | None) -> None:
        """From ``state``: ``cursor``, the stream position after the last document packed, and the packer."""
        if self._iterator is not None:
            raise RuntimeError("the loader has started; restore it before its first batch")
        state = state or {}
        workers = self.settings.data.num_workers
        self.cursor: Position = tuple(state.get("position", (0, 0, 0)))
        self.packer = Packer(self.seq_len, self.tokenizer.eos_token_id, state.get("tokens", ()),
                             state.get("starts", ()))
        self.order = MicroBatchOrder(step, self.settings.accum)
        self._loader = torch.utils.data.DataLoader(
            _Chunks(self.source, self.plan, self.settings.seed, max(1, self.settings.data.shuffle_buffer),
                    self.cursor, self.tokenizer), batch_size=None, num_workers=workers, collate_fn=as_is,
            prefetch_factor=self.prefetch if workers else None)
        self._documents: deque[tuple[list[int], Position]] = deque()
        self._chunk = 0
        self._epoch_tokens = (self.cursor[0], 0, self.cursor[1:] == (0, 0))  # epoch, tokens, read from its start

    def _document(self) -> tuple[list[int], Position]:
        while not self._documents:
            if self._iterator is None:
                with one_thread_per_process():  # each worker on one core, as the processes of `rotarium prepare`
                    self._iterator = iter(self._loader)
            chunk, ids, lengths, after = next(self._iterator)
            if ids is None:
                raise ValueError(after)
            if chunk != self._chunk:
                raise RuntimeError(f"the stream's workers delivered chunk {chunk} for chunk {self._chunk}")
            self._chunk += 1
            documents = [part.tolist() for part in torch.split(ids, lengths.tolist())]
            self._documents.extend(zip(documents, map(tuple, after.tolist())))
        return self._documents.popleft()

    def _count(self, ids: list[int], position: Position) -> None:
        """Refuses a stream whose whole epoch holds fewer tokens than one sequence for this process (it would pack
        its sequences from several passes)."""
        epoch, tokens, whole = self._epoch_tokens
        if position[0] != epoch:
            if whole and tokens < self.seq_len:
                raise ValueError(f"`data.source={self.source.cfg.source}`: a pass over the stream holds {tokens} "
                                 "tokens for this process, fewer than one training sequence of "
                                 f"`data.seq_len={self.seq_len}`; give more text or a smaller seq_len")
            epoch, tokens, whole = position[0], 0, True
        self._epoch_tokens = (epoch, tokens + len(ids) + 1, whole)

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``micro`` of step ``step``, which must be the one after the last one asked for."""
        self.order.check(step, micro)
        rows = []
        while len(rows) < self.batch_size:
            while not self.packer.ready():
                ids, position = self._document()
                self._count(ids, position)
                self.packer.add(ids)
                self.cursor = position
            rows.append(self.packer.take())
        return collate(torch.tensor([tokens for tokens, _ in rows], dtype=torch.long), [inside for _, inside in rows])

    def position(self, step: int) -> dict[str, Any]:
        """``{"stream": layout, "processes": [this process's state()]}`` (the trainer gathers every process's)."""
        return {"stream": self.layout, "processes": [self.state()]}

    def restore(self, step: int, position: dict[str, Any]) -> None:
        """Goes on at ``step`` from this process's entry of ``position`` under the layout its positions belong to
        (a resume refused another one unless ``--allow-config-change data``, which reads the stream again from its
        start, as does a position without one); before the first batch only."""
        processes = position.get("processes")
        same = position.get("stream") == self.layout and isinstance(processes, list)
        self._start(step, processes[self.settings.rank] if same else None)

    def describe(self) -> dict[str, Any]:
        return held_out_record(self.settings.data, self.held_out, stream=self.source)

    def state(self) -> dict[str, Any]:
        """Where this process stands: ``position`` (``[epoch, shard, row]`` after the last document packed) and the
        packer's ``tokens`` and ``starts`` (:meth:`~rotarium.data.batches.Packer.state`)."""
        return {"position": list(self.cursor), **self.packer.state()}

    def close(self) -> None:
        """Stops the worker processes; the loader gives no batch after it."""
        iterator, self._iterator = self._iterator, None
        self.order.close()
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
