"""The ``data`` section of the training config: where the documents come from and how they are cut."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# The seed that splits documents into training and validation when a run does not name one (``train.seed``).
DEFAULT_SEED = 0
# The local files a source may be or hold, by suffix, and the reader of each.
LOCAL_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                 ".parquet": "parquet"}
LOCAL_KINDS = "/".join(LOCAL_FORMATS)


@dataclass
class DataSection:
    """``source``: ``embedded`` (the standard library's documentation topics), a local file or folder of
    :data:`LOCAL_FORMATS`, a folder written by ``rotarium prepare`` (docs/data.md; ``prepare``: the arguments that write
    it), or a Hub dataset name (read with streaming when ``streaming``)."""
    source: str = field(default="embedded", metadata={
        "help": f"embedded (no download) | a {LOCAL_KINDS} file or folder | a folder written by "
                "`rotarium prepare` | a Hub dataset name"})
    prepare: str | None = field(default=None, metadata={
        "help": "the arguments (SOURCE OUT [options]) of the `rotarium prepare` whose OUT is data.source (a "
                "recipe's), named with the command to run when that folder is not there"})
    hub_config: str | None = field(default=None, metadata={"help": "the Hub dataset's configuration (subset)"})
    split: str = field(default="train", metadata={"help": "the Hub dataset's split"})
    text_field: str = field(default="text", metadata={"help": "the column holding the text (JSON, Parquet, Hub)"})
    streaming: bool = field(default=False, metadata={
        "help": "read the source as a stream instead of tokenising it up front (corpora too large for memory)"})
    seq_len: int = field(default=128, metadata={"help": "tokens per training sequence"})
    validation_fraction: float = field(
        default=0.05, metadata={"help": "share of the documents held out for validation (not streaming)"})
    validation_documents: int = field(
        default=500, metadata={"help": "streaming: the first documents of the stream, held out for validation"})
    max_validation_tokens: int = field(default=65536, metadata={"help": "at most this many held-out tokens are scored"})
    shuffle_buffer: int = field(default=10000, metadata={
        "help": "streaming: each pass shuffles a process's shards and, within a shard, blocks of this many rows "
                "(1: the stream's order)"})
    skip_verify: bool = field(default=False, metadata={
        "help": "a prepared folder: do not check its shards against their recorded SHA-256 (a run checks them in a "
                "background thread when it starts or resumes, and stops at the next step if one is damaged)"})
    num_workers: int = field(default=2, metadata={
        "help": "a prepared folder or a stream: DataLoader worker processes reading (a stream: tokenising) each "
                "process's batches ahead of the step (0: on the training thread); a source read whole is "
                "tokenised up front"})


@dataclass(frozen=True)
class LoaderSettings:
    """What a training loader (:class:`~rotarium.data.loader.TrainLoader`) is built from: the ``data`` section and
    what it lacks, the sequences of a micro-batch (``batch_size``), the micro-batches of a step (``accum``) and the
    seed of the order, for process ``rank`` of ``world``; ``pin_memory``: pin a loader's batches (for a CUDA
    device); ``order_cache``: where a prepared folder's epoch orders are cached
    (:class:`~rotarium.data.batches.EpochOrder`)."""
    data: DataSection
    batch_size: int
    accum: int = 1
    seed: int = DEFAULT_SEED
    world: int = 1
    rank: int = 0
    pin_memory: bool = False
    order_cache: Path | None = None
