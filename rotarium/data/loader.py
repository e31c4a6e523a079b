"""The training loaders: one interface (:class:`TrainLoader`) for the three ways a run reads its training data, the
documents packed in memory (:class:`MemoryLoader`), a prepared folder (:class:`PreparedLoader`) and a stream
(:class:`~rotarium.data.stream.StreamLoader`), each built from one :class:`~rotarium.data.config.LoaderSettings`.

Training from a prepared folder (:mod:`rotarium.data.prepared_reader`): its token stream cut into sequences, read
through memory maps, and a ``torch.utils.data.DataLoader`` whose worker processes read each rank's micro-batches ahead
of the step.

Sequence ``i`` of a split is the window ``[i*T, (i+1)*T)`` of its token stream, the documents one after the other
(each ``[bos] + ids + [eos]``), with the documents starting inside it: exactly the sequences
:func:`~rotarium.data.batches.pack` cuts from the same documents, so a run from a prepared folder and a run that
tokenises the same text see the same sequences. Which sequences a step takes is the
:class:`~rotarium.data.batches.BatchSchedule`'s decision, made in each rank's own process: the loader's sampler
starts at the run's first step and yields this rank's indices only, so no rank reads another rank's rows, and
resuming at step ``s`` costs the same for any ``s`` (nothing before it is read or skipped).

The loader is not given to ``accelerator.prepare``, which would shard it a second time: the schedule already gives
each rank its slice of the global batch.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from rotarium.data.batches import BatchSchedule, PackedSequences, collate
from rotarium.data.config import LoaderSettings
from rotarium.data.heldout import held_out_record, prepared_record
from rotarium.data.prepared_reader import PreparedCorpus, PreparedSplit

# what a schedule's position records for a source that is not a prepared folder
NO_PREPARED = {"prepared": None, "tokenizer": None}


class TrainLoader(Protocol):
    """This process's training micro-batches. :meth:`batch` is asked for ``(step, micro)`` in the loop's order from
    the step the loader starts at (0, or the one :meth:`restore` set); :meth:`position` is what a checkpoint of a
    step records (a stream's per-process entries under ``processes``, which the trainer gathers), :meth:`restore`
    goes on from every process's recorded position (empty: from the step alone), before the first batch;
    :meth:`describe` is the run record's description of the data (:mod:`rotarium.data.heldout`). ``schedule``: the
    :class:`~rotarium.data.batches.BatchSchedule` the batches come from, None for a stream."""
    schedule: BatchSchedule | None

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]: ...

    def position(self, step: int) -> dict[str, Any]: ...

    def restore(self, step: int, position: dict[str, Any]) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def recorded_sequences(position: dict[str, Any]) -> int | None:
    """The sequences consumed that a schedule's recorded ``position`` holds (None when it holds none)."""
    sequences = position.get("sequences")
    return sequences if isinstance(sequences, int) else None


class MemoryLoader:
    """Documents tokenised and packed in memory (``sequences``), batched by a
    :class:`~rotarium.data.batches.BatchSchedule` on the training thread; ``held_out``: the documents the run holds
    out, which :meth:`describe` records."""

    def __init__(self, sequences: PackedSequences, settings: LoaderSettings, held_out: list[str]):
        self.settings, self.held_out = settings, held_out
        self.schedule = BatchSchedule(sequences, settings.batch_size, settings.accum, settings.world,
                                      settings.rank, settings.seed)

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        return self.schedule.batch(step, micro)

    def position(self, step: int) -> dict[str, Any]:
        return {**self.schedule.position(step), **NO_PREPARED}

    def restore(self, step: int, position: dict[str, Any]) -> None:
        self.schedule.restore(step, recorded_sequences(position))

    def describe(self) -> dict[str, Any]:
        return held_out_record(self.settings.data, self.held_out)

    def close(self) -> None:
        """Nothing to stop: the batches are cut on the training thread."""


class PreparedSequences:
    """The sequences of ``seq_len`` tokens of a prepared split (see the module docstring), ``split.num_tokens //
    seq_len`` of them (the last partial window is dropped, as :func:`~rotarium.data.batches.pack` drops it). Holds
    nothing of the split in memory; pickles without its memory maps, so a worker process opens its own."""

    def __init__(self, split: PreparedSplit, seq_len: int):
        self.split, self.seq_len = split, seq_len

    def __len__(self) -> int:
        return self.split.num_tokens // self.seq_len

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``i``: its ids ``[T]`` (the folder's dtype) and the offsets inside it (0 excluded) where a
        document starts."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} of the {self.split.name} split, which has {len(self)}")
        start = i * self.seq_len
        return self.split.tokens(start, start + self.seq_len), self.split.document_starts(start, start + self.seq_len)

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        """The sequences at ``indices``: int64 ``[len(indices), T]`` and their document starts."""
        tokens = np.empty((len(indices), self.seq_len), dtype=np.int64)
        starts = []
        for row, i in enumerate(indices):
            ids, inside = self.sequence(i)
            tokens[row] = ids
            starts.append(inside.tolist())
        return torch.from_numpy(tokens), starts

    def packed(self, count: int) -> PackedSequences:
        """The first ``count`` sequences (fewer when the split has fewer) in memory: the validation rows."""
        count = min(count, len(self))
        tokens, starts = self.rows(list(range(count)))
        return PackedSequences(tokens, starts)


class _MicroBatches(torch.utils.data.Sampler):
    """``(step, micro, this rank's sequence indices)`` of every micro-batch from ``start_step`` on, in the loop's
    order; runs in the rank's own process (the schedule's order is never sent to a worker)."""

    def __init__(self, schedule: BatchSchedule, start_step: int):
        self.schedule, self.start_step = schedule, start_step

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        for step in itertools.count(self.start_step):
            for micro in range(self.schedule.accum):
                yield step, micro, self.schedule.indices(step, micro)


class _Rows(torch.utils.data.Dataset):
    """A sampler's ``(step, micro, indices)`` -> ``(step, micro, collated batch)``, read in a worker process."""

    def __init__(self, data: PreparedSequences):
        self.data = data

    def __getitem__(self, item: tuple[int, int, list[int]]) -> tuple[int, int, dict[str, torch.Tensor]]:
        step, micro, indices = item
        return step, micro, collate(*self.data.rows(indices))


def as_is(item: Any) -> Any:
    """A DataLoader's ``collate_fn`` for items that are already batches."""
    return item


class MicroBatchOrder:
    """The loop asks a loader for micro-batches in order, ``(start_step, 0)`` first: :meth:`check` refuses any
    other, since a loader that reads ahead can give each micro-batch once only."""

    def __init__(self, start_step: int, accum: int):
        self.accum = accum
        self.next = (start_step, 0)

    def check(self, step: int, micro: int) -> None:
        """Raises ``RuntimeError`` unless ``(step, micro)`` is the next micro-batch; then moves past it."""
        if self.next == (-1, -1):
            raise RuntimeError("the loader is closed")
        if (step, micro) != self.next:
            raise RuntimeError(f"the loader reads micro-batches in order: asked for step {step} micro-batch {micro}, "
                               f"the next one is step {self.next[0]} micro-batch {self.next[1]}")
        self.next = (step, micro + 1) if micro + 1 < self.accum else (step + 1, 0)

    def close(self) -> None:
        self.next = (-1, -1)


class BatchLoader:
    """A :class:`~rotarium.data.batches.BatchSchedule`'s micro-batches from ``start_step`` on, read ahead by a
    DataLoader with ``num_workers`` worker processes (0: on this thread, when asked), each ``prefetch`` micro-batches
    ahead, in pinned memory with ``pin_memory`` (for a CUDA device). :meth:`batch` is asked for ``(step, micro)`` in
    the loop's order and checks that the loader delivers exactly that micro-batch. :meth:`close` stops the workers
    (so does the process ending, or a killed parent: each worker watches its parent)."""

    def __init__(self, schedule: BatchSchedule, start_step: int, num_workers: int, *, pin_memory: bool = False,
                 prefetch: int = 2):
        self.schedule, self.start_step = schedule, start_step
        self._loader = torch.utils.data.DataLoader(
            _Rows(schedule.data), batch_size=None, sampler=_MicroBatches(schedule, start_step),
            num_workers=num_workers, collate_fn=as_is, pin_memory=pin_memory,
            prefetch_factor=prefetch if num_workers else None)
        self._iterator: Iterator | None = None
        self.order = MicroBatchOrder(start_step, schedule.accum)

    @property
    def started(self) -> bool:
        """Whether a batch was asked for (the workers may be reading ahead)."""
        return self._iterator is not None

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``micro`` of step ``step``, which must be the one after the last one asked for (the first:
        ``(start_step, 0)``)."""
        self.order.check(step, micro)
        if self._iterator is None:
            self._iterator = iter(self._loader)
        got_step, got_micro, batch = next(self._iterator)
        if (got_step, got_micro) != (step, micro):
            raise RuntimeError(f"the loader delivered step {got_step} micro-batch {got_micro} for step {step} "
                               f"micro-batch {micro}")
        return batch

    def close(self) -> None:
        """Stops the worker processes; the loader gives no batch after it."""
        iterator, self._iterator = self._iterator, None
        self.order.close()
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


class PreparedLoader:
    """A prepared folder's training split (``corpus``), its sequences scheduled by a
    :class:`~rotarium.data.batches.BatchSchedule` and read ahead by a :class:`BatchLoader` with
    ``settings.data.num_workers`` workers. Its position carries the folder's identity (fingerprint and tokenizer
    SHA-256), which a resume compares; :meth:`describe` is the folder's validation split."""

    def __init__(self, corpus: PreparedCorpus, settings: LoaderSettings):
        self.corpus, self.settings = corpus, settings
        sequences = PreparedSequences(corpus.train, settings.data.seq_len)
        self.schedule = BatchSchedule(sequences, settings.batch_size, settings.accum, settings.world, settings.rank,
                                      settings.seed, order_cache=settings.order_cache)
        self.reader = self._reader(0)

    def _reader(self, step: int) -> BatchLoader:
        return BatchLoader(self.schedule, step, self.settings.data.num_workers, pin_memory=self.settings.pin_memory)

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        return self.reader.batch(step, micro)

    def position(self, step: int) -> dict[str, Any]:
        return {**self.schedule.position(step), **self.corpus.identity}

    def restore(self, step: int, position: dict[str, Any]) -> None:
        if self.reader.started:
            raise RuntimeError("the loader has started; restore it before its first batch")
        self.schedule.restore(step, recorded_sequences(position))
        self.reader = self._reader(step)

    def describe(self) -> dict[str, Any]:
        return prepared_record(self.corpus)

    def close(self) -> None:
        self.reader.close()


class BackgroundCheck:
    """Runs ``check`` (a function raising ``ValueError`` for bad data, such as :meth:`PreparedCorpus.verify
    <rotarium.data.prepared_reader.PreparedCorpus.verify>`) in a daemon thread, so that hashing a large folder does not
    delay the first step; :attr:`error` holds its message once it failed, :attr:`done` says whether it ended."""

    def __init__(self, check: Callable[[], None]):
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(check,), name="rotarium-verify", daemon=True)
        self._thread.start()

    def _run(self, check: Callable[[], None]) -> None:
        try:
            check()
        except (OSError, ValueError) as error:
            self.error = " ".join(str(error).split())

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
