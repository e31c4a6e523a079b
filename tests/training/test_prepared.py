"""Training from a prepared folder (issue 33 section 2): the sequences are the ones a run that tokenises the same text
packs, each rank reads only its own rows through memory maps, a resume starts at the exact next batch in constant
time (also with DataLoader workers, after a SIGKILL, under DDP and on fewer processes), a changed folder or tokenizer
is refused by name, and validation and `rotarium eval` read the folder's validation split."""
from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rotarium.data import batches
from rotarium.data.batches import BatchSchedule, EpochOrder, epoch_order, pack_all, tokenize
from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, iter_documents, split_documents
from rotarium.data.heldout import check_prepared, prepared_record
from rotarium.data.loader import BatchLoader, PreparedSequences
from rotarium.data.prepared import PreparedCorpus, prepare
from rotarium.data.tokenizer import load_tokenizer, train_bpe
from rotarium.training.config import load_config
from rotarium.training.run_folder import latest_checkpoint, read_trainer_state
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import TINY, accelerate_config, cli_args, losses, ok, run_child

SEQ_LEN = TINY["data.seq_len"]
FRACTION = TINY["data.validation_fraction"]


def _tokenizer(folder: Path, documents: list[str], bos: bool = False) -> Path:
    """A byte-level BPE of 320 tokens saved in ``folder``; with ``bos``, its template starts a text with <|bos|>
    (as Llama's does)."""
    tokenizer = train_bpe(documents, 320)
    if bos:
        from tokenizers import processors

        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer_folder(corpus, tmp_path_factory) -> Path:
    documents = list(iter_documents(DataSection(source=str(corpus))))
    return _tokenizer(tmp_path_factory.mktemp("tokenizer"), split_documents(documents, FRACTION, 0)[0])


@pytest.fixture(scope="module")
def folder(corpus, tokenizer_folder, tmp_path_factory) -> Path:
    """The 40-document corpus prepared with the run's tokenizer and validation fraction, in shards small enough that
    sequences cross them."""
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    prepare(str(corpus), out, tokenizer=str(tokenizer_folder), validation_fraction=FRACTION, shard_tokens=3000,
            num_proc=1, progress=False)
    return out


# ------------------------------------------------------------------------------------------------ the sequences
def test_windows_are_the_sequences_a_tokenising_run_packs(corpus, folder, tokenizer_folder):
    prepared = PreparedCorpus(folder)
    assert prepared.train.num_shards > 2
    tokenizer = load_tokenizer(str(tokenizer_folder))
    documents = list(iter_documents(DataSection(source=str(corpus))))
    train_docs, held_out = split_documents(documents, FRACTION, 0)
    for split, docs in ((prepared.train, train_docs), (prepared.validation, held_out)):
        packed = pack_all(tokenizer, docs, SEQ_LEN, "test")
        windows = PreparedSequences(split, SEQ_LEN).packed(len(packed) + 1)
        assert torch.equal(windows.tokens, packed.tokens)  # the same count too: the last partial window is dropped
        assert windows.starts == packed.starts


def test_bos_frames_documents_alike_in_both_paths(corpus, tmp_path):
    """A tokenizer whose template adds a bos (as Llama's) gets it before every document in a prepared folder and in
    a run that tokenises its text; rotarium's BPE (the embedded demo's) adds none, as before."""
    documents = list(iter_documents(DataSection(source=str(corpus))))
    train_docs = split_documents(documents, FRACTION, 0)[0]
    with_bos = load_tokenizer(str(_tokenizer(tmp_path / "bos", train_docs, bos=True)))
    plain = load_tokenizer(str(_tokenizer(tmp_path / "plain", train_docs)))
    assert [ids[0] for ids in tokenize(with_bos, train_docs[:5])] == [with_bos.bos_token_id] * 5
    assert list(tokenize(plain, train_docs[:5])) == plain(train_docs[:5], add_special_tokens=False)["input_ids"]
    prepared = prepare(str(corpus), tmp_path / "out", tokenizer=str(tmp_path / "bos"), validation_fraction=FRACTION,
                       num_proc=1, progress=False)
    assert prepared.bos_id == with_bos.bos_token_id
    packed = pack_all(with_bos, train_docs, SEQ_LEN, "test")
    assert torch.equal(PreparedSequences(prepared.train, SEQ_LEN).packed(len(packed)).tokens, packed.tokens)


