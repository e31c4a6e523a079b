"""The data path for pretraining-scale corpora, each row against a peer measured in the same run.

1. prepare: tokens/s of ``rotarium prepare`` (``rotarium.data.prepared.prepare``: reading a JSONL source, the
   held-out split, tokenising, writing the shards and metadata) with ``num_proc`` 1 and 2, against the tokenizer's
   own batch encode of the same documents already in memory on one core (``tokenizer(batch,
   add_special_tokens=False)``, tokenizers' thread pool off). Targets: at least 0.8x with one process, at least 1.5x
   with two.

Each row is a function of ``ROWS`` returning whether it met its targets; the script exits 1 when one did not.
Usage: ``python benchmarks/data.py [--rows prepare] [--repeats 3] [--copies 20]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import best, paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium.data.documents import embedded_documents
from rotarium.data.prepared import prepare
from rotarium.data.tokenizer import load_tokenizer, train_bpe

PREPARE_TARGETS = {1: 0.8, 2: 1.5}
PEER_BATCH = 1024  # documents per batch-encode call of the peer


def prepare_row(args: argparse.Namespace, work: Path) -> bool:
    """``rotarium prepare`` tokens/s against the tokenizer's batch encode on one core."""
    documents = [f"{copy} {text}" for copy in range(args.copies) for text in embedded_documents()]
    source = work / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    train_bpe(embedded_documents(), args.vocab_size).save_pretrained(work / "tokenizer")
    tokenizer = load_tokenizer(str(work / "tokenizer"))

    def peer() -> int:
        return sum(len(ids) for start in range(0, len(documents), PEER_BATCH)
                   for ids in tokenizer(documents[start:start + PEER_BATCH], add_special_tokens=False)["input_ids"])

    def prepared(num_proc: int) -> Callable[[], None]:
        def run() -> None:
            out = work / f"prepared-{num_proc}"
            shutil.rmtree(out, ignore_errors=True)
            prepare(str(source), out, tokenizer=str(work / "tokenizer"), num_proc=num_proc, progress=False)

        return run

    tokens = peer()
    contenders = {"peer": peer, **{n: prepared(n) for n in PREPARE_TARGETS}}
    samples = time_rounds(contenders, args.repeats)  # the warm-up call also builds datasets' cache of the JSONL
    times = best(samples)
    print(f"## prepare: {len(documents):,} documents, {tokens:,} tokens (BPE of {args.vocab_size}), "
          f"{args.repeats} rounds")
    print(f"tokenizer batch encode, one core: {tokens / times['peer'] / 1e6:.2f}M tokens/s")
    ok = True
    for num_proc, target in PREPARE_TARGETS.items():
        ratio = paired_ratio(samples["peer"], samples[num_proc])  # tokens/s ratio: the same tokens in both
        ok &= ratio >= target
        print(f"prepare --num-proc {num_proc}: {tokens / times[num_proc] / 1e6:.2f}M tokens/s, {ratio:.2f}x the "
              f"peer (target >= {target}) {verdict(ratio >= target)}")
    return ok


ROWS: dict[str, Callable[[argparse.Namespace, Path], bool]] = {"prepare": prepare_row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=20, help="prepare: copies of the embedded corpus in the source")
    parser.add_argument("--vocab-size", type=int, default=4096, help="prepare: the BPE's size")
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the peer on one core, as each process of prepare runs
    print(f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores")
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        for name in args.rows:
            work = Path(folder) / name
            work.mkdir()
            ok &= ROWS[name](args, work)
            print()
    print(f"all targets: {verdict(ok)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
