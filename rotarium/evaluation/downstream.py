"""Downstream tasks through EleutherAI's lm-evaluation-harness (``lm-eval``, the ``eval`` extra): its
``simple_evaluate`` on a loaded rotarium model, wrapped in its ``HFLM``.

``papers`` is the zero-shot list of the GLA, DeltaNet / Gated DeltaNet and FoX tables (the command in fla's README
plus SIQA, which the DeltaNet tables add), reported as they report it: word perplexity for WikiText, perplexity and
accuracy for LAMBADA, ``acc_norm`` for HellaSwag, ARC-Challenge and OpenBookQA, ``acc`` for the rest, and the mean of
the accuracies.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rotarium.evaluation.outputs import check_result_paths, result_path
from rotarium.evaluation.tasks import EvalRun, EvalTask, Flag
from rotarium.utils.files import make_folder, write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PAPERS = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
          "social_iqa", "boolq", "openbookqa", "sciq", "copa")
ACC_NORM_TASKS = frozenset({"hellaswag", "arc_challenge", "openbookqa"})
# what the papers' tables show for a task (the rest show their one accuracy)
PAPER_METRICS = {"wikitext": ("word_perplexity",), "lambada_openai": ("perplexity", "acc")}
PERCENT = frozenset({"acc", "acc_norm"})
RESULT_FILES = ("downstream.json", "downstream.md")


def require_lm_eval() -> None:
    """Raises ``ValueError`` in one line when lm-eval is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError("--tasks runs lm-evaluation-harness, which is not installed: pip install 'rotarium[eval]' "
                         "(or pip install lm-eval)") from None


def check_settings(batch_size: int, num_fewshot: int | None) -> None:
    """Raises ``ValueError`` naming the flag when ``--batch-size`` or ``--num-fewshot`` cannot work."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {num_fewshot}")


def expand_tasks(spec: str) -> list[str]:
    """``--tasks``' value: lm-eval task or group names separated by commas; ``papers`` stands for :data:`PAPERS`."""
    names: list[str] = []
    for name in (n.strip() for n in spec.split(",")):
        if name:
            names += PAPERS if name == "papers" else [name]
    if not names:
        raise ValueError(f"--tasks {spec!r} names no task; give lm-eval task names separated by commas, or papers")
    return list(dict.fromkeys(names))