def _sequences(folder: Path) -> PreparedSequences:
    return PreparedSequences(PreparedCorpus(folder).train, SEQ_LEN)


def test_ranks_rows_are_disjoint_and_cover_each_epoch(folder):
    data = _sequences(folder)
    n, world, accum, B = len(data), 2, 2, 3
    ranks = [BatchSchedule(data, B, accum, world, r, seed=7) for r in range(world)]
    for epoch in (0, 5):
        seen = []  # positions in the order the global batches take them: step, micro-batch, rank, row
        for step in range(epoch * n // 12, (epoch + 1) * n // 12 + 2):
            for micro in range(accum):
                for rank in ranks:
                    first = rank.consumed(step) + (micro * world + rank.rank) * B
                    seen += [(first + j, i) for j, i in enumerate(rank.indices(step, micro))]
        in_epoch = [i for position, i in seen if epoch * n <= position < (epoch + 1) * n]
        assert sorted(in_epoch) == list(range(n))  # every sequence once: disjoint, and covering the epoch
    assert ranks[0].indices(3, 0) != BatchSchedule(data, B, accum, world, 0, seed=8).indices(3, 0)  # seeded


class _Recording(PreparedSequences):
    """Records every sequence it reads."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: list[int] = []

    def sequence(self, i):
        self.read.append(i)
        return super().sequence(i)


def test_each_rank_reads_only_its_rows_through_memory_maps(folder):
    split = PreparedCorpus(folder).train
    for rank in (0, 1):
        data = _Recording(split, SEQ_LEN)
        schedule = BatchSchedule(data, 2, 2, 2, rank, seed=0)
        loader = BatchLoader(schedule, 4, num_workers=0)
        mine = []
        for step in range(4, 7):
            for micro in range(2):
                batch = loader.batch(step, micro)
                mine += schedule.indices(step, micro)
                assert batch["input_ids"].shape == (1, 2 * SEQ_LEN)
        loader.close()
        assert data.read == mine  # nothing else, in order
    tokens, offsets = split.shard(0)
    assert isinstance(tokens, np.memmap) and isinstance(offsets, np.memmap)
    # a worker gets the reader without its maps (a map pickles as its content) and opens its own
    assert len(pickle.dumps(PreparedSequences(split, SEQ_LEN))) < split.num_tokens * split.dtype.itemsize / 4


def test_the_loader_hands_out_batches_in_order_from_workers(folder):
    schedule = BatchSchedule(_sequences(folder), 2, 2, 1, 0, seed=0)
    loader = BatchLoader(schedule, 3, num_workers=2)
    for step in range(3, 6):
        for micro in range(2):
            got, expected = loader.batch(step, micro), schedule.batch(step, micro)
            assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(RuntimeError, match="asked for step 7 micro-batch 0, the next one is step 6"):
        loader.batch(7, 0)
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        loader.batch(6, 0)


def test_resume_builds_the_loader_in_constant_time(folder, monkeypatch):
    calls = {"order": 0, "indices": 0}
    original_order, original_indices = batches.epoch_order, BatchSchedule.indices

    def counted_order(*args):
        calls["order"] += 1
        return original_order(*args)

    def counted_indices(self, *args):
        calls["indices"] += 1
        return original_indices(self, *args)

    monkeypatch.setattr(batches, "epoch_order", counted_order)
    monkeypatch.setattr(BatchSchedule, "indices", counted_indices)
    data = _sequences(folder)
    start = time.perf_counter()
    schedule = BatchSchedule(data, 4, 2, 2, 1, seed=0, start_step=1_000_000)
    loader = BatchLoader(schedule, 1_000_000, num_workers=0)
    batch = loader.batch(1_000_000, 0)
    elapsed = time.perf_counter() - start
    assert calls == {"order": 1, "indices": 1}, calls  # the one epoch and micro-batch asked for, nothing skipped
    assert elapsed < 2.0, elapsed
    position = 1_000_000 * 16 + 1 * 4  # 16 sequences a step; rank 1's first row
    expected = [int(epoch_order(len(data), 0, (position + j) // len(data))[(position + j) % len(data)])
                for j in range(4)]
    assert torch.equal(batch["input_ids"].view(4, SEQ_LEN), data.rows(expected)[0])


def test_a_large_epoch_order_is_cached_and_mapped(tmp_path):
    order = EpochOrder(1000, seed=3, cache=tmp_path, cache_from=1000)
    first = order(2)
    assert isinstance(first, np.memmap) and first.dtype == np.uint32
    assert np.array_equal(first, epoch_order(1000, 3, 2)) and order.path(2).is_file()
    again = EpochOrder(1000, seed=3, cache=tmp_path, cache_from=1000)(2)  # another process maps the same file
    assert isinstance(again, np.memmap) and np.array_equal(again, first)
    small = EpochOrder(999, seed=3, cache=tmp_path, cache_from=1000)
    assert small.path(0) is None and not isinstance(small(0), np.memmap)


def test_a_section_name_allows_its_keys_on_resume():
    from rotarium.training.resume import check_allowed_keys

    check_allowed_keys({"data", "optim", "train"})
    for fixed in ("model", "tokenizer"):
        with pytest.raises(ValueError, match=f"--allow-config-change {fixed}: model and tokenizer settings"):
            check_allowed_keys({fixed})


def test_num_workers_is_checked():
    with pytest.raises(ValueError, match="`data.num_workers` must be at least 0"):
        load_config(None, {"data.num_workers": "-1"})
    assert load_config(None, {"data.num_workers": "0"}).data.num_workers == 0


def test_a_validation_fraction_the_folder_was_not_prepared_with_is_refused_by_name(folder, tmp_path, capsys):
    from rotarium.cli import main

    code = main(["train", "--output-dir", str(tmp_path / "run"), *cli_args(folder, data__validation_fraction=0.3)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("rotarium train: error: `data.validation_fraction=0.3` does not apply to the prepared "
                             f"folder {folder}: its validation split was set when it was prepared "
                             f"(--validation-fraction {FRACTION})"), err[0]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------------- runs
RUN = {"train__max_steps": 3, "train__save_every": 2, "train__eval_every": 3}


@pytest.fixture(scope="module")
def prepared_run(folder, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "prepared"
    ok(run_child(["train", "--output-dir", str(run_dir), *cli_args(folder, **RUN)]))
    return run_dir


# These tests share the prepared run and its refusals (module fixtures, made again in each worker that runs one of
# them): one worker runs them all (xdist_group), so those are made once.
@pytest.mark.slow
@pytest.mark.xdist_group("prepared-run")
def test_a_prepared_run_repeats_a_tokenising_run_on_the_same_documents(corpus, tokenizer_folder, prepared_run,
                                                                       tmp_path):
    """The same documents, tokenizer and seed: the same sequences in the same order, so the same losses."""
    run_dir = tmp_path / "tokenising"
    ok(run_child(["train", "--output-dir", str(run_dir),
                  *cli_args(corpus, **RUN, tokenizer__name=str(tokenizer_folder))]))
    mine, theirs = losses(prepared_run), losses(run_dir)
    assert sorted(mine) == [1, 2, 3] and all(abs(mine[s] - theirs[s]) <= 1e-6 for s in mine), (mine, theirs)
    val, their_val = losses(prepared_run, "val_loss"), losses(run_dir, "val_loss")
    assert sorted(val) == [0, 3] and all(abs(val[s] - their_val[s]) <= 1e-6 for s in val)
    records = [json.loads(line) for line in (prepared_run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["data_wait_seconds"] >= 0 for r in records if "loss" in r)


@pytest.mark.slow
@pytest.mark.xdist_group("prepared-run")
def test_a_checkpoint_records_the_data_position(prepared_run, folder):
    prepared = PreparedCorpus(folder)
    data = read_trainer_state(latest_checkpoint(prepared_run))["data"]
    n = prepared.train.num_tokens // SEQ_LEN
    assert data == {"epoch": 0, "sequences": 2 * 4, "sequences_per_epoch": n, "seed": 0,
                    "prepared": prepared.fingerprint, "tokenizer": prepared.tokenizer_sha256}
    # the run took the folder's tokenizer
    assert json.loads((prepared_run / "tokenizer" / "tokenizer.json").read_text()) == json.loads(
        (folder / "tokenizer" / "tokenizer.json").read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("prepared-run")
def test_eval_scores_the_validation_split_the_run_held_out(prepared_run, folder, tmp_path):
    from rotarium.evaluation.perplexity import evaluation_documents, evaluation_tokens

    text, description = evaluation_documents("validation", prepared_run / "final")
    assert isinstance(text, PreparedCorpus) and text.fingerprint == PreparedCorpus(folder).fingerprint
    assert "validation split" in description
    tokens = evaluation_tokens(text, load_tokenizer(str(prepared_run / "final")), 100)
    assert torch.equal(tokens, torch.from_numpy(text.validation.tokens(0, 100).astype(np.int64)))
    # a validation shard changed since: refused, naming the file
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    record = prepared_record(PreparedCorpus(copy))
    shard = copy / "validation" / "00000.tokens.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="00000.tokens.npy changed since it was prepared"):
        check_prepared(record, "training_args.json")
    # another tokenizer's ids are not scored as this one's
    with pytest.raises(ValueError, match="not the one the prepared folder"):
        evaluation_tokens(text, train_bpe(embedded_documents()[:20], 300), 100)


@pytest.fixture(scope="module")
def refusals(corpus, folder, prepared_run, tmp_path_factory) -> tuple[Path, dict]:
    """Resumes of copies of the prepared run with the folder moved (its content the same), refilled from other
    documents, or prepared with another tokenizer; and fresh runs that name another tokenizer or streaming."""
    work = tmp_path_factory.mktemp("refusals")
    moved = work / "moved"
    shutil.copytree(folder, moved)
    other = work / "other.txt"
    other.write_text("\n\n\n".join(embedded_documents()[40:80]))
    refilled, retokenised = work / "refilled", work / "retokenised"
    prepare(str(other), refilled, tokenizer=str(folder / "tokenizer"), validation_fraction=FRACTION, num_proc=1,
            progress=False)
    another = _tokenizer(work / "another", embedded_documents()[40:80])
    prepare(str(corpus), retokenised, tokenizer=str(another), validation_fraction=FRACTION, num_proc=1,
            progress=False)
    for name in ("moved", "content", "tokenizer"):
        shutil.copytree(prepared_run, work / f"run-{name}")

    def resume(name: str, source: Path) -> list[str]:
        return ["train", "--output-dir", str(work / f"run-{name}"), "--resume", "--max-steps", "4",
                "--allow-config-change", "data.source", "--data.source", str(source)]

    cases = {
        "moved": resume("moved", moved),
        "content": resume("content", refilled),
        "tokenizer": resume("tokenizer", retokenised),
        "tokenizer.name": ["train", "--output-dir", str(work / "named"),
                           *cli_args(folder, **RUN, tokenizer__name=str(another))],
        "streaming": ["train", "--output-dir", str(work / "streaming"),
                      *cli_args(folder, **RUN, data__streaming="true")],
    }
    return work, run_cli_cases(cases, work)


@pytest.mark.slow
@pytest.mark.xdist_group("prepared-run")
def test_a_moved_folder_with_the_same_content_resumes(refusals):
    work, results = refusals
    code, err = results["moved"]
    assert code == 0, err[-3000:]
    assert sorted(losses(work / "run-moved")) == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.xdist_group("prepared-run")
@pytest.mark.parametrize("case,expected", [
    ("content", ["`data.source=", "refilled` is not the prepared folder step-2 was trained on",
                 "its content differs (fingerprint", "--allow-data-change"]),
    ("tokenizer", ["retokenised` is not the prepared folder", "its tokenizer differs (SHA-256",
                   "--allow-data-change"]),
    ("tokenizer.name", ["`tokenizer.name", "another", "is not the tokenizer the prepared folder",
                        "leave tokenizer.name unset"]),
    ("streaming", ["is a prepared folder", "drop `data.streaming`"]),
])
def test_a_changed_folder_or_tokenizer_is_refused_by_name(refusals, case, expected):
    message = error_line(refusals[1][case], "train")
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


@pytest.mark.slow
@pytest.mark.xdist_group("prepared-run")
def test_allow_data_change_goes_on_with_a_changed_folder(refusals):
    work, _ = refusals
    run_dir = work / "run-content"
    result = run_child(["train", "--output-dir", str(run_dir), "--resume", "--max-steps", "4",
                        "--allow-config-change", "data", "--allow-data-change", "--data.source",
                        str(work / "refilled")])
    ok(result)
    assert "going on as --allow-data-change allows" in result.stderr
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------- DDP with workers
DDP = ["--config_file", accelerate_config("ddp_cpu.yaml"), "--num_processes", "2"]
GLOBAL = {"train__max_steps": 4, "train__save_every": 2, "train__eval_every": 2, "train__global_batch_size": 8,
          "data__num_workers": 2}


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
def test_ddp_with_workers_killed_and_resumed_repeats_the_run_also_on_one_process(folder, tmp_path):
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    ok(run_child(["train", "--output-dir", str(uninterrupted), *cli_args(folder, **GLOBAL)], launch=DDP))
    start = json.loads((uninterrupted / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2 and len(set(start["first_batch_fingerprints"])) == 2
    args = ["train", "--output-dir", str(killed), *cli_args(folder, **GLOBAL)]
    result = run_child(args, launch=DDP, kill_at_step=3)  # every process SIGKILLs itself after its third step
    assert result.returncode != 0 and not (killed / "final").exists(), result.stderr[-3000:]
    assert latest_checkpoint(killed).name == "step-2"
    one = tmp_path / "one-process"
    shutil.copytree(killed, one)

    ok(run_child([*args, "--resume"], launch=DDP))
    mine, ref = losses(killed), losses(uninterrupted)
    assert sorted(mine) == sorted(ref) == [1, 2, 3, 4]
    assert all(abs(mine[s] - ref[s]) <= 1e-6 for s in (3, 4)), (mine, ref)

    # one process with 2 micro-batches of 4 takes the 8 sequences the two processes took
    ok(run_child(["train", "--output-dir", str(one), "--resume"]))
    assert json.loads((one / "training_args.json").read_text())["world_size"] == 1
    mine = losses(one)
    assert all(abs(mine[s] - ref[s]) <= 1e-6 for s in (3, 4)), (mine, ref)


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
def test_fsdp_reads_a_prepared_folder_with_workers(folder, tmp_path):
    run_dir = tmp_path / "fsdp"
    launch = ["--config_file", accelerate_config("fsdp_cpu.yaml"), "--num_processes", "2"]
    ok(run_child(["train", "--output-dir", str(run_dir),
                  *cli_args(folder, **{**GLOBAL, "train__max_steps": 2, "train__eval_every": 2})], launch=launch))
    start = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2 and len(set(start["first_batch_fingerprints"])) == 2
    assert sorted(losses(run_dir)) == [1, 2]
