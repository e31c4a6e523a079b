"""The data path for pretraining-scale corpora, each row against a peer measured in the same run.

1. prepare: tokens/s of ``rotarium prepare`` (``rotarium.data.prepared.prepare``: reading a JSONL source, the
   held-out split, tokenising, writing the shards and metadata) with ``num_proc`` 1 and 2, against the tokenizer's
   own batch encode of the same documents already in memory on one core (``tokenizer(batch,
   add_special_tokens=False)``, tokenizers' thread pool off). Targets: at least 0.8x with one process, at least 1.5x
   with two. The tokenizer (``--prepare-tokenizer``) is rotarium's BPE trained on the embedded corpus, or ``llama``,
   a stand-in for the recipes' Llama-2 tokenizer built offline (:func:`llama_style_tokenizer`), or one named.

2. resume: from process start to the first batch of a run resumed at step 10 and at step 1,000,000 of a prepared
   folder (``--resume-tokens``, random ids; sequences of 2048, 8 a step, the trainer's ``prepare_data`` with its
   DataLoader workers), each in a fresh process. Target: the ratio at most 1.5 (the data set-up alone, after the
   imports, is printed too).
3. reading: batches of 8 x 2048 tokens with ``cu_seqlens`` from a prepared folder, read on one core through the
   schedule (memory maps, windows, document starts, ``collate``). Target: at least 5M tokens/s.
4. memory: the peak resident memory of a 20-step tiny-model ``rotarium train`` on a prepared folder of
   ``--memory-tokens`` (2B by default, 4 GB of uint16 on disk; random ids written straight to shards) against the
   same run on a folder of 10M tokens. Target: at most 100 MB more.
5. streaming: from process start to the first batch of a streaming run resumed at step 10 and at step 200 of a local
   JSON Lines stream of ``--stream-shards`` files (the embedded corpus, ``--stream-copies`` times; a BPE of 4096;
   sequences of 512, 8 a step; the trainer's ``open_data_source`` and ``prepare_data`` with its DataLoader workers, from
   the position a run records at that step), each in a fresh process. Target: the ratio at most 1.5. The time to
   read and tokenise the stream from its start to step 200, which a resume cost before streams recorded their
   position, is printed beside it.

The folders of rows 2-4 hold random ids in documents of random lengths, written as ``rotarium prepare`` writes
shards; only their layout matters to these rows.

Each row is a function of ``ROWS`` returning whether it met its targets; the script exits 1 when one did not.
Usage: ``python benchmarks/data.py [--rows prepare resume reading memory streaming] [--repeats 3] [--copies 20]
[--prepare-tokenizer bpe|llama|NAME] [--vocab-size 4096] [--memory-tokens 2000000000] [--stream-shards 200]
[--stream-copies 16]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import best, paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium.data import prepared as prepared_module
from rotarium.data import prepared_reader, prepared_writer
from rotarium.data.batches import BatchSchedule, save_array
from rotarium.data.documents import embedded_documents
from rotarium.data.loader import PreparedSequences
from rotarium.data.prepared import PreparedCorpus, prepare, shard_files, tokenizer_fingerprint
from rotarium.data.tokenizer import load_tokenizer, train_bpe
from rotarium.utils.files import write_json_atomic

PREPARE_TARGETS = {1: 0.8, 2: 1.5}
PEER_BATCH = 1024  # documents per batch-encode call of the peer
SEQ_LEN, BATCH = 2048, 8  # the reading and resume rows' batches, as the issue states them
RESUME_STEPS, RESUME_TARGET = (10, 1_000_000), 1.5
READING_TARGET = 5e6  # tokens/s
MEMORY_SMALL, MEMORY_TARGET = 10_000_000, 100 * 2 ** 20  # bytes more at most
STREAM_STEPS, STREAM_SEQ_LEN, STREAM_TARGET = (10, 200), 512, 1.5
SHARD_TOKENS = 100_000_000  # rotarium prepare's default
MEAN_DOCUMENT = 800  # tokens of a random document, on average


def prepare_row(args: argparse.Namespace, work: Path) -> bool:
    """``rotarium prepare`` tokens/s against the tokenizer's batch encode on one core."""
    documents = [f"{copy} {text}" for copy in range(args.copies) for text in embedded_documents()]
    source = work / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    if args.prepare_tokenizer == "bpe":
        train_bpe(embedded_documents(), args.vocab_size).save_pretrained(work / "tokenizer")
        name = f"BPE of {args.vocab_size}"
    elif args.prepare_tokenizer == "llama":
        llama_style_tokenizer(embedded_documents(), args.vocab_size).save_pretrained(work / "tokenizer")
        name = f"Llama-2-style BPE of {args.vocab_size} asked"
    else:
        load_tokenizer(args.prepare_tokenizer).save_pretrained(work / "tokenizer")
        name = args.prepare_tokenizer
    tokenizer = load_tokenizer(str(work / "tokenizer"))
    name += f", {len(tokenizer):,} tokens"

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
    text = sum(len(d.encode("utf-8")) for d in documents)
    print(f"## prepare: {len(documents):,} documents, {text / 1e6:.1f} MB of text, {tokens:,} tokens ({name}), "
          f"{args.repeats} rounds")
    print(f"tokenizer batch encode, one core: {tokens / times['peer'] / 1e6:.2f}M tokens/s "
          f"({text / times['peer'] / 1e6:.2f} MB of text/s)")
    ok = True
    for num_proc, target in PREPARE_TARGETS.items():
        ratio = paired_ratio(samples["peer"], samples[num_proc])  # tokens/s ratio: the same tokens in both
        ok &= ratio >= target
        print(f"prepare --num-proc {num_proc}: {tokens / times[num_proc] / 1e6:.2f}M tokens/s "
              f"({text / times[num_proc] / 1e6:.2f} MB of text/s), {ratio:.2f}x the "
              f"peer (target >= {target}) {verdict(ratio >= target)}")
    return ok


