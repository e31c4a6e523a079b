"""Downstream tasks through EleutherAI's lm-evaluation-harness (``lm-eval``, the ``eval`` extra): its
``simple_evaluate`` on a loaded rotarium model, wrapped in its ``HFLM``.

``--tasks`` takes lm-eval's task and group names and the papers' own sets (:data:`TASK_SETS`): ``selective-rope``
(the Selective RoPE reference's ten tasks, zero-shot), ``fla`` (the zero-shot list of the GLA, DeltaNet / Gated
DeltaNet and FoX tables; ``papers`` is its former name) and ``rove`` (few-shot in-context tasks for the RoVE paper).
A set fixes each task's examples per prompt and is reported as its paper reports it: word perplexity for WikiText,
perplexity and accuracy for LAMBADA, ``acc_norm`` for HellaSwag, ARC-Challenge and OpenBookQA, ``contains`` for the
recall tasks SWDE, SQuAD-completion and FDA, ``acc`` for the rest, and its own mean of the accuracies (perplexities
listed, not averaged).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rotarium.evaluation.outputs import check_result_paths, result_path
from rotarium.evaluation.tasks import EvalRun, EvalTask, Flag, listing
from rotarium.utils.files import make_folder, write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSet:
    """A paper's lm-eval tasks, each with the examples its prompts hold (``shots``, 0: zero-shot), in the paper's
    order; ``source`` says whose table it is."""
    name: str
    source: str
    shots: dict[str, int]

    @property
    def tasks(self) -> list[str]:
        return list(self.shots)


PAPERS = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
          "social_iqa", "boolq", "openbookqa", "sciq", "copa")
# LAMBADA is lm-eval's lambada_openai (OpenAI's version of its test set), the one these papers' tables report
SELECTIVE_ROPE = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
                  "swde", "squad_completion", "fda")
# the RoVE paper's list and shots are not recoverable: multiple-choice tasks with a training split to draw examples
# from whose five-shot prompts fit the paper's 1024-token training length (docs/evaluation.md says why)
ROVE = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbookqa")
ROVE_SHOTS = 5
TASK_SETS = {task_set.name: task_set for task_set in (
    TaskSet("selective-rope", "the Selective RoPE reference's evaluation (zero-shot)",
            dict.fromkeys(SELECTIVE_ROPE, 0)),
    TaskSet("fla", "the GLA, DeltaNet / Gated DeltaNet and FoX tables (fla's README command plus SIQA, zero-shot)",
            dict.fromkeys(PAPERS, 0)),
    TaskSet("rove", f"the RoVE paper's in-context learning ({ROVE_SHOTS}-shot; tasks chosen, the paper's list is not "
            "given)", dict.fromkeys(ROVE, ROVE_SHOTS)),
)}
SET_ALIASES = {"papers": "fla"}
# the metric a known task is averaged by (the rest: acc); None: a perplexity task, listed but not averaged
ACCURACY = {"wikitext": None, "hellaswag": "acc_norm", "arc_challenge": "acc_norm", "openbookqa": "acc_norm",
            "swde": "contains", "squad_completion": "contains", "fda": "contains"}
# what the papers' tables show for a task (the rest of the sets' tasks show their one accuracy)
PAPER_METRICS = {"wikitext": ("word_perplexity",), "lambada_openai": ("perplexity", "acc")}
PERCENT = frozenset({"acc", "acc_norm", "contains"})
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


def _known_tasks() -> frozenset[str]:
    return frozenset(task for task_set in TASK_SETS.values() for task in task_set.shots)


@dataclass(frozen=True)
class Selection:
    """What ``--tasks`` asks for: lm-eval's task and group names in order, the examples per prompt of each (a set's
    count; ``--num-fewshot`` for a name given one by one, None: the task's own) and the sets named."""
    tasks: list[str]
    shots: dict[str, int | None]
    sets: list[TaskSet]

    @property
    def loose(self) -> list[str]:
        """The tasks named one by one, in no set asked for."""
        in_sets = {task for task_set in self.sets for task in task_set.shots}
        return [task for task in self.tasks if task not in in_sets]


def _shots(count: int | None) -> str:
    return "its own examples per prompt" if count is None else f"{count}-shot"


