"""Where ``rotarium eval`` writes: a scaled evaluation (``--rope-scaling``) goes to files named after the scaling
and records it, never over the model's own results (which export puts in the model card); results files are
strict JSON (no NaN); a flag the evaluation asked for would ignore, a scaling that cannot work, or an output that
cannot be written is one error line (exit 2) before any scoring."""
from __future__ import annotations

import json
import math
import re

import pytest

from rotarium.cli import main
from rotarium.evaluation import downstream, perplexity, ruler
from rotarium.evaluation.outputs import result_path, scaling_name
from rotarium.hub.checkpoint import table_rows
from rotarium.utils.files import write_json_atomic
from tests.cli_cases import error_line

YARN = {"rope_type": "yarn", "factor": 4}
SHORT = ["--context-lengths", "32,64", "--max-tokens", "128", "--device", "cpu"]


def strict_json(path):
    """The JSON at ``path``, refusing the bare NaN / Infinity that Python's json writes by default."""
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(" ".join(["the grass is green and the sky is blue."] * 200))
    return path


def run(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as error:  # argparse's own refusals
        code = error.code
    return code, capsys.readouterr().err


def never(*args, **kwargs):
    raise AssertionError("reached after a refusal that should have come first")


# ---------------------------------------------------------------------------------------------------------------
# Scaled results beside the unscaled ones


@pytest.mark.parametrize(("scaling", "name"), [
    ({"rope_type": "yarn", "factor": 4}, "rope-yarn-x4"),
    ({"rope_type": "yarn", "factor": 4.0}, "rope-yarn-x4"),
    ({"type": "linear", "factor": 1.5}, "rope-linear-x1.5"),
    ({"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 2048, "beta_fast": 16},
     "rope-yarn-x8-beta_fast=16-original_max_position_embeddings=2048"),
    ({"rope_type": "dynamic", "factor": 2, "truncate": False}, "rope-dynamic-x2-truncate=false"),
])
def test_a_scaling_is_named_by_its_type_factor_and_other_keys(scaling, name):
    assert scaling_name(scaling) == name
    assert result_path("out", "perplexity.json", scaling).name == f"perplexity.{name}.json"
    assert result_path("out", "perplexity.json", None).name == "perplexity.json"


def test_scalings_with_lists_or_many_keys_get_distinct_short_safe_names():
    short = {"rope_type": "longrope", "factor": 4, "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}
    other = {**short, "long_factor": [3.0] * 64}
    many = {"rope_type": "llama3", "factor": 8, **{f"key_{i}_of_a_long_name": i for i in range(12)}}
    names = [scaling_name(s) for s in (short, other, many, {**many, "key_0_of_a_long_name": 100})]
    assert len(set(names)) == len(names)
    for name in names:
        assert re.fullmatch(r"[A-Za-z0-9.+_=-]+", name) and len(name) <= 120, name
    assert names[0].startswith("rope-longrope-x4-") and names[2].startswith("rope-llama3-x8-")


def test_a_scaled_perplexity_keeps_the_model_s_own_results(rove_checkpoint, text, tmp_path, capsys):
    out = tmp_path / "eval"
    base = ["eval", "--model", str(rove_checkpoint), "--data", str(text), *SHORT, "--output-dir", str(out)]
    assert run(base, capsys)[0] == 0
    own = {name: (out / name).read_bytes() for name in ("perplexity.json", "perplexity.png")}
    code, err = run([*base, "--rope-scaling", json.dumps(YARN)], capsys)
    assert code == 0, err
    assert {name: (out / name).read_bytes() for name in own} == own
    scaled = strict_json(out / "perplexity.rope-yarn-x4.json")
    assert scaled["rope_scaling"] == YARN
    assert [r["context_length"] for r in scaled["rows"]] == [32, 64]
    assert scaled["rows"] != json.loads(own["perplexity.json"])  # another model's numbers
    assert (out / "perplexity.rope-yarn-x4.png").stat().st_size > 1000
    assert table_rows(scaled) == scaled["rows"]  # the model card shows it as its own table
    assert sorted(p.name for p in out.iterdir()) == ["perplexity.json", "perplexity.png",
                                                     "perplexity.rope-yarn-x4.json", "perplexity.rope-yarn-x4.png"]


def test_a_scaled_ruler_keeps_the_unscaled_ruler_results(rove_checkpoint, tmp_path, capsys):
    out = tmp_path / "eval"
    base = ["eval", "--model", str(rove_checkpoint), "--ruler", "niah_single_1", "--context-lengths", "300",
            "--samples", "1", "--device", "cpu", "--output-dir", str(out)]
    assert run(base, capsys)[0] == 0
    own = {name: (out / name).read_bytes() for name in ruler.RESULT_FILES}
    assert strict_json(out / "ruler.json")["rope_scaling"] is None
    code, err = run([*base, "--rope-scaling", json.dumps(YARN)], capsys)
    assert code == 0, err
    assert {name: (out / name).read_bytes() for name in own} == own
    report = strict_json(out / "ruler.rope-yarn-x4.json")
    assert report["rope_scaling"] == YARN and [r["task"] for r in report["rows"]] == ["niah_single_1"]
    assert "RoPE scaling" in (out / "ruler.rope-yarn-x4.md").read_text().splitlines()[0]
    assert (out / "ruler.rope-yarn-x4.png").stat().st_size > 1000


def test_scaled_downstream_results_keep_the_unscaled_ones(rove_checkpoint, tmp_path, capsys, monkeypatch):
    """lm-eval itself is replaced by a fixed answer: what is checked is where the command writes it."""
    answer = {"results": {"tiny_mc": {"alias": "tiny_mc", "acc,none": 0.5, "acc_stderr,none": float("nan")}},
              "lm_eval_version": "test"}
    monkeypatch.setattr(downstream, "task_manager", lambda *args: None)
    monkeypatch.setattr(downstream, "evaluate_tasks", lambda *args, **kwargs: answer)
    out = tmp_path / "eval"
    base = ["eval", "--model", str(rove_checkpoint), "--tasks", "tiny_mc", "--device", "cpu", "--output-dir", str(out)]
    assert run(base, capsys)[0] == 0
    own = {name: (out / name).read_bytes() for name in downstream.RESULT_FILES}
    code, err = run([*base, "--rope-scaling", json.dumps(YARN)], capsys)
    assert code == 0, err
    assert {name: (out / name).read_bytes() for name in own} == own
    report = strict_json(out / "downstream.rope-yarn-x4.json")
    assert report["rope_scaling"] == YARN and report["rows"][0]["metrics"] == {"acc": 0.5}
    assert report["lm_eval"]["results"]["tiny_mc"]["acc_stderr,none"] is None
    assert "RoPE scaling" in (out / "downstream.rope-yarn-x4.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# Strict JSON


def test_results_json_writes_non_finite_numbers_as_null(tmp_path):
    path = tmp_path / "table.json"
    write_json_atomic(path, {"loss": float("nan"), "rows": [{"perplexity": float("inf")}, (1.5, -math.inf)],
                             "kept": [0, 2.5, "nan", None, True]})
    assert strict_json(path) == {"loss": None, "rows": [{"perplexity": None}, [1.5, None]],
                                 "kept": [0, 2.5, "nan", None, True]}


def test_a_perplexity_table_with_a_non_finite_loss_is_strict_json(tmp_path):
    rows = [{"context_length": 32, "windows": 4, "tokens": 124, "loss": float("nan"), "perplexity": float("nan")},
            {"context_length": 64, "windows": 2, "tokens": 126, "loss": 3.5, "perplexity": 33.115}]
    table, _ = perplexity.save_results(rows, tmp_path, title="t", rope_scaling=YARN)
    assert strict_json(table)["rows"][0] == {**rows[0], "loss": None, "perplexity": None}
    assert strict_json(table)["rows"][1] == rows[1]


# ---------------------------------------------------------------------------------------------------------------
# Refusals, one line, before any scoring


@pytest.mark.parametrize(("flags", "texts"), [
    (["--ruler", ""], ["--ruler ''", "no task", *ruler.TASKS, "all"]),
    (["--ruler", " , "], ["--ruler ' , '", "no task", "niah_single_1"]),
    (["--tasks", ""], ["--tasks ''", "names no task"]),
    (["--samples", "3"], ["--samples applies to --ruler only", "add --ruler TASKS"]),
    (["--seed", "0"], ["--seed applies to --ruler only"]),
    (["--ruler-words", "wonderwords"], ["--ruler-words applies to --ruler only"]),
    (["--num-fewshot", "0"], ["--num-fewshot applies to --tasks only", "add --tasks TASKS"]),
    (["--include-path", "tasks"], ["--include-path applies to --tasks only"]),
    (["--ruler", "vt", "--data", "embedded"], ["--data applies to perplexity only", "leave --data out"]),
    (["--ruler", "vt", "--max-tokens", "100"], ["--max-tokens applies to perplexity only"]),
    (["--ruler", "vt", "--allow-data-change"], ["--allow-data-change applies to perplexity only"]),
    (["--tasks", "piqa", "--samples", "3"], ["--samples applies to --ruler only"]),
    (["--max-tokens", "0"], ["--max-tokens must be >= 1, got 0"]),
    (["--batch-size", "0"], ["--batch-size must be >= 1, got 0"]),
    (["--rope-scaling", ""], ["--rope-scaling must be a JSON object"]),
])
def test_flags_that_would_be_ignored_or_cannot_work_are_refused_first(tiny_checkpoint, text, tmp_path, capsys,
                                                                        monkeypatch, flags, texts):
    for name in ("evaluation_documents", "perplexity_by_context"):
        monkeypatch.setattr(perplexity, name, never)
    monkeypatch.setattr("rotarium.evaluation.cli.load_for", never)
    data = [] if "--data" in flags or "--ruler" in flags or "--tasks" in flags else ["--data", str(text)]
    out = tmp_path / "out"
    message = error_line(run(["eval", "--model", str(tiny_checkpoint), *data, "--device", "cpu", "--output-dir",
                              str(out), *flags], capsys), "eval")
    for part in texts:
        assert part in message, f"{part!r} not in {message!r}"
    assert not out.exists()


@pytest.mark.parametrize(("flags", "blocked"), [
    ([], "perplexity.json"),
    ([], "perplexity.png"),
    (["--rope-scaling", json.dumps(YARN)], "perplexity.rope-yarn-x4.png"),
    (["--ruler", "vt"], "ruler.md"),
    (["--tasks", "piqa"], "downstream.json"),
])
def test_a_folder_where_a_result_goes_stops_eval_before_any_work(rove_checkpoint, text, tmp_path, capsys,
                                                                  monkeypatch, flags, blocked):
    for name in ("evaluation_documents", "perplexity_by_context"):
        monkeypatch.setattr(perplexity, name, never)
    monkeypatch.setattr(downstream, "task_manager", never)
    monkeypatch.setattr("rotarium.evaluation.cli.load_for", never)
    out = tmp_path / "out"
    (out / blocked).mkdir(parents=True)
    data = [] if flags[:1] in (["--ruler"], ["--tasks"]) else ["--data", str(text)]
    message = error_line(run(["eval", "--model", str(rove_checkpoint), *data, "--device", "cpu", "--output-dir",
                              str(out), *flags], capsys), "eval")
    assert f"--output-dir {out} holds a folder named {blocked}" in message
    assert sorted(p.name for p in out.iterdir()) == [blocked]


@pytest.mark.parametrize(("scaling", "texts"), [
    ({"rope_type": "linear", "factor": 0}, ["factor", "0"]),
    ({"rope_type": "yarn", "factor": -2}, ["factor", "-2"]),
    ({"rope_type": "yarn", "factor": 0.5}, ["factor", ">= 1", "0.5"]),
    ({"rope_type": "yarn", "factor": "4"}, ["factor", "'4'"]),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": -32},
     ["original_max_position_embeddings", "-32"]),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}, ["original_max_position_embeddings"]),
])
def test_a_scaling_that_cannot_work_is_one_line_before_any_work(rove_checkpoint, text, tmp_path, capsys,
                                                                 monkeypatch, scaling, texts):
    for name in ("evaluation_documents", "perplexity_by_context"):
        monkeypatch.setattr(perplexity, name, never)
    out = tmp_path / "out"
    message = error_line(run(["eval", "--model", str(rove_checkpoint), "--data", str(text), *SHORT, "--output-dir",
                              str(out), "--rope-scaling", json.dumps(scaling)], capsys), "eval")
    assert message.startswith("rotarium eval: error: --rope-scaling")
    for part in texts:
        assert part in message, f"{part!r} not in {message!r}"
    assert not out.exists()


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_factor_is_one_line_before_any_work(rove_checkpoint, text, tmp_path, capsys, monkeypatch,
                                                          constant):
    for name in ("evaluation_documents", "perplexity_by_context"):
        monkeypatch.setattr(perplexity, name, never)
    out = tmp_path / "out"
    message = error_line(run(["eval", "--model", str(rove_checkpoint), "--data", str(text), *SHORT, "--output-dir",
                              str(out), "--rope-scaling", f'{{"rope_type": "linear", "factor": {constant}}}'],
                             capsys), "eval")
    assert message.startswith("rotarium eval: error: --rope-scaling") and "factor" in message
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--temperature", "0.5"], ["--top-k", "5", "--seed", "3"], ["--top-p", "0.9"]])
def test_generate_refuses_sampling_flags_with_greedy_before_loading(tiny_checkpoint, capsys, monkeypatch, flags):
    monkeypatch.setattr("rotarium.evaluation.cli.load_for", never)
    message = error_line(run(["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--greedy", *flags],
                             capsys), "generate")
    given = ", ".join(flag for flag in flags if flag.startswith("--"))
    assert f"{given} applies to sampling, which --greedy turns off" in message
