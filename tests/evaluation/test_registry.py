"""The evaluations of ``rotarium eval`` share one interface (rotarium.evaluation.tasks.EvalTask) and one list
(rotarium.evaluation.registry.EVAL_TASKS), which the command's flags, refusals and help are read from: an evaluation
registered there runs through the command, end to end, with nothing else added."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rotarium.cli import build_parser, main
from rotarium.evaluation import registry
from rotarium.evaluation.outputs import check_result_paths, result_path
from rotarium.evaluation.registry import EVAL_TASKS, asked_for, default_task
from rotarium.evaluation.tasks import EvalRun, EvalTask, Flag, training_length
from rotarium.utils.files import make_folder, write_json_atomic, write_text_atomic
from tests.cli_cases import error_line

# the flags every evaluation reads; the rest come from the registry
COMMON = {"--model", "--context-lengths", "--batch-size", "--output-dir", "--device", "--dtype", "--rope-scaling",
          "--help"}
TEXT = "the grass is green and the sky is blue. " * 40


def eval_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["eval"]


def flags_of(task: EvalTask) -> list[Flag]:
    return [flag for flag in (task.selector, *task.flags) if flag is not None]


def test_every_registered_evaluation_has_the_interface():
    assert list(EVAL_TASKS) == ["perplexity", "ruler", "lm-eval"]
    assert default_task() is EVAL_TASKS["perplexity"]
    files, flags = [], []
    for name, task in EVAL_TASKS.items():
        assert isinstance(task, EvalTask) and task.name == name
        assert task.result_files and task.lengths_help
        files += task.result_files
        flags += [flag.name for flag in flags_of(task)]
        for train_length in (256, None):
            lengths = task.default_lengths(train_length)
            assert lengths is None or (lengths and all(isinstance(L, int) and L >= 2 for L in lengths)), name
    assert len(set(files)) == len(files)  # no two evaluations write the same file
    assert len(set(flags)) == len(flags) and not set(flags) & COMMON  # each flag has one owner
    assert EVAL_TASKS["perplexity"].default_lengths(256) == [128, 256, 512, 1024]
    assert EVAL_TASKS["ruler"].default_lengths(256) == [256, 512, 1024, 2048]
    assert EVAL_TASKS["lm-eval"].default_lengths(256) is None


def test_the_eval_command_s_flags_and_choices_come_from_the_registry():
    parser = eval_parser()
    options = {option for action in parser._actions for option in action.option_strings if option.startswith("--")}
    owned = {flag.name for task in EVAL_TASKS.values() for flag in flags_of(task)}
    assert options == COMMON | owned
    args = parser.parse_args(["--model", "m"])
    assert not any(flag.given(args) for task in EVAL_TASKS.values() for flag in flags_of(task))
    assert asked_for(args) == [EVAL_TASKS["perplexity"]]
    assert asked_for(parser.parse_args(["--model", "m", "--tasks", "piqa", "--ruler", "vt"])) == [
        EVAL_TASKS["ruler"], EVAL_TASKS["lm-eval"]]
    helps = {option: action.help for action in parser._actions for option in action.option_strings}
    assert all(name in helps["--ruler"] for name in EVAL_TASKS["ruler"].choices())
    assert all(task.lengths_help in helps["--context-lengths"] for task in EVAL_TASKS.values())


class Toy(EvalTask):
    """A RULER-style evaluation as a user would add it: the mean loss of a fixed text at each length."""

    name = "toy"
    selector = Flag("--toy", {"default": None, "metavar": "TASKS", "help": "the toy task"})
    flags = (Flag("--toy-repeats", {"type": int, "default": None, "help": "--toy: copies of the text"}),)
    result_files = ("toy.json", "toy.md")
    lengths_help = "a quarter of and the training length"

    def default_lengths(self, train_length: int | None) -> list[int]:
        return [(train_length or 64) // 4, train_length or 64]

    def prepare(self, run: EvalRun) -> int:
        if run.args.toy != "text":
            raise ValueError(f"--toy {run.args.toy!r}: choose from text")
        check_result_paths(run.output, self.result_files, run.rope_scaling, run.what)
        return 1 if run.args.toy_repeats is None else run.args.toy_repeats

    def evaluate(self, prepared: int, model, tokenizer, run: EvalRun) -> dict[str, Any]:
        ids = torch.tensor([tokenizer(TEXT * prepared)["input_ids"]])
        rows = []
        for length in run.lengths(self, training_length(model)):
            with torch.no_grad():
                logits = model(input_ids=ids[:, :length]).logits[0, :-1]
            rows.append({"context_length": length,
                         "loss": float(torch.nn.functional.cross_entropy(logits, ids[0, 1:length]))})
        return {"model": run.model_name, "rope_scaling": run.rope_scaling, "rows": rows}

    def summary(self, record: dict[str, Any], run: EvalRun) -> str:
        return "\n".join(f"| {row['context_length']} | {row['loss']:.4f} |" for row in record["rows"])

    def save(self, record: dict[str, Any], run: EvalRun) -> tuple[Path, ...]:
        folder = make_folder(run.output, "the evaluation folder")
        table, markdown = (result_path(folder, name, run.rope_scaling) for name in self.result_files)
        write_json_atomic(table, record)
        write_text_atomic(markdown, f"# {run.title('toy')}\n\n{self.summary(record, run)}\n")
        return table, markdown


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.EVAL_TASKS, "toy", Toy())


def test_a_registered_evaluation_runs_through_the_command(toy, tiny_checkpoint, tiny_model, tokenizer, tmp_path,
                                                           capsys):
    out = tmp_path / "eval"
    code = main(["eval", "--model", str(tiny_checkpoint), "--toy", "text", "--toy-repeats", "2", "--device", "cpu",
                 "--output-dir", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    record = json.loads((out / "toy.json").read_text())
    assert [row["context_length"] for row in record["rows"]] == [64, 256]  # its own lengths, of the training length
    ids = torch.tensor([tokenizer(TEXT * 2)["input_ids"]])
    with torch.no_grad():
        logits = tiny_model(input_ids=ids[:, :64]).logits[0, :-1]
    torch.testing.assert_close(torch.tensor(record["rows"][0]["loss"]),
                               torch.nn.functional.cross_entropy(logits, ids[0, 1:64]))
    assert f"| 64 | {record['rows'][0]['loss']:.4f} |" in printed.out
    assert f"wrote {out / 'toy.json'}, {out / 'toy.md'}" in printed.out
    assert (out / "toy.md").read_text().startswith("# model: toy")
    assert sorted(p.name for p in out.iterdir()) == ["toy.json", "toy.md"]  # perplexity, replaced, wrote nothing


def run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as error:  # argparse's own refusals (a flag it does not know)
        code = error.code
    return code, capsys.readouterr().err


def test_a_registered_evaluation_s_flags_are_refused_where_it_does_not_run(toy, tiny_checkpoint, tmp_path, capsys):
    model = ["eval", "--model", str(tiny_checkpoint), "--device", "cpu", "--output-dir", str(tmp_path / "out")]
    message = error_line(run([*model, "--toy-repeats", "2", "--ruler", "vt"], capsys), "eval")
    assert "--toy-repeats applies to --toy only, which this command does not run; add --toy TASKS" in message
    message = error_line(run([*model, "--toy", "text", "--data", "embedded"], capsys), "eval")
    assert "--data applies to perplexity only, which --ruler, --tasks and --toy replace" in message
    assert "--toy 'other': choose from text" in error_line(run([*model, "--toy", "other"], capsys), "eval")
    assert not (tmp_path / "out").exists()


def _spied(monkeypatch, calls: list[str]) -> None:
    """Records each registered evaluation's ``evaluate`` as it runs."""
    for name, task in EVAL_TASKS.items():
        def evaluate(*args, _name=name, _run=task.evaluate, **kwargs):
            calls.append(_name)
            return _run(*args, **kwargs)

        monkeypatch.setattr(task, "evaluate", evaluate)


