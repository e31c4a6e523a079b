"""Streaming data without preparing it (``data.streaming``), offline on local JSON Lines files (one file a shard):
held-out documents are the head of the stream and never trained on; each process reads only its own shards (or,
when the shard count does not divide between the processes, its own rows of every shard) and together they cover
each pass; passes wrap with a new order; tokenising happens in DataLoader workers; a loader built from another's
state goes on with the same batches; a SIGKILLed streaming run resumes to the uninterrupted losses, its checkpoints
recording each process's position; a resume under another layout is refused by name."""
import itertools
import json
import os
import signal

import pytest
import torch

from rotarium.data import stream as stream_module
from rotarium.data.config import DataSection, LoaderSettings
from rotarium.data.documents import StreamShards, embedded_documents, held_out_documents, iter_documents
from rotarium.data.stream import StreamLoader, plan_stream, stream_documents, stream_layout
from rotarium.data.tokenizer import train_bpe
from rotarium.training.resume import check_stream
from rotarium.training.run_folder import latest_checkpoint, read_trainer_state
from tests.training.helpers import accelerate_config, cli_args, losses, ok, run_child

DOCUMENTS = embedded_documents()


def _jsonl(path, documents):
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    return path


def _settings(shuffle, workers, accum=1):
    """A loader's settings: sequences of 32 tokens, 4 to a micro-batch, seed 0."""
    return LoaderSettings(DataSection(seq_len=32, shuffle_buffer=shuffle, num_workers=workers), batch_size=4,
                          accum=accum, seed=0)


def _shards(folder, files=4, per_file=20):
    """``files`` JSON Lines files of ``per_file`` documents each, the embedded corpus in order."""
    folder.mkdir(exist_ok=True)
    for k in range(files):
        _jsonl(folder / f"part-{k:02d}.jsonl", DOCUMENTS[k * per_file:(k + 1) * per_file])
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(DOCUMENTS, 320)


def _epoch(source, plan, seed=0, shuffle=8, epoch=0):
    """The documents of one pass of a process, from the pass's start."""
    return [text for text, (e, _, _) in itertools.takewhile(
        lambda item: item[1][0] == epoch, stream_documents(source, plan, seed, shuffle, (epoch, 0, 0)))]


def test_held_out_documents_are_the_head_of_the_stream_and_training_skips_them(tmp_path):
    cfg = DataSection(source=str(_shards(tmp_path / "s")), streaming=True, validation_documents=25)
    source = StreamShards(cfg)
    assert len(source) == 4
    held, taken = source.held_out(25)
    assert held == DOCUMENTS[:25] == held_out_documents(cfg, 0) == list(itertools.islice(iter_documents(cfg), 25))
    assert taken == [20, 5, 0, 0]  # rows at each shard's head that the validation documents take
    training = _epoch(source, plan_stream(4, 1, 0, taken))
    assert sorted(training) == sorted(DOCUMENTS[25:80]) and training != DOCUMENTS[25:80]  # shuffled, head excluded
    assert _epoch(source, plan_stream(4, 1, 0, taken)) == training  # the seed fixes the order
    assert _epoch(source, plan_stream(4, 1, 0, taken), seed=1) != training
    assert _epoch(source, plan_stream(4, 1, 0, taken), shuffle=1) == DOCUMENTS[25:80]  # 1: in the stream's order


@pytest.mark.parametrize("files, world", [(4, 2), (4, 4), (3, 2), (1, 3)])
def test_processes_read_their_own_rows_and_cover_each_pass(tmp_path, monkeypatch, files, world):
    cfg = DataSection(source=str(_shards(tmp_path / "s", files, 60 // files)), streaming=True)
    source = StreamShards(cfg)
    read = []
    original = StreamShards.rows
    monkeypatch.setattr(StreamShards, "rows", lambda self, shard, *a, **k: (read.append(shard), original(
        self, shard, *a, **k))[1])
    held = [0] * files
    for epoch in (0, 1):
        passes = []
        for rank in range(world):
            plan = plan_stream(files, world, rank, held)
            del read[:]
            passes.append(_epoch(source, plan, epoch=epoch))
            own = files % world == 0
            assert plan.own_shards == own
            assert sorted(set(read)) == (list(range(rank, files, world)) if own else list(range(files)))
        together = [text for part in passes for text in part]
        assert sorted(together) == sorted(DOCUMENTS[:60])  # disjoint, and each pass covers the stream
        assert all(passes)
    ahead = _epoch(source, plan_stream(files, world, 0, held), epoch=1)
    assert ahead != _epoch(source, plan_stream(files, world, 0, held), epoch=0)  # a new pass, a new order


def test_a_parquet_file_is_split_into_its_row_groups_for_the_processes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCUMENTS[:80]}), tmp_path / "one.parquet", row_group_size=10)
    cfg = DataSection(source=str(tmp_path / "one.parquet"), streaming=True)
    whole, split = StreamShards(cfg), StreamShards(cfg, reshard_for=2)
    assert (len(whole), len(split)) == (1, 8)
    assert [text for shard in range(8) for text in split.rows(shard)] == DOCUMENTS[:80]  # the same rows, in order
    assert split.held_out(15) == (DOCUMENTS[:15], [10, 5, 0, 0, 0, 0, 0, 0]) and whole.held_out(15)[0] == DOCUMENTS[:15]
    assert plan_stream(len(split), 2, 1, [0] * 8).shards == (1, 3, 5, 7)