def llama_style_tokenizer(documents: list[str], vocab_size: int):
    """A stand-in for the Llama-2 tokenizer the recipes name, built offline: a SentencePiece-style BPE with byte
    fallback, ``<s>``/``</s>``/``<unk>`` and a ``<s>`` before every text, trained on ``documents`` with pieces that
    never cross a space (as SentencePiece trains) and applied, as transformers' Llama tokenizer applies its merges, to
    the whole text at once (``Metaspace(split=False)``), which is what its speed depends on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    special = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tokenizer.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                                 show_progress=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def random_folder(root: Path, tokens: int, validation_tokens: int = 1_000_000) -> Path:
    """A prepared folder of ``tokens`` random training ids (and ``validation_tokens`` of validation) in documents of
    random lengths, with a BPE of 4096 trained on the embedded corpus; made once per ``root`` and size."""
    out = root / f"random-{tokens}"
    if (out / prepared_module.METADATA).is_file():
        return out
    tokenizer_dir = root / "tokenizer-4096"
    if not tokenizer_dir.is_dir():
        train_bpe(embedded_documents(), 4096).save_pretrained(tokenizer_dir)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokenizer.save_pretrained(out / prepared_module.TOKENIZER)
    rng = np.random.default_rng(tokens)
    splits = {}
    for split, total in (("train", tokens), ("validation", validation_tokens)):
        shards, left = [], total
        while left:
            size = min(left, SHARD_TOKENS)
            ids = rng.integers(0, len(tokenizer), size=size, dtype=np.uint16)
            lengths = rng.integers(1, 2 * MEAN_DOCUMENT, size=size // MEAN_DOCUMENT * 11 // 10 + 2)  # enough
            starts = np.unique(np.concatenate([[0], np.cumsum(lengths)]))
            offsets = np.concatenate([starts[starts < size], [size]]).astype(np.int64)
            ids[offsets[1:] - 1] = tokenizer.eos_token_id
            files = {}
            for name, array in zip(shard_files(split, len(shards)), (ids, offsets)):
                save_array(out / name, array)
                files[name] = prepared_writer._file_record(out / name)
            shards.append({"tokens": size, "documents": len(offsets) - 1, "files": files})
            left -= size
        splits[split] = {"tokens": total, "documents": sum(s["documents"] for s in shards), "shards": shards}
    record = {"format": prepared_module.FORMAT, "format_version": prepared_module.FORMAT_VERSION, "complete": True,
              "settings": {"source": "random ids (benchmarks/data.py)", "tokens": tokens},
              "documents": splits["train"]["documents"] + splits["validation"]["documents"],
              "held_out": {"rule": "first", "seed": 0, "documents": splits["validation"]["documents"]},
              "dtype": "uint16",
              "tokenizer": {"folder": prepared_module.TOKENIZER, "sha256": tokenizer_fingerprint(tokenizer),
                            "vocab_size": len(tokenizer), "bos_id": None, "eos_id": tokenizer.eos_token_id},
              "splits": splits}
    record["fingerprint"] = prepared_reader.corpus_fingerprint(record)
    write_json_atomic(out / prepared_module.METADATA, record)
    return out


# The trainer's data path, from a fresh process: its config, the folder's tokenizer and prepare_data at a step.
RESUME_CHILD = """
import sys, time
from pathlib import Path
from rotarium.training.build import loader_settings, open_data_source, prepare_data
from rotarium.training.config import load_config
folder, step, cache, seq_len, batch_size = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:]
imported = time.perf_counter()
config = load_config(None, {"data.source": folder, "data.seq_len": seq_len, "train.batch_size": batch_size})
source = open_data_source(config, 1)
data = prepare_data(config, source.prepared.load_tokenizer(), source, loader_settings(config, 1, order_cache=cache))
data.train.restore(step, {})
batch = data.train.batch(step, 0)
assert batch["input_ids"].shape == (1, int(seq_len) * int(batch_size))
print(f"data {time.perf_counter() - imported:.6f}", flush=True)
data.close()
"""


def resume_row(args: argparse.Namespace, work: Path) -> bool:
    """Process start to the first batch at step 10 and at step 1,000,000."""
    folder = random_folder(work.parent, args.resume_tokens)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    data_seconds: dict[int, list[float]] = {step: [] for step in RESUME_STEPS}

    def resumed(step: int) -> Callable[[], None]:
        def run() -> None:
            argv = [str(folder), str(step), str(work / "order"), str(SEQ_LEN), str(BATCH)]
            out = subprocess.run([sys.executable, "-c", RESUME_CHILD, *argv], env=env, capture_output=True,
                                 text=True, check=True)
            data_seconds[step].append(float(out.stdout.split("data ")[-1]))

        return run

    samples = time_rounds({step: resumed(step) for step in RESUME_STEPS}, args.repeats)
    times = best(samples)
    sequences = args.resume_tokens // SEQ_LEN
    print(f"## resume: a prepared folder of {args.resume_tokens:,} tokens ({sequences:,} sequences of {SEQ_LEN}), "
          f"{BATCH} a step, {args.repeats} rounds")
    first, last = RESUME_STEPS
    for step in RESUME_STEPS:
        print(f"step {step:,} (epoch {step * BATCH // sequences}): {times[step]:.2f} s from process start to the first "
              f"batch, {min(data_seconds[step][1:]) * 1e3:.0f} ms of it after the imports")
    ratio = paired_ratio(samples[last], samples[first])
    data_ratio = paired_ratio(data_seconds[last][1:], data_seconds[first][1:])
    ok = ratio <= RESUME_TARGET
    print(f"step {last:,} / step {first}: {ratio:.2f}x (target <= {RESUME_TARGET}) {verdict(ok)}; the data set-up "
          f"alone {data_ratio:.2f}x")
    return ok


def reading_row(args: argparse.Namespace, work: Path) -> bool:
    """Batches of 8 x 2048 with cu_seqlens, read on one core."""
    import torch

    torch.set_num_threads(1)
    corpus = PreparedCorpus(random_folder(work.parent, args.resume_tokens))
    schedule = BatchSchedule(PreparedSequences(corpus.train, SEQ_LEN), BATCH, 1, 1, 0, seed=0)
    steps = iter(range(10 ** 9))

    def read() -> None:
        for _ in range(args.reading_batches):
            schedule.batch(next(steps), 0)

    samples = time_rounds({"read": read}, args.repeats)
    tokens = args.reading_batches * BATCH * SEQ_LEN
    rate = tokens / best(samples)["read"]
    batch = schedule.batch(0, 0)
    ok = rate >= READING_TARGET
    print(f"## reading: {args.reading_batches} batches of {BATCH} x {SEQ_LEN} tokens a round (about "
          f"{(batch['cu_seqlens'].numel() - 1) / BATCH:.1f} documents a sequence), one core, {args.repeats} rounds")
    print(f"{rate / 1e6:.1f}M tokens/s, {rate / READING_TARGET:.2f}x the target of {READING_TARGET / 1e6:.0f}M "
          f"{verdict(ok)}")
    return ok


def _peak_rss(argv: list[str], env: dict[str, str]) -> int:
    """The largest resident set, in bytes, of any process of ``argv``'s process tree (its DataLoader workers
    included), from the kernel's accounting of the child."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} failed:\n{err[-3000:]}")
    return usage.ru_maxrss * 1024  # kilobytes on Linux


