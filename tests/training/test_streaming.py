"""Streaming data (the FineWeb-Edu recipes' path), offline on a local JSON Lines file: held-out documents are the
first of the stream and never trained on, passes over the stream wrap with a new shuffle, and a SIGKILLed streaming
run resumes exactly."""
import json
import signal

import torch

from rotarium.data.batches import StreamingSchedule
from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, iter_documents
from rotarium.training.run_folder import latest_checkpoint

from .conftest import cli_args, losses, ok, run_child


def _jsonl(path, n=40):
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in embedded_documents()[:n]))
    return path


def test_validation_is_the_head_of_the_stream_and_training_skips_it(tmp_path):
    cfg = DataSection(source=str(_jsonl(tmp_path / "docs.jsonl")), streaming=True, shuffle_buffer=8)
    everything = list(iter_documents(cfg))
    assert everything == embedded_documents()[:40]  # unshuffled without a seed
    training = list(iter_documents(cfg, skip=5, shuffle_seed=3))
    assert sorted(training) == sorted(everything[5:]) and training != everything[5:]  # shuffled, head excluded
    assert list(iter_documents(cfg, skip=5, shuffle_seed=3)) == training  # the seed fixes the order


def test_streaming_schedule_wraps_into_new_passes_and_resumes_anywhere():
    def make_stream(epoch):  # 5 one-token sequences a pass, tagged by pass
        return iter([([100 * epoch + i, 0], []) for i in range(5)])

    schedule = StreamingSchedule(make_stream, batch_size=2, accum=1, world=1, rank=0, start_step=0)
    batches = [schedule.batch(step, 0)["input_ids"].view(-1, 2)[:, 0].tolist() for step in range(6)]
    assert batches == [[0, 1], [2, 3], [4, 100], [101, 102], [103, 104], [200, 201]]
    resumed = StreamingSchedule(make_stream, batch_size=2, accum=1, world=1, rank=0, start_step=3)
    assert [resumed.batch(step, 0)["input_ids"].view(-1, 2)[:, 0].tolist() for step in range(3, 6)] == batches[3:]
    ranks = [StreamingSchedule(make_stream, 1, 1, 2, r, 0).batch(0, 0)["input_ids"].view(-1).tolist() for r in (0, 1)]
    assert ranks[0] != ranks[1]


def test_streaming_run_resumes_exactly_after_sigkill(tmp_path):
    data = _jsonl(tmp_path / "docs.jsonl")
    extra = {"data__streaming": "true", "data__validation_documents": 8, "data__shuffle_buffer": 16}
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    ok(run_child(["train", "--output-dir", str(reference), *cli_args(data, **extra)]))
    args = ["train", "--output-dir", str(killed), *cli_args(data, **extra)]
    result = run_child(args, kill_at_step=9)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert latest_checkpoint(killed).name == "step-6"
    ok(run_child([*args, "--resume"]))
    mine, ref = losses(killed), losses(reference)
    assert sorted(mine) == sorted(ref) == list(range(1, 13))
    assert all(abs(mine[s] - ref[s]) <= 1e-5 for s in range(7, 13)), (mine, ref)
    val = losses(reference, "val_loss")
    assert val[12] < val[0] and torch.isfinite(torch.tensor(list(val.values()))).all()
