"""``rotarium prepare``: tokenise a corpus once into a prepared folder (:mod:`rotarium.data.prepared_writer`)."""
from __future__ import annotations

import argparse

from rotarium.data.config import DEFAULT_SEED, LOCAL_KINDS, DataSection


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from rotarium.data.prepared_writer import DEFAULT_SHARD_TOKENS, DEFAULT_TRAIN_DOCUMENTS, DEFAULT_VOCAB_SIZE

    prepare = subparsers.add_parser(
        "prepare", help="tokenise a corpus once into token shards that training reads",
        description="Tokenise SOURCE into OUT: token shards (.npy, memory-mappable), each shard's document offsets, "
                    "a validation split held out by document, the tokenizer and metadata.json (written last). A "
                    "killed prepare continues from its last complete shard when rerun with the same arguments.")
    prepare.add_argument("source", metavar="SOURCE",
                         help=f"embedded | a {LOCAL_KINDS} file or folder | a Hub dataset name")
    prepare.add_argument("out", metavar="OUT", help="the prepared folder (new, empty, or an unfinished prepare of "
                                                    "the same arguments)")
    prepare.add_argument("--tokenizer", default=None, metavar="NAME",
                         help="a Hub tokenizer or local folder (default: train a byte-level BPE on the training "
                              "documents)")
    prepare.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                         help=f"size of the trained BPE (default {DEFAULT_VOCAB_SIZE})")
    prepare.add_argument("--train-documents", type=int, default=DEFAULT_TRAIN_DOCUMENTS,
                         help=f"documents the BPE is trained on (default {DEFAULT_TRAIN_DOCUMENTS})")
    prepare.add_argument("--config", default=None, help="the Hub dataset's configuration (subset); a local SOURCE has "
                                                        "none")
    prepare.add_argument("--split", default=DataSection.split, help="the Hub dataset's split (default train)")
    prepare.add_argument("--text-field", default=DataSection.text_field,
                         help="the column holding the text (JSON, Parquet, Hub; default text)")
    prepare.add_argument("--streaming", action="store_true",
                         help="read the source as a stream (a Hub dataset too large to download first)")
    prepare.add_argument("--num-proc", type=int, default=None, help="tokenising processes (default: every core)")
    prepare.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                         help=f"tokens a shard holds at most, unless one document is longer (default "
                              f"{DEFAULT_SHARD_TOKENS})")
    held = prepare.add_mutually_exclusive_group()
    held.add_argument("--validation-fraction", type=float, default=None,
                      help=f"share of the documents held out for validation (default "
                           f"{DataSection.validation_fraction}; a stream decides each document by a seeded hash)")
    held.add_argument("--validation-documents", type=int, default=None,
                      help="documents held out for validation instead (a stream holds out its first ones)")
    prepare.add_argument("--seed", type=int, default=DEFAULT_SEED,
                         help=f"seed of the validation split (default {DEFAULT_SEED})")
    prepare.add_argument("--max-tokens", type=float, default=None, metavar="N",
                         help="stop reading SOURCE once the training split holds N tokens (e.g. 27e9: what a run "
                              "trains on; default: the whole source)")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from rotarium.data.prepared_writer import prepare

    corpus = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                     train_documents=args.train_documents, hub_config=args.config, split=args.split,
                     text_field=args.text_field, streaming=args.streaming, num_proc=args.num_proc,
                     shard_tokens=args.shard_tokens, validation_fraction=args.validation_fraction,
                     validation_documents=args.validation_documents, seed=args.seed,
                     max_tokens=args.max_tokens,
                     progress=not args.no_progress)
    train, validation = corpus.train, corpus.validation
    print(f"{corpus.path}: train {train.num_tokens:,} tokens ({train.num_documents:,} documents, "
          f"{train.num_shards} shards), validation {validation.num_tokens:,} tokens ({validation.num_documents:,} "
          f"documents), {corpus.dtype.name}, fingerprint {corpus.fingerprint[:12]}")
    return 0
