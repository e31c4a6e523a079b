"""Prepared corpora (docs/data.md): ``rotarium prepare``'s writer (:mod:`rotarium.data.prepared_writer`,
:func:`prepare`) and the reader of the folder it writes (:mod:`rotarium.data.prepared_reader`,
:class:`PreparedCorpus`), two modules since their callers differ; their public names are importable from here."""
from rotarium.data.prepared_reader import (
    FORMAT,
    FORMAT_VERSION,
    METADATA,
    PROGRESS,
    SPLITS,
    TOKENIZER,
    HeldOut,
    PreparedCorpus,
    PreparedSplit,
    is_prepared,
    shard_files,
    tokenizer_fingerprint,
)
from rotarium.data.prepared_writer import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_TRAIN_DOCUMENTS,
    DEFAULT_VOCAB_SIZE,
    DocumentEncoder,
    default_num_proc,
    encode_ordered,
    held_out_rule,
    one_thread_per_process,
    prepare,
    token_dtype,
)

__all__ = ["DEFAULT_SHARD_TOKENS", "DEFAULT_TRAIN_DOCUMENTS", "DEFAULT_VOCAB_SIZE", "FORMAT", "FORMAT_VERSION",
           "METADATA", "PROGRESS", "SPLITS", "TOKENIZER", "DocumentEncoder", "HeldOut", "PreparedCorpus",
           "PreparedSplit", "default_num_proc", "encode_ordered", "held_out_rule", "is_prepared",
           "one_thread_per_process", "prepare", "shard_files", "token_dtype", "tokenizer_fingerprint"]