def select_tasks(spec: str, num_fewshot: int | None = None) -> Selection:
    """``--tasks``' value: lm-eval task or group names and set names (:data:`TASK_SETS`, ``papers`` for ``fla``)
    separated by commas. Raises ``ValueError`` when it names nothing, when a task is asked with two shot counts, or
    when ``--num-fewshot`` is given for sets alone (they fix their own)."""
    shots: dict[str, int | None] = {}
    asked_by: dict[str, str] = {}
    sets: list[TaskSet] = []
    for name in (n.strip() for n in spec.split(",")):
        if not name:
            continue
        task_set = TASK_SETS.get(SET_ALIASES.get(name, name))
        if task_set is not None and task_set not in sets:
            sets.append(task_set)
        for task, count in (task_set.shots if task_set is not None else {name: num_fewshot}).items():
            if shots.get(task) is not None and count is not None and shots[task] != count:
                raise ValueError(f"--tasks: {task} is asked {_shots(shots[task])} by {asked_by[task]} and "
                                 f"{_shots(count)} by {name}; evaluate them in separate commands")
            if shots.get(task) is None:
                shots[task], asked_by[task] = count, name
    if not shots:
        raise ValueError(f"--tasks {spec!r} names no task; give lm-eval task names separated by commas, or a set: "
                         f"{listing(list(TASK_SETS))}")
    selection = Selection(list(shots), shots, sets)
    if num_fewshot is not None and not selection.loose:
        raise ValueError(f"--num-fewshot: {listing([s.name for s in sets])} fix{'es' if len(sets) == 1 else ''} "
                         "each task's examples per prompt (their papers'); it applies to tasks named one by one")
    return selection


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


def evaluate_tasks(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, shots: dict[str, int | None],
                   manager, *, batch_size: int = 8) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of the tasks ``shots`` names on ``model`` (as it is: its device and dtype),
    through ``HFLM``, whose context length is the config's ``max_position_embeddings`` (the training length, as in
    the papers). ``simple_evaluate`` takes one count of examples per prompt, so each count runs as one call (None:
    each task's own) and their answers are merged into one."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    groups: dict[int | None, list[str]] = {}
    for task, count in shots.items():
        check_settings(batch_size, count)
        groups.setdefault(count, []).append(task)
    from rotarium.data.batches import document_start

    class DocumentLM(HFLM):
        """``HFLM`` whose rolling log-likelihood scores a text's own tokens after its prefix token. lm-eval encodes
        the text with the tokenizer's template there, so a template that starts a text with a bos (Llama's) put it
        after the prefix: the model read ``[bos, bos, text]`` and the second bos was scored as the text's first
        token. Its other requests keep the template (a context starts with its bos, as a training document)."""

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            kept, self.add_bos_token = self.add_bos_token, False  # what its tok_encode reads for the template
            try:
                return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
            finally:
                self.add_bos_token = kept

    # lm-eval scores a text from nothing (a rolling log-likelihood, an empty context) after its prefix token, the
    # tokenizer's bos by default, which training may never show: the token a document starts after in training
    lm = DocumentLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                    prefix_token_id=document_start(tokenizer))
    merged: dict[str, Any] = {}
    for count, names in groups.items():
        try:
            results = simple_evaluate(model=lm, tasks=names, num_fewshot=count, task_manager=manager,
                                      log_samples=False)
        except ConnectionError as error:
            raise ValueError(f"--tasks: a data set could not be fetched ({error}); run once with the Hugging Face "
                             "Hub reachable to cache it, or use a local task (--include-path)") from None
        for key, value in results.items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
    for task, count in shots.items():
        ran = merged.get("n-shot", {}).get(task)
        if count is not None and ran is not None and ran != count:
            logger.warning("lm-eval ran %s %d-shot where %d-shot was asked (its task config fixes its examples per "
                           "prompt); the table shows the count it ran", task, ran, count)
    return merged


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def task_rows(results: dict[str, Any], names: list[str]) -> tuple[list[dict[str, Any]], float | None]:
    """A row per task or group of lm-eval's ``results`` (``task``, ``shots``: the examples per prompt lm-eval ran it
    with, ``metrics``: name -> value, ``stderr``, ``accuracy``: the metric the papers average, or None) and the mean
    of the accuracies of the tasks and groups asked for (``names``; a group's subtasks count through the group).
    The sets' tasks keep the papers' metrics; other tasks keep every metric lm-eval reports (a filter other than
    ``none`` named after the metric, as ``exact_match (strict-match)``)."""
    rows = []
    known = _known_tasks()
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
        accuracy = ACCURACY.get(task, "acc")
        if task in PAPER_METRICS:
            shown = PAPER_METRICS[task]
        elif task in known:
            shown = (accuracy,) if accuracy is not None else tuple(metrics)
        else:
            shown = tuple(metrics)
        rows.append({"task": task, "shots": results.get("n-shot", {}).get(task),
                     "metrics": {m: metrics.get(m) for m in shown},
                     "stderr": {m: stderr.get(m) for m in shown if m in stderr},
                     "accuracy": accuracy if accuracy is not None and metrics.get(accuracy) is not None else None})
    return rows, mean_accuracy(rows, names)


def mean_accuracy(rows: list[dict[str, Any]], names: list[str]) -> float | None:
    """The mean of the rows' accuracies over the tasks ``names`` (perplexity tasks have none); None without one."""
    accuracies = [row["metrics"][row["accuracy"]] for row in rows
                  if row["task"] in names and row["accuracy"] is not None]
    return sum(accuracies) / len(accuracies) if accuracies else None


