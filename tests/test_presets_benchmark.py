"""benchmarks/presets.py cannot rot: its --tiny run goes through every part (a training step, the memory
measurement, the numerics at depth), each row in a child process, and the pieces that decide what a row runs, what
it measures and why one failed are checked directly."""
from __future__ import annotations

import importlib
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "presets.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("presets")


def test_the_plan_takes_the_first_mode_that_fits(bench):
    # a 1.3B preset: 21.9 GB for a float32 step, 10.9 GB in bf16 or for float32 forward+backward, plus the margin
    n = 1_368_000_000
    assert bench.plan_step(n, 30e9, bf16_native=False)[:2] == ("step", "float32")
    assert bench.plan_step(n, 20e9, bf16_native=True)[:2] == ("step", "bfloat16")
    mode, dtype, why = bench.plan_step(n, 20e9, bf16_native=False)
    assert (mode, dtype) == ("backward", "float32")
    assert "step in float32 needs 24.4 GB" in why and "no native bf16" in why
    assert bench.plan_step(n, 9e9, bf16_native=False)[:2] == ("forward", "float32")
    mode, _, why = bench.plan_step(n, 3e9, bf16_native=False)
    assert mode == "none" and "forward in float32 needs 8.0 GB, 3.0 GB available" in why
    assert bench.plan_step(n, 30e9, False, mode="forward")[:2] == ("forward", "float32")
    assert bench.plan_step(n, 30e9, False, dtype="bfloat16")[:2] == ("step", "bfloat16")


def test_saved_bytes_extrapolate_exactly_in_depth(bench):
    """Checkpointing keeps fewer bytes than the plain backward, and 1 and 2 blocks predict 3 exactly."""
    measured = {}
    for depth in (1, 2, 3):
        config = bench.row_config("deltanet-370m", "selective_rope", bench.TINY, num_hidden_layers=depth,
                                  vocab_size=256)
        measured[depth] = bench.activation_bytes(bench.build_model(config), 32)
    three = measured[3]
    assert 0 < three["checkpointing_kept"] < three["checkpointing"] < three["no_checkpointing"]
    predicted = bench.extrapolate(measured[1], measured[2], 3)
    for key, value in three.items():
        assert math.isclose(predicted[key], value, rel_tol=1e-9), key


@pytest.mark.slow
def test_a_killed_hung_or_crashed_row_says_why(bench):
    killed = bench.spawn([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], 60)
    assert killed.status == -signal.SIGKILL and killed.peak_rss > 0
    assert "killed by SIGKILL (most likely the kernel's out-of-memory killer)" in bench.failure(killed, 60)
    hung = bench.spawn([sys.executable, "-c", "import time; time.sleep(60)"], 0.5)
    assert hung.timed_out and bench.failure(hung, 0.5) == "timed out after 0.5 s"
    crashed = bench.spawn([sys.executable, "-c", "raise ValueError('no such preset')"], 60)
    assert bench.failure(crashed, 60) == "exit status 1: ValueError: no such preset"


def test_failed_and_skipped_rows_stay_in_the_table(bench):
    rows = [{"part": "steps", "preset": "gla-1.3b", "option": "rove", "status": "not run", "peak_rss_gb": 0.4,
             "reason": "forward in float32 needs 8.0 GB, 3.0 GB available"},
            {"part": "steps", "preset": "fox-1.3b", "option": "nope", "status": "failed", "peak_rss_gb": 23.1,
             "reason": "killed by SIGKILL"}]
    args = type("Args", (), {"tiny": False})()
    text = bench.markdown(rows, args, "header")
    assert "| gla-1.3b | rove |" in text and "not run: forward in float32 needs 8.0 GB" in text
    assert "failed: killed by SIGKILL" in text and "2 rows: 2 failed or not run, 0 flagged." in text
    assert "NOT RUN: forward in float32" in bench.step_line(rows[0])


def test_the_initial_loss_check(bench):
    config = bench.row_config("gla-370m", "nope", bench.FULL)
    expected = bench.expected_initial_loss(config)
    assert math.log(32000) < expected < math.log(32000) + 0.25
    assert bench.loss_verdict(expected + 0.1, expected) is None
    assert "not finite" in bench.loss_verdict(float("nan"), expected)
    assert "more than 5%" in bench.loss_verdict(2 * expected, expected)


def test_bad_arguments_are_one_line_errors(bench, capsys):
    from rotarium.configs.presets import PRESETS

    assert bench.main(["--presets", "gla-9b"]) == 2
    choices = ", ".join(PRESETS)
    assert capsys.readouterr().err == f"presets.py: error: --presets: unknown gla-9b; choose from {choices}\n"
    assert bench.main(["--output", "table.txt"]) == 2
    assert "give a .md path" in capsys.readouterr().err


@pytest.mark.slow
def test_every_part_of_a_tiny_row(bench):
    """What each child process runs, here in-process: a step, the memory measurement, the numerics."""
    step = bench.step_row("gla-370m", "selective_rope", bench.TINY, "auto", "auto")
    assert step["status"] == "ok", step["reason"]
    assert (step["mode"], step["dtype"], step["params_without_grad"]) == ("step", "float32", 0)
    memory = bench.memory_row("fox-370m", "rove", bench.TINY)
    assert memory["cpu_how"] == "measured" and max(map(abs, memory["depth_check"].values())) < 1e-9
    for mode in bench.MODES:
        assert memory["per_token"][mode] > 0 and memory["gpu_bf16"][mode] > 0
    assert memory["per_token"]["checkpointing"] < memory["per_token"]["no_checkpointing"]
    numerics = bench.numerics_row("deltanet-370m", "rope", bench.TINY)
    assert numerics["status"] == "ok", numerics["reason"]
    assert len(numerics["block_grad_norms"]) == 3 and numerics["held_out_after"] < numerics["held_out_before"]
    records = [{"part": part, "preset": "p", "option": "o", "peak_rss_gb": 1.0, "wall_s": 1.0, **record}
               for part, record in (("steps", step), ("memory", memory), ("numerics", numerics))]
    text = bench.markdown(records, type("Args", (), {"tiny": True})(), "header")
    for heading in ("## One training step", "## Memory", "## Numerics at depth", "3 rows: 0 failed or not run"):
        assert heading in text


@pytest.mark.slow
def test_a_row_runs_in_a_child_process(tmp_path):
    output = tmp_path / "presets.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--presets", "transformer-1.3b", "--options", "rove",
                          "--parts", "steps", "--output", str(output)],
                         check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [record] = json.loads(output.with_suffix(".json").read_text())["rows"]
    assert (record["part"], record["status"], record["mode"]) == ("steps", "ok", "step")
    assert record["peak_rss_gb"] > 0 and math.isfinite(record["loss"])
    assert "| transformer-1.3b | rove | step | float32 |" in output.read_text()
    # the same --output again: the finished row is kept, not rerun; another row joins the same table
    again = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--presets", "transformer-1.3b",
                            "--options", "rove,nope", "--parts", "steps", "--output", str(output)],
                           check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "1 of 2 rows are already in" in again.stdout
    rows = json.loads(output.with_suffix(".json").read_text())["rows"]
    assert [r["option"] for r in rows] == ["nope", "rove"] and rows[1] == record
    # a table of another scale is not mixed in
    other = subprocess.run([sys.executable, str(SCRIPT), "--presets", "transformer-1.3b", "--parts", "steps",
                            "--output", str(output)], check=False, capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
    assert other.returncode == 2 and "another scale" in other.stderr
