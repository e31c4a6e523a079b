"""Documents: the texts a run trains and validates on, from the embedded corpus, local files or the Hub
(``datasets``), and the held-out validation documents."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rotarium.data.config import LOCAL_FORMATS, LOCAL_KINDS, DataSection

logger = logging.getLogger(__name__)


def embedded_documents() -> list[str]:
    """The standard library's documentation topics (``pydoc_data.topics``: English prose and code that every
    Python installation carries), cut at paragraph boundaries into documents of about 2000 characters."""
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
        raise ValueError(f"`data.source={source}`: no {LOCAL_KINDS} files in that folder")
    kinds: dict[str | None, Path] = {}
    for p in files:
        kinds.setdefault(LOCAL_FORMATS.get(p.suffix), p)
    if None in kinds:
        raise ValueError(f"`data.source={source}`: {kinds[None].name} is not one of {', '.join(LOCAL_FORMATS)}")
    if len(kinds) > 1:  # each kind has its own reader, and a corpus one
        mixed = " and ".join(f"{kind} files ({p.relative_to(path)})" for kind, p in sorted(kinds.items()))
        raise ValueError(f"`data.source={source}` mixes {mixed}; a source's files are all of one kind: move the "
                         "others out of the folder")
    return next(iter(kinds)), [str(p) for p in files]


def _not_utf8(files: list[str]) -> str | None:
    """``"<file> is not UTF-8 text (byte <offset>: <reason>)"`` for the first of ``files`` that is not, else None."""
    import codecs

    for name in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with open(name, "rb") as f:
            while True:
                chunk = f.read(1 << 20)
                pending = len(decoder.getstate()[0])  # bytes of a character the last chunk cut, decoded with this one
                try:  # the empty read at the end flushes a character the file cuts short
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    return f"{name} is not UTF-8 text (byte {offset - pending + error.start}: {error.reason})"
                if not chunk:
                    break
                offset += len(chunk)
    return None


def _text_documents(source: str, files: list[str]) -> Iterator[str]:
    """The documents of text files: each file is a corpus of paragraphs / articles separated by two blank lines."""
    found = False
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"`data.source={source}`: {_not_utf8([name])}; convert it to UTF-8") from None
        for document in text.split("\n\n\n"):
            if document.strip():
                found = True
                yield document.strip()
    if not found:
        what = f"{files[0]} holds no" if len(files) == 1 else f"none of its {len(files)} files holds any"
        raise ValueError(f"`data.source={source}`: {what} text (0 documents)")


def _where(cfg: DataSection, files: list[str] | None, kind: str | None, index: int) -> str:
    """``"<file> row <n>"`` (from 1) for the row at ``index`` of the rows of ``files`` read one after the other,
    ``"row <n>"`` of a Hub dataset. Counting the rows of each file reads them again, which only a problem found
    costs."""
    if not files:
        return f"row {index + 1}"
    if len(files) > 1:
        import datasets

        for name in files:
            count = sum(1 for _ in datasets.load_dataset(kind, data_files=[name], split="train", streaming=True))
            if index < count:
                return f"{name} row {index + 1}"
            index -= count
    return f"{files[-1]} row {index + 1}"


def _rows(dataset, cfg: DataSection, files: list[str] | None, kind: str | None, first: int) -> Iterator[str]:
    """The non-empty texts of ``dataset``'s rows, the row at ``first`` first. A text that is not a
    string raises ``ValueError`` naming its row; rows without one are skipped and counted in a warning. A local
    file that is not UTF-8 is named (the arrow readers only fail on it when a row is read)."""
    field, missing, first_missing, read = cfg.text_field, 0, None, 0
    try:
        for read, row in enumerate(dataset, 1):
            text = row.get(field)
            if text is None:
                missing += 1
                first_missing = read - 1 if first_missing is None else first_missing
                continue
            if not isinstance(text, str):
                where = _where(cfg, files, kind, first + read - 1)
                raise ValueError(  # noqa: TRY004  (bad data: a ValueError is what the CLI reports in one line)
                    f"`data.source={cfg.source}`: {where} has a `{field}` that is {type(text).__name__} "
                    f"({str(text)[:60]!r}), not text; `data.text_field` must name a column of strings")
            if text.strip():
                yield text
    except UnicodeDecodeError as error:
        bad = (_not_utf8(files) if files else None) or f"a row is not UTF-8 text ({error.reason})"
        raise ValueError(f"`data.source={cfg.source}`: {bad}; convert it to UTF-8") from None
    finally:
        if missing:
            logger.warning("`data.source=%s`: %d of the %d rows read %s no `%s` (the first: %s); skipped", cfg.source,
                           missing, read, "has" if missing == 1 else "have", field,
                           _where(cfg, files, kind, first + first_missing))


def _no_rows(kind: str, file: str) -> bool:
    """Whether ``file`` holds no row: it is blank, or a Parquet file of 0 rows (which datasets cannot read)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(file).metadata.num_rows == 0
        except Exception:  # noqa: BLE001  (not Parquet at all: the caller reports the reader's own error)
            return False
    with open(file, "rb") as f:
        return not any(line.strip() for line in f)