def _recorded(monkeypatch, module: Any, name: str, calls: list[tuple], result: Any = None) -> None:
    """``module.name`` recording its arguments, then run (or, given ``result``, answering ``result(*args)``)."""
    run = getattr(module, name)

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return run(*args, **kwargs) if result is None else result(*args)

    monkeypatch.setattr(module, name, recording)


def test_rotarium_train_evaluates_through_the_perplexity_task(tiny_model, tokenizer, tmp_path, monkeypatch, capsys):
    """The evaluation `rotarium train` runs with the final weights is the registry's perplexity task, with the run's
    lengths (eval.context_lengths, whose default is the task's), held-out documents and batch size:
    perplexity_by_context scores them as before, and its rows are the file written, its plot titled after the run."""
    from types import SimpleNamespace

    from rotarium.data.documents import embedded_documents
    from rotarium.evaluation import perplexity
    from rotarium.training.cli import evaluate_and_sample
    from rotarium.training.config import EvalSection, load_config

    assert EvalSection().context_lengths == list(perplexity.DEFAULT_LENGTHS) == EVAL_TASKS[
        "perplexity"].default_lengths(None)
    config = load_config(None, {"eval.context_lengths": [16, 48], "data.max_validation_tokens": 96,
                                "train.batch_size": 3, "data.seq_len": 32, "eval.sample_tokens": 2})
    documents = embedded_documents()[60:64]
    trainer = SimpleNamespace(config=config, model=tiny_model, tokenizer=tokenizer, run_dir=tmp_path / "run",
                              accelerator=SimpleNamespace(unwrap_model=lambda model: model),
                              data=SimpleNamespace(held_out=documents))
    calls, scored, titles = [], [], []
    _spied(monkeypatch, calls)
    _recorded(monkeypatch, perplexity, "perplexity_by_context", scored)
    _recorded(monkeypatch, perplexity, "save_results", titles)
    evaluate_and_sample(trainer, tmp_path / "final")
    assert calls == ["perplexity"]
    (model, tokens, lengths), options = scored[0]
    assert model is tiny_model and lengths == [16, 48]
    assert torch.equal(tokens, perplexity.evaluation_tokens(documents, tokenizer, 96))
    assert options == {"max_tokens": 96, "batch_size": 3, "progress": True}
    rows = json.loads((tmp_path / "final" / "eval" / "perplexity.json").read_text())
    assert [row["context_length"] for row in rows] == [16, 48]
    assert titles[0][1] == {"title": "run: validation perplexity", "train_length": 32, "rope_scaling": None}
    out = capsys.readouterr().out
    assert "| 48 (beyond training) |" in out and "sample: " in out