def memory_row(args: argparse.Namespace, work: Path) -> bool:
    """Peak memory of a 20-step run on a large folder against a 10M-token one."""
    sizes = (MEMORY_SMALL, args.memory_tokens)
    folders = {size: random_folder(work.parent, size) for size in sizes}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    tiny = {"model.hidden_size": 32, "model.num_hidden_layers": 2, "model.num_heads": 2, "model.intermediate_size": 64,
            "data.seq_len": SEQ_LEN, "train.batch_size": BATCH, "train.max_steps": 20, "train.eval_every": 1000,
            "train.eval_batches": 1, "train.save_every": 1000, "train.log_every": 5, "train.num_threads": 1,
            "eval.run_after": "false"}
    overrides = [part for key, value in tiny.items() for part in (f"--{key}", str(value))]
    runs = iter(range(10 ** 6))

    def run(size: int) -> Callable[[], int]:
        def go() -> int:
            out = work / f"run-{next(runs)}"
            return _peak_rss([sys.executable, "-m", "rotarium", "train", "--output-dir", str(out),
                              "--data.source", str(folders[size]), *overrides], env)

        return go

    peaks: dict[int, list[int]] = {size: [] for size in sizes}
    for _ in range(args.repeats):
        for size in sizes:
            peaks[size].append(run(size)())
    small, large = (min(peaks[size]) for size in sizes)
    more = large - small
    ok = more <= MEMORY_TARGET
    print(f"## memory: a 20-step run (width 32, 2 layers, {BATCH} x {SEQ_LEN} tokens a step, 2 DataLoader workers), "
          f"peak resident memory of its largest process, least of {args.repeats} runs each")
    print(f"{MEMORY_SMALL / 1e6:,.0f}M tokens: {small / 2 ** 20:.1f} MB; {args.memory_tokens / 1e9:,.2f}B tokens: "
          f"{large / 2 ** 20:.1f} MB; {more / 2 ** 20:+.1f} MB ({large / small:.3f}x; target at most "
          f"{MEMORY_TARGET / 2 ** 20:.0f} MB more) {verdict(ok)}")
    return ok