def _open(cfg: DataSection):
    """``(kind, files, dataset)`` of a source other than the embedded corpus: local text files (``dataset`` None), or
    local JSON/Parquet files or a Hub dataset read by ``datasets`` (``files`` None for the Hub), as a stream with
    ``cfg.streaming``. Raises ``ValueError`` for a missing file, an unreadable source or a missing text field."""
    import datasets

    looks_local = Path(cfg.source).exists() or Path(cfg.source).suffix in LOCAL_FORMATS or cfg.source.startswith(
        (".", "/", "~"))
    if looks_local:
        if not Path(cfg.source).exists():
            raise ValueError(f"`data.source={cfg.source}`: no such file or folder")
        kind, files = _local_files(cfg.source)
        if kind == "text":
            return kind, files, None
        try:
            dataset = datasets.load_dataset(kind, data_files=files, split="train", streaming=cfg.streaming)
        except Exception as error:  # an empty file raises StopIteration or "corresponds to no data" ValueError
            if all(_no_rows(kind, f) for f in files):
                raise ValueError(f"`data.source={cfg.source}` is empty: no {kind} rows to train on") from error
            # datasets wraps what went wrong (a DatasetGenerationError "while generating the dataset"): name it too
            cause = error.__cause__ or error.__context__
            detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
            raise ValueError(f"`data.source={cfg.source}` could not be read as {kind}: "
                             f"{type(error).__name__}: {error}{detail}") from error
    else:
        files, kind = None, None
        try:
            dataset = datasets.load_dataset(cfg.source, cfg.hub_config, split=cfg.split, streaming=cfg.streaming)
        except Exception as error:  # datasets raises many types (FileNotFoundError, ConnectionError, ...)
            raise ValueError(f"`data.source={cfg.source}` is not a local file and could not be opened from the "
                             f"Hub: {error}") from error
    columns = dataset.column_names
    if columns is not None and cfg.text_field not in columns:
        raise ValueError(f"`data.text_field={cfg.text_field}` is not a column of {cfg.source}; columns: {columns}")
    return kind, files, dataset


def iter_documents(cfg: DataSection, *, skip: int = 0) -> Iterable[str]:
    """Every document's text in a fixed order (the source's), after the first ``skip``. Raises ``ValueError`` for a
    missing file or text field. A training run that streams reads the source by shards instead
    (:class:`StreamShards`)."""
    if cfg.source == "embedded":
        return embedded_documents()[skip:]
    kind, files, dataset = _open(cfg)
    if dataset is None:
        return itertools.islice(_text_documents(cfg.source, files), skip, None)
    first = skip
    if cfg.streaming:
        dataset = dataset.skip(skip) if skip else dataset
    elif skip:
        first = min(skip, len(dataset))
        dataset = dataset.select(range(first, len(dataset)))
    return _rows(dataset, cfg, files, kind, first)