def test_tokenising_happens_in_the_workers_and_a_loader_goes_on_from_a_state(tmp_path, tokenizer, monkeypatch):
    cfg = DataSection(source=str(_shards(tmp_path / "s")), streaming=True)
    source = StreamShards(cfg)
    plan = plan_stream(4, 2, 1, [0] * 4)
    pids = tmp_path / "pids"
    original = stream_module.tokenize

    def tokenize(*args, **kwargs):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(*args, **kwargs)

    monkeypatch.setattr(stream_module, "tokenize", tokenize)

    def loader(start_step=0, state=None, workers=2):
        return StreamLoader(source, plan, tokenizer, _settings(accum=2, shuffle=8, workers=workers),
                            start_step=start_step, state=state)

    first = loader()
    reference = [first.batch(step, micro) for step in range(12) for micro in range(2)]
    first.close()
    tokenisers = set(pids.read_text().split())
    assert tokenisers and str(os.getpid()) not in tokenisers
    assert all(b["input_ids"].shape == (1, 128) and b["cu_seqlens"][0] == 0 for b in reference)
    for stop, workers in ((5, 2), (7, 0)):
        stopped = loader(workers=workers)
        for step in range(stop):
            for micro in range(2):
                stopped.batch(step, micro)
        state = json.loads(json.dumps(stopped.state()))  # as a checkpoint stores it
        stopped.close()
        resumed = loader(stop, state, workers=2 - workers)  # the order does not depend on the workers
        again = [resumed.batch(step, micro) for step in range(stop, 12) for micro in range(2)]
        resumed.close()
        for got, want in zip(again, reference[2 * stop:]):
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["cu_seqlens"],
                                                                                    want["cu_seqlens"])
    with pytest.raises(RuntimeError, match="in order"):
        loader().batch(1, 0)


def test_a_resume_opens_no_shard_before_its_own_and_rereads_only_the_current_block(tmp_path, tokenizer,
                                                                                   monkeypatch):
    source = StreamShards(DataSection(source=str(_shards(tmp_path / "s", 5, 16)), streaming=True))
    plan = plan_stream(5, 1, 0, [0] * 5)
    first = StreamLoader(source, plan, tokenizer, _settings(shuffle=4, workers=0))
    step = 0
    while not (first.cursor[1] >= 1 and first.cursor[2] % 4):  # in a later shard, inside a block of 4 rows
        first.batch(step, 0)
        step += 1
    state = first.state()
    epoch, at, row = state["position"]
    opened = []
    original = StreamShards.rows

    def rows(self, shard, start=0, **kwargs):
        opened.append((shard, start))
        return original(self, shard, start, **kwargs)

    monkeypatch.setattr(StreamShards, "rows", rows)
    resumed = StreamLoader(source, plan, tokenizer, _settings(shuffle=4, workers=0), start_step=step, state=state)
    for later in range(step, step + 20):  # past the tokens the packer kept, into the stream
        assert torch.equal(resumed.batch(later, 0)["input_ids"], first.batch(later, 0)["input_ids"])
    current = plan.shards[stream_module.shard_order(5, 0, epoch, 4)[at]]
    assert opened[0] == (current, row - row % 4)  # the current shard, from its current block's start


def test_a_shard_count_that_does_not_divide_is_logged(tmp_path, tokenizer, caplog):
    from rotarium.training.build import loader_settings, open_data_source, prepare_data
    from rotarium.training.config import load_config

    config = load_config(None, {"data.source": str(_shards(tmp_path / "s", 3, 10)), "data.streaming": "true",
                                "data.seq_len": 32, "data.validation_documents": 2, "train.batch_size": 4})
    for world, logged in ((3, False), (2, True)):
        caplog.clear()
        data = prepare_data(config, tokenizer, open_data_source(config, world), loader_settings(config, world))
        assert data.train.layout == stream_layout(3, world)
        assert ("every process reads the whole stream and keeps one row in 2" in caplog.text) == logged
        data.close()