def set_reports(rows: list[dict[str, Any]], sets: list[TaskSet]) -> list[dict[str, Any]]:
    """Each set's own summary, as its paper reports it: its tasks and shots, the tasks its average counts (by their
    accuracy) and those it lists only (perplexity), and that average."""
    return [{"name": task_set.name, "source": task_set.source, "tasks": task_set.tasks, "shots": task_set.shots,
             "averaged": [t for t in task_set.tasks if ACCURACY.get(t, "acc") is not None],
             "listed": [t for t in task_set.tasks if ACCURACY.get(t, "acc") is None],
             "average": mean_accuracy(rows, task_set.tasks)} for task_set in sets]


def averages(report: dict[str, Any]) -> list[tuple[str, float | None]]:
    """The averages a table ends with: each set's, then the mean over every task asked for, unless that is one
    set's alone."""
    lines = [(f"{entry['name']} average", entry["average"]) for entry in report.get("sets", [])]
    sets = report.get("sets", [])
    if not (len(sets) == 1 and set(sets[0]["tasks"]) == set(report["tasks"])):
        lines.append(("average", report["average"]))
    return lines


def format_tasks_table(rows: list[dict[str, Any]], means: list[tuple[str, float | None]]) -> str:
    """Markdown: a line per task and metric with the examples per prompt it ran with, accuracies in percent (as the
    papers print them), then ``means`` (label, mean accuracy: :func:`averages`)."""
    lines = ["| task | shots | metric | value |", "|---|---:|---|---:|"]
    for row in rows:
        shots = "-" if row.get("shots") is None else row["shots"]
        for metric, value in row["metrics"].items():
            shown = "-" if value is None else f"{100 * value:.2f}" if metric in PERCENT else f"{value:.4g}"
            lines.append(f"| {row['task']} | {shots} | {metric}{' (%)' if metric in PERCENT else ''} | {shown} |")
    for label, value in means:
        if value is not None:
            lines.append(f"| **{label}** | | accuracy (%) | {100 * value:.2f} |")
    return "\n".join(lines)


def save_tasks(report: dict[str, Any], folder: str | os.PathLike, *, title: str) -> tuple[Path, Path]:
    """``folder/downstream.json`` (``report``) and ``folder/downstream.md`` (its table); a report with a
    ``rope_scaling`` goes to files named after it (:func:`rotarium.evaluation.outputs.result_path`), beside the
    unscaled ones."""
    folder = make_folder(folder, "the evaluation folder")
    table, markdown = (result_path(folder, name, report.get("rope_scaling")) for name in RESULT_FILES)
    write_json_atomic(table, report)
    write_text_atomic(markdown, f"# {title}\n\n{format_tasks_table(report['rows'], averages(report))}\n")
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
    selection: Selection
    manager: Any  # lm-eval's TaskManager


class LmEvalTasks(EvalTask):
    """``rotarium eval --tasks TASKS``: lm-eval's tasks and groups and the papers' sets, in one report."""

    name = "lm-eval"
    selector = Flag("--tasks", {"default": None, "metavar": "TASKS", "help": (
        "lm-evaluation-harness tasks instead of perplexity (pip install 'rotarium[eval]'): comma-separated task or "
        "group names, or a paper's set, each with its own shots and average: selective-rope (the Selective RoPE "
        "reference's ten tasks, zero-shot), fla (the GLA / DeltaNet / FoX tables' list, zero-shot; papers is its "
        f"alias) or rove ({ROVE_SHOTS}-shot in-context tasks for the RoVE paper); writes downstream.json and "
        "downstream.md")})
    flags = (
        Flag("--num-fewshot", {"type": int, "default": None, "help": (
            "--tasks: examples in each prompt of the tasks named one by one (default: each task's own); a set "
            "fixes its own")}),
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
        selection = select_tasks(args.tasks, args.num_fewshot)
        check_result_paths(run.output, RESULT_FILES, run.rope_scaling, run.what)
        # lm-eval's own RULER tasks read the tokenizer and lengths from here
        lengths = run.lengths(self, None)
        metadata = {"pretrained": args.model, **({"max_seq_lengths": lengths} if lengths else {})}
        return _Asked(selection, task_manager(selection.tasks, args.include_path, metadata))

    def evaluate(self, prepared: _Asked, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 run: EvalRun) -> dict[str, Any]:
        """The report ``downstream.json`` holds: the tasks' rows, each set's summary and average, the mean accuracy
        over every task asked for, and lm-eval's own record."""
        selection = prepared.selection
        results = evaluate_tasks(model, tokenizer, selection.shots, prepared.manager, batch_size=run.args.batch_size)
        rows, average = task_rows(results, selection.tasks)
        return {"model": run.model_name, "tasks": selection.tasks, "num_fewshot": run.args.num_fewshot,
                "shots": selection.shots, "rope_scaling": run.rope_scaling, "rows": rows,
                "sets": set_reports(rows, selection.sets), "average": average, "lm_eval": lm_eval_record(results)}

    def summary(self, record: dict[str, Any], run: EvalRun) -> str:
        return format_tasks_table(record["rows"], averages(record))

    def save(self, record: dict[str, Any], run: EvalRun) -> tuple[Path, ...]:
        return save_tasks(record, run.output, title=run.title("downstream tasks (lm-eval)"))
