"""What `rotarium train` refuses rather than lose work or report wrong work as success.

A resume never goes back on a run's work in silence: a --max-steps below the step the run reached, or a finished run
resumed from an older checkpoint, stops (exit code 2, naming the step reached and --init-from); --allow-rewind goes
ahead and keeps what it replaces in rewound-from-step-N/. A fresh run builds its own tokenizer, whatever a failed run
left in the folder. Values that cannot train, text fields that are not text, an output folder on a special file
system and a damaged trainer state are one-line errors (or, for an older checkpoint, a warning), never a traceback
and never a "final model" of nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rotarium.data.documents import embedded_documents
from rotarium.training.config import load_config
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import cli_args, ok, run_child

SHORT = {"train__max_steps": 6, "train__save_every": 2, "train__eval_every": 6}
DOCS = embedded_documents()[:40]


def _jsonl(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _data_files(folder: Path) -> None:
    (folder / "number.jsonl").write_text(_jsonl([{"text": d} for d in DOCS[:5]] + [{"text": 123}]
                                                + [{"text": d} for d in DOCS[5:]]))
    (folder / "array.json").write_text(json.dumps([{"text": d} for d in DOCS[:2]] + [{"text": ["a", "list"]}]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": list(range(10))}), folder / "numbers.parquet")


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> Path:
    """A 6-step run with checkpoints step-2 and step-4 and a final model at step 6 (the tests work on copies)."""
    run_dir = tmp_path_factory.mktemp("runs") / "finished"
    ok(run_child(["train", "--output-dir", str(run_dir), *cli_args(corpus, **SHORT)]))
    return run_dir


def _cases(folder: Path, corpus: Path) -> dict[str, list[str]]:
    def fresh(name: str, **overrides) -> list[str]:
        return ["train", "--output-dir", str(folder / name), *cli_args(corpus, **{**SHORT, **overrides})]

    def resume(name: str, *extra: str) -> list[str]:
        return ["train", "--output-dir", str(folder / name), "--resume", *extra]

    return {
        # item 4: going back on a finished run
        "lower --max-steps": resume("lower", "--max-steps", "3"),
        "--resume-from an older checkpoint": resume("older", "--resume-from", "step-2"),
        "--resume-from past --max-steps": resume("past", "--resume-from", "step-4", "--max-steps", "3",
                                                 "--allow-rewind"),
        "--allow-rewind without --resume": fresh("no-resume") + ["--allow-rewind"],
        "lower --max-steps with --allow-rewind": resume("rewound", "--max-steps", "3", "--allow-rewind"),
        # a damaged trainer_state.json of an older checkpoint: skipped with a warning, not a crash mid-run
        "damaged older trainer state": resume("damaged", "--max-steps", "8"),
        "--resume-from a damaged trainer state": resume("damaged-named", "--resume-from", "step-2",
                                                        "--max-steps", "8"),
        # item 6: a failed run leaves a tokenizer of 300 tokens; the next fresh run asks for 320
        "failed run": fresh("leftover", tokenizer__vocab_size=300, data__seq_len=100000),
        "fresh run after it": fresh("leftover", train__max_steps=2, train__save_every=100, train__eval_every=2),
        # item 7 and the settings checked before training
        "global batch 0": fresh("gb0", train__global_batch_size=0),
        "global batch negative": fresh("gbneg", train__global_batch_size=-8),
        "seq_len 1": fresh("seq1", data__seq_len=1),
        "num_threads 0": fresh("threads0", train__num_threads=0),
        "num_threads negative": fresh("threadsneg", train__num_threads=-2),
        "lr 0": fresh("lr0", optim__lr=0),
        "eval context length 1": fresh("ctx1", eval__context_lengths=[1, 64], eval__run_after=True),
        "eval sample tokens 0": fresh("sample0", eval__sample_tokens=0),
        # text fields that are not text
        "number in JSON Lines": fresh("number", data__source=str(folder / "number.jsonl")),
        "list in JSON": fresh("array", data__source=str(folder / "array.json")),
        "numbers in Parquet": fresh("parquet", data__source=str(folder / "numbers.parquet")),
        # an output folder on a special file system
        "output under /proc": ["train", "--output-dir", "/proc/rotarium-test-run", *cli_args(corpus, **SHORT)],
    }


EXPECTED = {
    "lower --max-steps": ["reached step 6", "--max-steps 3", "--init-from", "checkpoints/step-2", "--allow-rewind",
                          "rewound-from-step-6"],
    "--resume-from an older checkpoint": ["is finished", "step-2", "newest good checkpoint step-4", "--init-from",
                                          "checkpoints/step-2", "--allow-rewind"],
    "--resume-from past --max-steps": ["--resume-from step-4 is past --max-steps 3"],
    "--allow-rewind without --resume": ["--allow-rewind applies to --resume only"],
    "--resume-from a damaged trainer state": ["--resume-from step-2", "step-2/trainer_state.json is unreadable"],
    "global batch 0": ["train.global_batch_size", "at least 4", "got 0"],
    "global batch negative": ["train.global_batch_size", "at least 4", "got -8"],
    "seq_len 1": ["data.seq_len", "at least 2", "got 1"],
    "num_threads 0": ["train.num_threads", "at least 1", "got 0"],
    "num_threads negative": ["train.num_threads", "at least 1", "got -2"],
    "lr 0": ["optim.lr", "positive", "got 0.0"],
    "eval context length 1": ["eval.context_lengths", "at least 2", "[1, 64]"],
    "eval sample tokens 0": ["eval.sample_tokens", "at least 1", "got 0"],
    "number in JSON Lines": ["number.jsonl row 6", "int", "'123'"],
    "list in JSON": ["array.json row 3", "list"],
    "numbers in Parquet": ["numbers.parquet row 1", "int"],
    # as root the permission bits allow it and creating the folder fails; as another user they refuse it
    "output under /proc": ["--output-dir /proc/rotarium-test-run", ("cannot be created or written", "not writable")],
}


@pytest.fixture(scope="module")
def folder(finished, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("safety")
    _data_files(folder)
    for name in ("lower", "older", "past", "rewound", "damaged", "damaged-named"):
        shutil.copytree(finished, folder / name)
    (folder / "damaged" / "checkpoints" / "step-2" / "trainer_state.json").write_text("{")
    named = folder / "damaged-named" / "checkpoints" / "step-2"
    (named / "trainer_state.json").write_text("{")
    (named / "checksums.json").unlink()  # as an older rotarium wrote it: the state itself must be checked
    return folder


@pytest.fixture(scope="module")
def results(folder, corpus) -> dict[str, tuple[int, str] | None]:
    return run_cli_cases(_cases(folder, corpus), folder)


# These tests share the finished run and its cases (module fixtures, made again in each worker that runs one of
# them): one worker runs them all (xdist_group), so those are made once.
@pytest.mark.slow
@pytest.mark.xdist_group("train-safety")
@pytest.mark.parametrize("case", list(EXPECTED))
def test_one_line_error_naming_the_problem(case, results):
    message = error_line(results[case], "train")
    for text in EXPECTED[case]:
        alternatives = text if isinstance(text, tuple) else (text,)
        assert any(t in message for t in alternatives), f"{text!r} not in {message!r}"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.xdist_group("train-safety")
def test_a_refused_rewind_leaves_the_run_as_it_was(finished, folder, results):
    for name in ("lower", "older", "past"):  # run by the cases of the same names
        assert _files(folder / name) == _files(finished), name


@pytest.mark.slow
@pytest.mark.xdist_group("train-safety")
def test_allow_rewind_keeps_what_it_replaces(finished, folder, results):
    code, err = results["lower --max-steps with --allow-rewind"]
    assert code == 0, err[-3000:]
    run, aside = folder / "rewound", folder / "rewound" / "rewound-from-step-6"
    assert "--allow-rewind: the run goes back from step 6 to step 2" in err
    # the old final model, the checkpoint after step 2 and the metrics up to step 6, as they were
    assert _files(aside / "final") == _files(finished / "final")
    assert _files(aside / "checkpoints" / "step-4") == _files(finished / "checkpoints" / "step-4")
    assert (aside / "metrics.jsonl").read_bytes() == (finished / "metrics.jsonl").read_bytes()
    # the run itself now ends at step 3, from step-2
    assert json.loads((run / "final" / "training_args.json").read_text())["train.max_steps"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3


@pytest.mark.slow
@pytest.mark.xdist_group("train-safety")
def test_a_damaged_trainer_state_of_an_older_checkpoint_is_skipped_with_a_warning(results):
    code, err = results["damaged older trainer state"]
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "step-2/trainer_state.json is unreadable" in err and "skipped as not good" in err


@pytest.mark.slow
@pytest.mark.xdist_group("train-safety")
def test_a_fresh_run_builds_its_own_tokenizer(folder, results):
    assert error_line(results["failed run"], "train")  # it stopped after writing its tokenizer
    code, err = results["fresh run after it"]
    assert code == 0, err[-3000:]
    from transformers import AutoTokenizer

    run = folder / "leftover"
    assert json.loads((run / "final" / "config.json").read_text())["vocab_size"] == 320
    assert len(AutoTokenizer.from_pretrained(run / "tokenizer")) == 320
    assert json.loads((run / "training_args.json").read_text())["tokenizer.vocab_size"] == 320
    # the failed run staged its tokenizer apart and took it away as it stopped: nothing of it was left to replace
    assert "is replaced by a tokenizer built from this run's config" not in err


@pytest.mark.parametrize("overrides, key", [
    ({"train.global_batch_size": "0"}, "train.global_batch_size"),
    ({"data.seq_len": "1"}, "data.seq_len"),
    ({"train.eval_batches": "0"}, "train.eval_batches"),
    ({"optim.lr": "-1e-3"}, "optim.lr"),
    ({"optim.lr": ".nan"}, "optim.lr"),
    ({"optim.min_lr_ratio": "1.5"}, "optim.min_lr_ratio"),
    ({"optim.warmup_steps": "-1"}, "optim.warmup_steps"),
    ({"optim.grad_clip": "-1"}, "optim.grad_clip"),
    ({"optim.weight_decay": "-0.1"}, "optim.weight_decay"),
    ({"optim.eps": "0"}, "optim.eps"),
    ({"optim.betas": "[0.9, 1.5]"}, "optim.betas"),
    ({"train.seed": "-1"}, "train.seed"),
    ({"tokenizer.vocab_size": "100"}, "tokenizer.vocab_size"),
    ({"tokenizer.train_documents": "0"}, "tokenizer.train_documents"),
    ({"data.max_validation_tokens": "0"}, "data.max_validation_tokens"),
    ({"data.shuffle_buffer": "0"}, "data.shuffle_buffer"),
    ({"eval.context_lengths": "[]"}, "eval.context_lengths"),
    ({"eval.context_lengths": "[64, many]"}, "eval.context_lengths"),
    ({"model.intermediate_size": "0"}, "model.intermediate_size"),  # the model config read 0 as "the default"
])
def test_values_that_cannot_train_are_refused_by_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_the_smallest_values_that_train_are_accepted():
    config = load_config(None, {"data.seq_len": "2", "train.global_batch_size": "16", "train.num_threads": "1",
                                "optim.warmup_steps": "0", "optim.grad_clip": "0", "tokenizer.vocab_size": "259",
                                "eval.context_lengths": "[2]"})
    assert config.data.seq_len == 2 and config.train.global_batch_size == 16
    # a named tokenizer has its own size: the trained BPE's minimum does not apply
    assert load_config(None, {"tokenizer.name": "gpt2", "tokenizer.vocab_size": "100"}).tokenizer.vocab_size == 100