def test_bad_data_read_by_a_worker_is_one_line_naming_its_row(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": list(range(10))}), tmp_path / "numbers.parquet")
    source = StreamShards(DataSection(source=str(tmp_path / "numbers.parquet"), streaming=True))
    loader = StreamLoader(source, plan_stream(1, 1, 0, [0]), tokenizer, _settings(shuffle=1, workers=2))
    with pytest.raises(ValueError, match=r"numbers\.parquet row 1 has a `text` that is int"):
        loader.batch(0, 0)
    loader.close()


def test_a_resume_under_another_layout_is_refused_by_name(tmp_path):
    checkpoint = tmp_path / "step-6"
    recorded = {"stream": stream_layout(4, 2), "processes": [{}, {}]}
    check_stream(checkpoint, recorded, stream_layout(4, 2), "s", set())
    with pytest.raises(ValueError, match=r"2 processes -> 1.*resume with 2 processes"):
        check_stream(checkpoint, recorded, stream_layout(4, 1), "s", set())
    with pytest.raises(ValueError, match="4 shards of the stream -> 6"):
        check_stream(checkpoint, recorded, stream_layout(6, 2), "s", set())
    check_stream(checkpoint, recorded, stream_layout(4, 1), "s", {"data"})  # goes on, from the stream's start


def _resumes_exactly(tmp_path, data, **extra):
    extra = {"data__streaming": "true", "data__validation_documents": 8, "data__shuffle_buffer": 16, **extra}
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    ok(run_child(["train", "--output-dir", str(reference), *cli_args(data, **extra)]))
    args = ["train", "--output-dir", str(killed), *cli_args(data, **extra)]
    result = run_child(args, kill_at_step=9)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert latest_checkpoint(killed).name == "step-6"
    position = read_trainer_state(latest_checkpoint(killed))["data"]
    assert position["stream"] == stream_layout(len(list(data.glob("*.jsonl"))) if data.is_dir() else 1, 1)
    assert len(position["processes"]) == 1 and len(position["processes"][0]["position"]) == 3
    ok(run_child([*args, "--resume"]))
    mine, ref = losses(killed), losses(reference)
    assert sorted(mine) == sorted(ref) == list(range(1, 13))
    assert all(abs(mine[s] - ref[s]) <= 1e-6 for s in range(7, 13)), (mine, ref)
    val = losses(reference, "val_loss")
    assert val[12] < val[0] and torch.isfinite(torch.tensor(list(val.values()))).all()


@pytest.mark.slow
def test_streaming_run_resumes_exactly_after_sigkill(tmp_path):
    _resumes_exactly(tmp_path, _jsonl(tmp_path / "docs.jsonl", DOCUMENTS[:40]))


@pytest.mark.slow
def test_streaming_run_of_several_shards_with_workers_resumes_exactly_after_sigkill(tmp_path):
    _resumes_exactly(tmp_path, _shards(tmp_path / "shards", 5, 8), data__num_workers=2)


DDP = ["--config_file", accelerate_config("ddp_cpu.yaml"), "--num_processes", "2"]


@pytest.mark.slow
@pytest.mark.xdist_group("distributed")
def test_ddp_streaming_run_with_workers_resumes_exactly_and_refuses_another_process_count(tmp_path):
    data = _shards(tmp_path / "shards", 4, 10)
    extra = {"data__streaming": "true", "data__validation_documents": 4, "data__shuffle_buffer": 8,
             "data__num_workers": 2, "train__max_steps": 4, "train__save_every": 2, "train__eval_every": 2,
             "train__global_batch_size": 8}
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    ok(run_child(["train", "--output-dir", str(uninterrupted), *cli_args(data, **extra)], launch=DDP))
    args = ["train", "--output-dir", str(killed), *cli_args(data, **extra)]
    result = run_child(args, launch=DDP, kill_at_step=3)  # every process SIGKILLs itself after its third step
    assert result.returncode != 0 and not (killed / "final").exists(), result.stderr[-3000:]
    position = read_trainer_state(latest_checkpoint(killed))["data"]
    assert position["stream"] == stream_layout(4, 2) and len(position["processes"]) == 2
    assert position["processes"][0] != position["processes"][1]

    refused = run_child([*args, "--resume"])  # one process cannot take over two processes' places in the stream
    assert refused.returncode == 2 and "2 processes -> 1" in refused.stderr, refused.stderr[-3000:]
    ok(run_child([*args, "--resume"], launch=DDP))
    mine, ref = losses(killed), losses(uninterrupted)
    assert sorted(mine) == sorted(ref) == [1, 2, 3, 4]
    assert all(abs(mine[s] - ref[s]) <= 1e-6 for s in (3, 4)), (mine, ref)