def test_rotarium_extrapolation_scores_through_the_evaluation_tasks(tiny_model, tokenizer, monkeypatch):
    """`rotarium extrapolation` scores each run with the registry's perplexity and RULER tasks, one length at a
    time, with the arguments it gave perplexity_by_context and evaluate_ruler before; their rows are its rows."""
    from rotarium.evaluation import perplexity, ruler
    from rotarium.synthetic.text import RULER_WORDS, Scoring, score_model

    scoring = Scoring(multiples=(1, 2), eval_tokens=768, ruler_tasks=("niah_single_1", "vt"), ruler_multiples=(2, 4),
                      ruler_samples=3, ruler_fits=(("niah_single_1", 2), ("vt", 4)))
    tokens = torch.arange(1000)
    calls, scored, answered = [], [], []
    _spied(monkeypatch, calls)
    _recorded(monkeypatch, perplexity, "perplexity_by_context", scored,
              lambda model, tokens, lengths: [{"context_length": length} for length in lengths])
    _recorded(monkeypatch, ruler, "evaluate_ruler", answered,
              lambda model, tokenizer, tasks, lengths: {"rows": [{"task": task, "context_length": length}
                                                                 for task in tasks for length in lengths]})
    perplexity_rows, ruler_rows = score_model(tiny_model, tokenizer, tokens, 192, 2, "nope", scoring)
    assert calls == ["perplexity", "perplexity", "ruler", "ruler"]
    assert [args[1:] for args, _ in scored] == [(tokens, [192]), (tokens, [384])]
    assert all(args[0] is tiny_model and options == {"max_tokens": 768, "batch_size": 2, "progress": False}
               for args, options in scored)
    assert perplexity_rows == [{"rope_scaling": "", "context_length": length} for length in (192, 384)]
    assert [args[1:] for args, _ in answered] == [(tokenizer, ["niah_single_1"], [384]), (tokenizer, ["vt"], [768])]
    for args, options in answered:
        assert args[0] is tiny_model and options.pop("words").name == ruler.load_words(RULER_WORDS).name
        assert options == {"num_samples": 3, "seed": ruler.SEED, "batch_size": 2, "progress": False,
                           "texts": ruler.RulerTexts()}
    assert ruler_rows == [{"rope_scaling": "", "task": "niah_single_1", "context_length": 384},
                          {"rope_scaling": "", "task": "vt", "context_length": 768}]