# A streaming run's data path, from a fresh process: its config, the stream, and prepare_data at a recorded position.
STREAM_CHILD = """
import json, sys, time
from rotarium.data.tokenizer import load_tokenizer
from rotarium.training.build import loader_settings, open_data_source, prepare_data
from rotarium.training.config import load_config
source, tokenizer, step, position, seq_len, batch_size = sys.argv[1:]
imported = time.perf_counter()
config = load_config(None, {"data.source": source, "data.streaming": "true", "data.seq_len": seq_len,
                            "data.validation_documents": "100", "train.batch_size": batch_size})
data = prepare_data(config, load_tokenizer(tokenizer), open_data_source(config, 1), loader_settings(config, 1))
data.train.restore(int(step), json.loads(open(position).read()))
batch = data.train.batch(int(step), 0)
assert batch["input_ids"].shape == (1, int(seq_len) * int(batch_size))
print(f"data {time.perf_counter() - imported:.6f}", flush=True)
data.close()
"""


def streaming_row(args: argparse.Namespace, work: Path) -> bool:
    """Process start to the first batch of a streaming run resumed at step 10 and at step 200."""
    import time

    from rotarium.training.build import loader_settings, open_data_source, prepare_data
    from rotarium.training.config import load_config

    documents = [f"{copy} {text}" for copy in range(args.stream_copies) for text in embedded_documents()]
    folder = work / "stream"
    folder.mkdir()
    per_shard = -(-len(documents) // args.stream_shards)
    for k in range(args.stream_shards):
        part = documents[k * per_shard:(k + 1) * per_shard]
        (folder / f"part-{k:05d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part),
                                                     encoding="utf-8")
    tokenizer_dir = work.parent / "tokenizer-4096"
    if not tokenizer_dir.is_dir():
        train_bpe(embedded_documents(), 4096).save_pretrained(tokenizer_dir)
    tokenizer = load_tokenizer(str(tokenizer_dir))

    # the positions a run records at those steps, from a run of the loader from the stream's start
    config = load_config(None, {"data.source": str(folder), "data.streaming": "true", "data.seq_len": STREAM_SEQ_LEN,
                                "data.validation_documents": 100, "train.batch_size": BATCH,
                                "data.num_workers": 0})  # tokenising on this thread, as a resume replayed it
    data = prepare_data(config, tokenizer, open_data_source(config, 1), loader_settings(config, 1))
    states, started = {}, time.perf_counter()
    for step in range(max(STREAM_STEPS) + 1):
        if step in STREAM_STEPS:
            states[step] = work / f"state-{step}.json"
            states[step].write_text(json.dumps(data.train.position(step)))
            if step == max(STREAM_STEPS):
                replay = time.perf_counter() - started
        data.train.batch(step, 0)
    last_position = data.train.state()["position"]
    data.close()

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    data_seconds: dict[int, list[float]] = {step: [] for step in STREAM_STEPS}

    def resumed(step: int) -> Callable[[], None]:
        def run() -> None:
            argv = [str(folder), str(tokenizer_dir), str(step), str(states[step]), str(STREAM_SEQ_LEN), str(BATCH)]
            out = subprocess.run([sys.executable, "-c", STREAM_CHILD, *argv], env=env, capture_output=True,
                                 text=True, check=True)
            data_seconds[step].append(float(out.stdout.split("data ")[-1]))

        return run

    samples = time_rounds({step: resumed(step) for step in STREAM_STEPS}, args.repeats)
    times = best(samples)
    first, last = STREAM_STEPS
    print(f"## streaming: {len(documents):,} documents in {args.stream_shards} JSON Lines shards, sequences of "
          f"{STREAM_SEQ_LEN}, {BATCH} a step, 2 DataLoader workers, {args.repeats} rounds")
    for step in STREAM_STEPS:
        position = json.loads(states[step].read_text())["processes"][0]["position"]
        print(f"step {step}: at shard {position[1]} of {args.stream_shards}, {times[step]:.2f} s from process start "
              f"to the first batch, {min(data_seconds[step][1:]) * 1e3:.0f} ms of it after the imports")
    ratio = paired_ratio(samples[last], samples[first])
    data_ratio = paired_ratio(data_seconds[last][1:], data_seconds[first][1:])
    ok = ratio <= STREAM_TARGET
    print(f"step {last} / step {first}: {ratio:.2f}x (target <= {STREAM_TARGET}) {verdict(ok)}; the data set-up "
          f"alone {data_ratio:.2f}x")
    print(f"reading and tokenising the stream from its start to step {last} ({last * BATCH * STREAM_SEQ_LEN:,} "
          f"tokens, shard {last_position[1]}), as a resume did before: {replay:.2f} s on the training thread")
    return ok


ROWS: dict[str, Callable[[argparse.Namespace, Path], bool]] = {"prepare": prepare_row, "resume": resume_row,
                                                               "reading": reading_row, "memory": memory_row,
                                                               "streaming": streaming_row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=20, help="prepare: copies of the embedded corpus in the source")
    parser.add_argument("--vocab-size", type=int, default=4096, help="prepare: the trained tokenizer's size")
    parser.add_argument("--prepare-tokenizer", default="bpe",
                        help="prepare: bpe (rotarium's byte-level BPE trained on the embedded corpus), llama (a "
                             "Llama-2-style BPE built offline, llama_style_tokenizer; with --vocab-size 32000), or a "
                             "Hub tokenizer or folder")
    parser.add_argument("--resume-tokens", type=int, default=MEMORY_SMALL,
                        help="resume and reading: the prepared folder's training tokens")
    parser.add_argument("--reading-batches", type=int, default=200, help="reading: batches a round")
    parser.add_argument("--memory-tokens", type=int, default=2_000_000_000,
                        help="memory: the large folder's training tokens (2 bytes each on disk)")
    parser.add_argument("--stream-shards", type=int, default=200, help="streaming: JSON Lines files of the stream")
    parser.add_argument("--stream-copies", type=int, default=16,
                        help="streaming: copies of the embedded corpus in the stream")
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
