"""Downstream tasks through lm-evaluation-harness (rotarium.evaluation.downstream), offline: lm-eval's import and task
index with the Hub switched off, the papers' metrics, and `rotarium eval --tasks` end to end on local tasks in
lm-eval's YAML format over local JSON Lines files, checked against the model's own log-likelihoods."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from rotarium.cli import main
from rotarium.evaluation import downstream
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import ROOT

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

QUESTIONS = [
    ("The sky is", ["blue", "green", "loud"], 0),
    ("The grass is", ["yellow", "green"], 1),
    ("Here we", ["go", "stop", "sing", "are"], 0),
    ("There and back", ["again", "forth"], 0),
    ("The sun is", ["cold", "yellow", "blue"], 1),
    ("One plus one is", ["two", "three"], 0),
]
TEXTS = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
         "A for statement runs its body once for each item of a sequence."]


def write_local_tasks(folder) -> None:
    """A multiple-choice task and a rolling log-likelihood task (WikiText's metrics), in lm-eval's YAML format."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("\n".join(json.dumps({"question": q, "choices": c, "label": label})
                                               for q, c, label in QUESTIONS))
    (folder / "text.jsonl").write_text("\n".join(json.dumps({"page": t}) for t in TEXTS))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common.format(data=folder / "mc.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_target: label\n"
        "doc_to_choice: \"{{choices}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "tiny_text.yaml").write_text(
        "task: tiny_text\n" + common.format(data=folder / "text.jsonl") +
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{page}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")


def run_offline(args: list[str], home) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE, "HF_HOME": str(home), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    env.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "rotarium", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), the continuation's tokens cut as lm-eval cuts them (the context's tokens,
    then what the whole text adds)."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(float(logp[i - 1, whole[i]]) for i in range(n, len(whole)))