def task_manager(names: list[str], include_path: str | None = None, metadata: dict[str, Any] | None = None):
    """lm-eval's task index for ``names``, which must all be in it (``ValueError`` naming the others). With
    ``include_path``, a folder of task YAML files, the folder alone is indexed when it holds every name: lm-eval's
    own thousands of tasks take seconds to index."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ValueError(f"--include-path {include_path}: no such folder (it takes a folder of lm-eval task "
                             "YAML files)")
        local = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=include_path, metadata=metadata)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = f" or in --include-path {include_path}" if include_path else " (a local task: --include-path DIR)"
        raise ValueError(f"--tasks: {', '.join(unknown)} is not a task or group of lm-eval {_version()}{where}; "
                         "`lm-eval ls tasks` lists them")
    return manager


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def evaluate_tasks(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, names: list[str], manager, *,
                   batch_size: int = 8, num_fewshot: int | None = None) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``names`` on ``model`` (as it is: its device and dtype), through ``HFLM``,
    whose context length is the config's ``max_position_embeddings`` (the training length, as in the papers)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    check_settings(batch_size, num_fewshot)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    try:
        results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, task_manager=manager,
                                  log_samples=False)
    except ConnectionError as error:
        raise ValueError(f"--tasks: a data set could not be fetched ({error}); run once with the Hugging Face Hub "
                         "reachable to cache it, or use a local task (--include-path)") from None
    return results


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def task_rows(results: dict[str, Any], names: list[str]) -> tuple[list[dict[str, Any]], float | None]:
    """A row per task or group of lm-eval's ``results`` (``task``, ``metrics``: name -> value, ``stderr``,
    ``accuracy``: the metric the papers average, or None) and the mean of the accuracies of the tasks and groups
    asked for (``names``; a group's subtasks count through the group). The papers' tasks keep
    the papers' metrics; other tasks keep every metric lm-eval reports (a filter other than ``none`` named after
    the metric, as ``exact_match (strict-match)``)."""
    rows = []
    for task, entry in results["results"].items():
        metrics, stderr = {}, {}
        for key, value in entry.items():
            if "," not in key:
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric} ({filter_name})"
            if metric.endswith("_stderr"):
                stderr[name.replace("_stderr", "", 1)] = _number(value)
            elif (number := _number(value)) is not None or value is None:
                metrics[name] = number
        accuracy = "acc_norm" if task in ACC_NORM_TASKS else "acc"
        if task in PAPER_METRICS:
            shown = PAPER_METRICS[task]
        elif task in PAPERS:
            shown = (accuracy,)
        else:
            shown = tuple(metrics)
        rows.append({"task": task, "metrics": {m: metrics.get(m) for m in shown},
                     "stderr": {m: stderr.get(m) for m in shown if m in stderr},
                     "accuracy": accuracy if metrics.get(accuracy) is not None else None})
    accuracies = [row["metrics"][row["accuracy"]] for row in rows
                  if row["task"] in names and row["accuracy"] in row["metrics"]]
    return rows, (sum(accuracies) / len(accuracies) if accuracies else None)


def format_tasks_table(rows: list[dict[str, Any]], average: float | None) -> str:
    """Markdown: a line per task and metric, accuracies in percent (as the papers print them)."""
    lines = ["| task | metric | value |", "|---|---|---:|"]
    for row in rows:
        for metric, value in row["metrics"].items():
            shown = "-" if value is None else f"{100 * value:.2f}" if metric in PERCENT else f"{value:.4g}"
            lines.append(f"| {row['task']} | {metric}{' (%)' if metric in PERCENT else ''} | {shown} |")
    if average is not None:
        lines.append(f"| **average** | accuracy (%) | {100 * average:.2f} |")
    return "\n".join(lines)


def save_tasks(report: dict[str, Any], folder: str | os.PathLike, *, title: str) -> tuple[Path, Path]:
    """``folder/downstream.json`` (``report``) and ``folder/downstream.md`` (its table); a report with a
    ``rope_scaling`` goes to files named after it (:func:`rotarium.evaluation.outputs.result_path`), beside the
    unscaled ones."""
    folder = make_folder(folder, "the evaluation folder")
    table, markdown = (result_path(folder, name, report.get("rope_scaling")) for name in RESULT_FILES)
    write_json_atomic(table, report)
    write_text_atomic(markdown, f"# {title}\n\n{format_tasks_table(report['rows'], report['average'])}\n")
    return table, markdown


def lm_eval_record(results: dict[str, Any]) -> dict[str, Any]:
    """What of lm-eval's answer goes into the JSON: its scores, shots, task versions and its own version, with
    values that are not numbers or strings written as text (a non-finite number is written as null, as
    :func:`rotarium.utils.files.write_json_atomic` writes every one)."""
    keep = {key: results.get(key) for key in ("results", "groups", "n-shot", "versions", "n-samples",
                                              "lm_eval_version", "max_length")}
    return _jsonable(keep)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class _Asked:
    tasks: list[str]
    manager: Any  # lm-eval's TaskManager


class LmEvalTasks(EvalTask):
    """``rotarium eval --tasks TASKS``: a set of lm-eval's tasks and groups, in one report."""

    name = "lm-eval"
    selector = Flag("--tasks", {"default": None, "metavar": "TASKS", "help": (
        "lm-evaluation-harness tasks instead of perplexity (pip install 'rotarium[eval]'): comma-separated task or "
        "group names, or papers (the GLA / DeltaNet / FoX tables' list); writes downstream.json and downstream.md")})
    flags = (
        Flag("--num-fewshot", {"type": int, "default": None,
                               "help": "--tasks: examples in each prompt (default: each task's own, 0 for papers)"}),
        Flag("--include-path", {"default": None, "help": (
            "--tasks: a folder of lm-eval task YAML files (local tasks) to add to lm-eval's")}),
    )
    result_files = RESULT_FILES
    lengths_help = "each task's own (lm-eval's RULER reads --context-lengths as its lengths)"

    def default_lengths(self, train_length: int | None) -> None:
        return None

    def prepare(self, run: EvalRun) -> _Asked:
        args = run.args
        require_lm_eval()
        check_settings(args.batch_size, args.num_fewshot)
        names = expand_tasks(args.tasks)
        check_result_paths(run.output, RESULT_FILES, run.rope_scaling, run.what)
        # lm-eval's own RULER tasks read the tokenizer and lengths from here
        lengths = run.lengths(self, None)
        metadata = {"pretrained": args.model, **({"max_seq_lengths": lengths} if lengths else {})}
        return _Asked(names, task_manager(names, args.include_path, metadata))

    def evaluate(self, prepared: _Asked, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 run: EvalRun) -> dict[str, Any]:
        """The report ``downstream.json`` holds: the tasks' rows and mean accuracy, and lm-eval's own record."""
        num_fewshot = run.args.num_fewshot
        results = evaluate_tasks(model, tokenizer, prepared.tasks, prepared.manager, batch_size=run.args.batch_size,
                                 num_fewshot=num_fewshot)
        rows, average = task_rows(results, prepared.tasks)
        return {"model": run.model_name, "tasks": prepared.tasks, "num_fewshot": num_fewshot,
                "rope_scaling": run.rope_scaling, "rows": rows, "average": average,
                "lm_eval": lm_eval_record(results)}

    def summary(self, record: dict[str, Any], run: EvalRun) -> str:
        return format_tasks_table(record["rows"], record["average"])

    def save(self, record: dict[str, Any], run: EvalRun) -> tuple[Path, ...]:
        return save_tasks(record, run.output, title=run.title("downstream tasks (lm-eval)"))