class StreamShards:
    """A streamed ``data.source`` as the shards it is stored in, each readable from any row on without reading the
    others: the embedded corpus is one shard, local text files a shard each (their documents are the rows), and a
    ``datasets`` stream (local JSON/Parquet files, a Hub dataset) has ``IterableDataset.num_shards`` shards, a file
    each. With ``reshard_for`` processes and a shard count that is not a multiple of it, a Parquet stream is split
    into its row groups (``IterableDataset.reshard``) when that count is; the rows stay in the same order.

    A shard is read with ``IterableDataset.shard(num_shards, index)`` and its batches with ``.iter(batch_size)``,
    which (unlike iterating the dataset) does not split the shard again between DataLoader workers."""

    def __init__(self, cfg: DataSection, reshard_for: int = 1):
        self.cfg = cfg
        self.kind, self.files, self.dataset = ("embedded", None, None) if cfg.source == "embedded" else _open(cfg)
        if self.dataset is not None and self.dataset.num_shards % reshard_for:
            finer = self.dataset.reshard()
            if finer.num_shards % reshard_for == 0:
                self.dataset = finer
        self.num_shards = (1 if self.kind == "embedded" else len(self.files) if self.dataset is None
                           else self.dataset.num_shards)

    def __len__(self) -> int:
        return self.num_shards

    def where(self, shard: int, row: int) -> str:
        """``"<file> row <n>"`` (from 1) of a row of a file shard, ``"shard <k> row <n>"`` of another."""
        name = self.files[shard] if self.files is not None and len(self.files) == self.num_shards else f"shard {shard}"
        return f"{name} row {row + 1}"

    def rows(self, shard: int, start: int = 0, *, warn: bool = True) -> Iterator[str | None]:
        """The texts of shard ``shard``'s rows from row ``start`` on; ``None`` for a row whose text is empty or
        missing (rows without the text field are counted in a warning when ``warn``). A text that is not a string
        raises ``ValueError`` naming its row."""
        if self.kind == "embedded":
            yield from embedded_documents()[start:]
            return
        if self.dataset is None:
            yield from itertools.islice(_text_documents(self.cfg.source, [self.files[shard]]), start, None)
            return
        field, missing, first_missing, row = self.cfg.text_field, 0, None, start
        part = self.dataset.shard(num_shards=self.num_shards, index=shard)
        try:
            for batch in (part.skip(start) if start else part).iter(batch_size=256):
                texts = batch[field] if field in batch else [None] * len(next(iter(batch.values())))
                for text in texts:
                    if text is None:
                        missing += 1
                        first_missing = row if first_missing is None else first_missing
                    elif not isinstance(text, str):
                        raise ValueError(
                            f"`data.source={self.cfg.source}`: {self.where(shard, row)} has a `{field}` that is "
                            f"{type(text).__name__} ({str(text)[:60]!r}), not text; `data.text_field` must name a "
                            "column of strings")
                    yield text if text is not None and text.strip() else None
                    row += 1
        except UnicodeDecodeError as error:
            files = [self.files[shard]] if self.files is not None and len(self.files) == self.num_shards else None
            bad = (_not_utf8(files) if files else None) or f"a row is not UTF-8 text ({error.reason})"
            raise ValueError(f"`data.source={self.cfg.source}`: {bad}; convert it to UTF-8") from None
        finally:
            if missing and warn:
                logger.warning("`data.source=%s`: %d of the %d rows read %s no `%s` (the first: %s); skipped",
                               self.cfg.source, missing, row - start, "has" if missing == 1 else "have", field,
                               self.where(shard, first_missing))

    def held_out(self, count: int) -> tuple[list[str], list[int]]:
        """The stream's first ``count`` documents, in shard order (the validation documents of a streaming run), and
        per shard the rows at its head they take, which training skips."""
        documents: list[str] = []
        taken = [0] * self.num_shards
        for shard in range(self.num_shards):
            if len(documents) >= count:
                break
            for text in self.rows(shard):
                taken[shard] += 1
                if text is not None:
                    documents.append(text)
                    if len(documents) >= count:
                        break
        return documents, taken


def split_documents(documents: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, validation): a seeded random ``fraction`` of the documents (at least one) is held out."""
    if len(documents) < 2:
        raise ValueError(f"the dataset has {len(documents)} document(s); a validation split needs at least 2")
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    n_val = max(1, round(fraction * len(documents)))
    held = set(order[:n_val])
    return ([d for i, d in enumerate(documents) if i not in held], [d for i, d in enumerate(documents) if i in held])


def held_out_documents(cfg: DataSection, seed: int) -> list[str]:
    """The documents a run with ``cfg`` and ``seed`` holds out for validation: a stream's first
    ``validation_documents`` (:meth:`StreamShards.held_out`), else the seeded ``validation_fraction`` of
    :func:`split_documents`."""
    if cfg.streaming:
        return StreamShards(cfg).held_out(cfg.validation_documents)[0]
    return split_documents(list(iter_documents(cfg)), cfg.validation_fraction, seed)[1]