@pytest.mark.slow
def test_eval_tasks_runs_local_tasks_offline_and_matches_the_model(tiny_checkpoint, tiny_model, tokenizer, tmp_path):
    tasks = tmp_path / "tasks"
    write_local_tasks(tasks)
    out = tmp_path / "eval"
    result = run_offline(["eval", "--model", str(tiny_checkpoint), "--tasks", "tiny_mc,tiny_text", "--include-path",
                          str(tasks), "--batch-size", "4", "--output-dir", str(out)], tmp_path / "hf")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads((out / "downstream.json").read_text())
    assert report["tasks"] == ["tiny_mc", "tiny_text"] and report["num_fewshot"] is None
    metrics = {row["task"]: row["metrics"] for row in report["rows"]}
    # multiple choice: the choice the model finds likeliest after "question " (acc), per byte (acc_norm)
    right = right_norm = 0
    for question, choices, label in QUESTIONS:
        scores = [loglikelihood(tiny_model, tokenizer, question, " " + c) for c in choices]
        right += max(range(len(choices)), key=scores.__getitem__) == label
        right_norm += max(range(len(choices)), key=lambda i: scores[i] / len((" " + choices[i]).encode())) == label
    assert metrics["tiny_mc"]["acc"] == pytest.approx(right / len(QUESTIONS))
    assert metrics["tiny_mc"]["acc_norm"] == pytest.approx(right_norm / len(QUESTIONS))
    # rolling log-likelihood: each text after the eos, as training starts a document with this tokenizer, per word
    total = sum(loglikelihood(tiny_model, tokenizer, tokenizer.eos_token, t) for t in TEXTS)
    words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
    assert metrics["tiny_text"]["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-3)
    assert report["average"] == pytest.approx(right / len(QUESTIONS))  # the accuracy tasks only
    assert report["lm_eval"]["lm_eval_version"] and "tiny_mc" in report["lm_eval"]["results"]
    table = (out / "downstream.md").read_text()
    assert "| tiny_mc | 0 | acc (%) |" in table and "| tiny_text | 0 | word_perplexity |" in table
    assert "| **average** | | accuracy (%) |" in table


def test_a_set_runs_each_task_with_its_shots_and_reports_its_average(tiny_checkpoint, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    tasks = tmp_path / "tasks"
    write_local_tasks(tasks)
    monkeypatch.setitem(downstream.TASK_SETS, "tiny", downstream.TaskSet("tiny", "a test's", {"tiny_mc": 2,
                                                                                               "tiny_text": 0}))
    monkeypatch.setitem(downstream.ACCURACY, "tiny_text", None)
    calls, contexts = [], []
    evaluate, loglikelihood = lm_eval.simple_evaluate, HFLM.loglikelihood
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: calls.append((kw["tasks"], kw["num_fewshot"]))
                        or evaluate(**kw))
    monkeypatch.setattr(HFLM, "loglikelihood", lambda self, requests, *a, **kw: contexts.extend(
        r.args[0] for r in requests) or loglikelihood(self, requests, *a, **kw))
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(tiny_checkpoint), "--tasks", "tiny", "--include-path", str(tasks),
                 "--batch-size", "4", "--output-dir", str(out)]) in (0, None)
    # one lm-eval call per shot count, and every multiple-choice prompt holds two solved examples before its question
    assert calls == [(["tiny_mc"], 2), (["tiny_text"], 0)]
    questions = {q for q, _, _ in QUESTIONS}
    prompts = [c for c in contexts if c.split("\n\n")[-1] in questions]
    assert len(prompts) == sum(len(c) for _, c, _ in QUESTIONS)
    assert all(len(c.split("\n\n")) == 3 for c in prompts)
    report = json.loads((out / "downstream.json").read_text())
    assert report["shots"] == {"tiny_mc": 2, "tiny_text": 0}
    assert report["lm_eval"]["n-shot"] == {"tiny_mc": 2, "tiny_text": 0}
    assert {row["task"]: row["shots"] for row in report["rows"]} == {"tiny_mc": 2, "tiny_text": 0}
    accuracy = {row["task"]: row["metrics"] for row in report["rows"]}["tiny_mc"]["acc"]
    tiny, = report["sets"]
    assert tiny["name"] == "tiny" and tiny["listed"] == ["tiny_text"] and tiny["averaged"] == ["tiny_mc"]
    assert tiny["average"] == report["average"] == pytest.approx(accuracy)
    table = (out / "downstream.md").read_text()
    assert "| tiny_mc | 2 | acc (%) |" in table and "| tiny_text | 0 | word_perplexity |" in table
    assert f"| **tiny average** | | accuracy (%) | {100 * accuracy:.2f} |" in table and "| **average** |" not in table


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "template-bos"])
def test_lm_eval_starts_a_text_where_training_starts_a_document(tiny_model, tokenizer, bos, monkeypatch):
    """lm-eval puts its prefix token before a text scored from nothing (WikiText's rolling log-likelihood, an empty
    context), by default the tokenizer's bos. Training starts a document after the template's bos where it adds one,
    else after the eos ending the document before: a bos it never adds is a token the model never saw."""
    import lm_eval

    from tests.evaluation.test_eval_framing import with_bos

    tokenizer = with_bos(tokenizer) if bos else tokenizer
    seen = []
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: seen.append(kw["model"].prefix_token_id) or {})
    downstream.evaluate_tasks(tiny_model, tokenizer, {"tiny_text": 0}, None, batch_size=1)
    assert seen == [tokenizer.bos_token_id if bos else tokenizer.eos_token_id]


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "template-bos"])
def test_a_rolling_log_likelihood_scores_each_token_of_the_text_once_after_the_document_start(tiny_model, tokenizer,
                                                                                              bos, monkeypatch):
    """WikiText's perplexity: the sum of log p over the text's own tokens, each once, after the token a training
    document starts after. lm-eval encodes the text with the tokenizer's template before putting its prefix token
    first: with Llama's (a bos), the model would read [bos, bos, text] and the second bos would be scored too."""
    import lm_eval
    from lm_eval.api.instance import Instance

    from rotarium.data.batches import document_start
    from tests.evaluation.test_eval_framing import with_bos

    tokenizer = with_bos(tokenizer) if bos else tokenizer
    text = TEXTS[0]
    scored = []
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: scored.extend(kw["model"].loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)) or {})
    downstream.evaluate_tasks(tiny_model, tokenizer, {"tiny_text": 0}, None, batch_size=2)
    ids = [document_start(tokenizer), *tokenizer(text, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        logp = torch.log_softmax(tiny_model(torch.tensor([ids])).logits[0].double(), -1)
    expected = sum(float(logp[i - 1, ids[i]]) for i in range(1, len(ids)))
    assert scored == [pytest.approx(expected, rel=1e-5)]


@pytest.mark.slow
def test_lm_eval_imports_and_indexes_its_tasks_offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    # one index of lm-eval's own tasks: every task of every set is in it, and a name that is not is refused
    known = [task for task_set in downstream.TASK_SETS.values() for task in task_set.tasks]
    with pytest.raises(ValueError, match=r"--tasks: no_such_task_xyz is not a task or group of lm-eval [\d.]+ "
                                         r"\(a local task: --include-path DIR\)"):
        downstream.task_manager([*known, "no_such_task_xyz"])


def test_the_sets_are_the_papers_tasks_with_their_shots():
    sets = downstream.TASK_SETS
    assert set(sets) == {"selective-rope", "fla", "rove"}
    assert sets["selective-rope"].shots == dict.fromkeys(
        ["wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "swde",
         "squad_completion", "fda"], 0)
    assert sets["fla"].shots == dict.fromkeys(
        ["wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "social_iqa",
         "boolq", "openbookqa", "sciq", "copa"], 0)
    assert sets["rove"].shots == dict.fromkeys(
        ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "openbookqa"], 5)
    # papers is fla's alias; a set's shots are its own, a task named one by one takes --num-fewshot
    for name in ("papers", "fla"):
        selection = downstream.select_tasks(name)
        assert selection.tasks == list(downstream.PAPERS) and selection.sets == [sets["fla"]]
        assert selection.shots == dict.fromkeys(downstream.PAPERS, 0) and selection.loose == []
    selection = downstream.select_tasks("piqa, papers,mmlu")
    assert selection.tasks == ["piqa", *[t for t in downstream.PAPERS if t != "piqa"], "mmlu"]
    assert selection.shots["piqa"] == 0 and selection.shots["mmlu"] is None and selection.loose == ["mmlu"]
    selection = downstream.select_tasks("rove,mmlu", num_fewshot=3)
    assert selection.sets == [sets["rove"]] and selection.loose == ["mmlu"]
    assert selection.shots == {**sets["rove"].shots, "mmlu": 3}
    selection = downstream.select_tasks("selective-rope,fla")  # the tasks both hold are run once
    assert selection.sets == [sets["selective-rope"], sets["fla"]] and len(selection.tasks) == 15
    with pytest.raises(ValueError, match="--tasks ' , ' names no task; .* a set: selective-rope, fla and rove"):
        downstream.select_tasks(" , ")
    with pytest.raises(ValueError, match="--tasks: piqa is asked 5-shot by rove and 0-shot by fla; evaluate them "
                                         "in separate commands"):
        downstream.select_tasks("rove,fla")
    with pytest.raises(ValueError, match="--tasks: piqa is asked 2-shot by piqa and 0-shot by selective-rope"):
        downstream.select_tasks("piqa,selective-rope", num_fewshot=2)
    with pytest.raises(ValueError, match="--num-fewshot: rove fixes each task's examples per prompt"):
        downstream.select_tasks("rove", num_fewshot=2)


def entry(**metrics):
    """A task's entry in lm-eval's results, every metric under the ``none`` filter with a standard error."""
    return {"alias": "x", **{f"{k},none": v for k, v in metrics.items()}, **{f"{k}_stderr,none": 0.01 for k in metrics}}


def test_each_task_is_reported_with_the_papers_metric_and_the_accuracies_averaged():
    results = {"results": {
        "wikitext": {**entry(word_perplexity=21.5, byte_perplexity=1.8, bits_per_byte=0.85)},
        "lambada_openai": entry(perplexity=30.2, acc=0.40),
        "hellaswag": entry(acc=0.30, acc_norm=0.36),
        "arc_challenge": entry(acc=0.22, acc_norm=0.26),
        "openbookqa": entry(acc=0.18, acc_norm=0.30),
        "piqa": entry(acc=0.65, acc_norm=0.64),
        "my_task": {"alias": "my_task", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": "N/A",
                    "acc,none": 0.7},
    }, "n-shot": {"piqa": 0, "my_task": 3}}
    rows, average = downstream.task_rows(results, list(results["results"]))
    shown = {row["task"]: row["metrics"] for row in rows}
    assert shown["wikitext"] == {"word_perplexity": 21.5}
    assert shown["lambada_openai"] == {"perplexity": 30.2, "acc": 0.40}
    assert shown["hellaswag"] == {"acc_norm": 0.36} and shown["arc_challenge"] == {"acc_norm": 0.26}
    assert shown["openbookqa"] == {"acc_norm": 0.30} and shown["piqa"] == {"acc": 0.65}
    assert shown["my_task"] == {"exact_match (strict-match)": 0.5, "acc": 0.7}  # every metric of another task
    assert average == pytest.approx((0.40 + 0.36 + 0.26 + 0.30 + 0.65 + 0.7) / 6)
    assert rows[0]["stderr"] == {"word_perplexity": 0.01}
    assert {row["task"]: row["shots"] for row in rows}["my_task"] == 3
    table = downstream.format_tasks_table(rows, [("average", average)])
    assert "| hellaswag | - | acc_norm (%) | 36.00 |" in table and "| wikitext | - | word_perplexity | 21.5 |" in table
    assert "| my_task | 3 | acc (%) | 70.00 |" in table
    # a group's subtasks are listed, but only what was asked for is averaged
    rows, average = downstream.task_rows(results, ["piqa", "hellaswag"])
    assert len(rows) == 7 and average == pytest.approx((0.65 + 0.36) / 2)


SELECTIVE_ROPE_RESULTS = {
    "wikitext": entry(word_perplexity=21.5), "lambada_openai": entry(perplexity=30.2, acc=0.40),
    "piqa": entry(acc=0.65, acc_norm=0.64), "hellaswag": entry(acc=0.30, acc_norm=0.36),
    "winogrande": entry(acc=0.52), "arc_easy": entry(acc=0.55, acc_norm=0.50),
    "arc_challenge": entry(acc=0.22, acc_norm=0.26), "swde": entry(contains=0.31),
    "squad_completion": entry(contains=0.27), "fda": entry(contains=0.12)}


def test_each_set_reports_its_own_average_over_its_accuracies():
    results = {"results": {**SELECTIVE_ROPE_RESULTS, "social_iqa": entry(acc=0.38), "boolq": entry(acc=0.6),
                           "openbookqa": entry(acc=0.18, acc_norm=0.30), "sciq": entry(acc=0.7),
                           "copa": entry(acc=0.62)},
               "n-shot": dict.fromkeys([*SELECTIVE_ROPE_RESULTS, "social_iqa", "boolq", "openbookqa", "sciq", "copa"],
                                       0)}
    selection = downstream.select_tasks("selective-rope,fla")
    rows, average = downstream.task_rows(results, selection.tasks)
    shown = {row["task"]: row["metrics"] for row in rows}
    assert shown["swde"] == {"contains": 0.31} and shown["fda"] == {"contains": 0.12}
    reports = {entry["name"]: entry for entry in downstream.set_reports(rows, selection.sets)}
    selective = reports["selective-rope"]
    assert selective["listed"] == ["wikitext"] and "wikitext" not in selective["averaged"]
    assert selective["average"] == pytest.approx((0.40 + 0.65 + 0.36 + 0.52 + 0.55 + 0.26 + 0.31 + 0.27 + 0.12) / 9)
    assert reports["fla"]["average"] == pytest.approx(
        (0.40 + 0.65 + 0.36 + 0.52 + 0.55 + 0.26 + 0.38 + 0.6 + 0.30 + 0.7 + 0.62) / 11)
    assert average == pytest.approx((0.40 + 0.65 + 0.36 + 0.52 + 0.55 + 0.26 + 0.31 + 0.27 + 0.12 + 0.38 + 0.6
                                     + 0.30 + 0.7 + 0.62) / 14)
    report = {"tasks": selection.tasks, "sets": list(reports.values()), "average": average, "rows": rows}
    table = downstream.format_tasks_table(rows, downstream.averages(report))
    assert f"| **selective-rope average** | | accuracy (%) | {100 * selective['average']:.2f} |" in table
    assert f"| **fla average** | | accuracy (%) | {100 * reports['fla']['average']:.2f} |" in table
    assert f"| **average** | | accuracy (%) | {100 * average:.2f} |" in table
    assert "| swde | 0 | contains (%) | 31.00 |" in table and "| wikitext | 0 | word_perplexity | 21.5 |" in table
    # one set alone: its average, not the same number twice
    one = {"tasks": list(SELECTIVE_ROPE_RESULTS), "sets": [selective], "average": selective["average"]}
    assert downstream.averages(one) == [("selective-rope average", selective["average"])]


def test_a_missing_lm_eval_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ValueError, match=r"--tasks runs lm-evaluation-harness, which is not installed: "
                                         r"pip install 'rotarium\[eval\]'"):
        downstream.require_lm_eval()


@pytest.mark.slow
def test_eval_tasks_refusals_are_one_line(tiny_checkpoint, tmp_path):
    model = ["eval", "--model", str(tiny_checkpoint), "--output-dir", str(tmp_path / "out")]
    results = run_cli_cases({
        "fewshot": [*model, "--tasks", "piqa", "--num-fewshot", "-1"],
        "batch": [*model, "--tasks", "piqa", "--batch-size", "0"],
        "include": [*model, "--tasks", "tiny_mc", "--include-path", str(tmp_path / "nowhere")],
        "set_fewshot": [*model, "--tasks", "rove", "--num-fewshot", "2"],
        "two_counts": [*model, "--tasks", "rove,papers"],
    }, tmp_path)
    assert "--num-fewshot must be >= 0, got -1" in error_line(results["fewshot"], "eval")
    assert "--batch-size must be >= 1, got 0" in error_line(results["batch"], "eval")
    assert "--include-path" in error_line(results["include"], "eval") and "no such folder" in error_line(
        results["include"], "eval")
    assert "--num-fewshot: rove fixes each task's examples per prompt" in error_line(results["set_fewshot"], "eval")
    assert "--tasks: piqa is asked 5-shot by rove and 0-shot by papers" in error_line(results["two_counts"],
                                                                                          "eval")
