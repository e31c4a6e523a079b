"""The CLI's entry point ends every expected error with one line and exit code 2 (not only ``ValueError``: files
that cannot be read, damaged weights, refused pickles, bad YAML), and Ctrl-C with exit code 130, never a traceback;
and `rotarium synthetic` checks its options, device and output folder before it trains anything."""
from __future__ import annotations

import argparse
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import yaml
from safetensors import SafetensorError

from rotarium import cli
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import ROOT, cli_args


def _main_raising(monkeypatch, error: BaseException) -> int:
    def build_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="rotarium")
        sub = parser.add_subparsers(dest="command")

        def fail(args):
            raise error

        sub.add_parser("job").set_defaults(func=fail)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)
    return cli.main(["job"])


@pytest.mark.parametrize("error, expected", [
    (ValueError("`train.lr` must be positive"), "rotarium job: error: `train.lr` must be positive"),
    (FileNotFoundError(2, "No such file or directory", "/data/corpus.txt"),
     "rotarium job: error: FileNotFoundError: [Errno 2] No such file or directory: '/data/corpus.txt'"),
    (PermissionError(13, "Permission denied", "/runs/x"), "rotarium job: error: PermissionError: [Errno 13]"),
    (SafetensorError("Error while deserializing header: HeaderTooLarge"),
     "rotarium job: error: SafetensorError: Error while deserializing header: HeaderTooLarge"),
    (pickle.UnpicklingError("Weights only load failed"), "rotarium job: error: UnpicklingError: Weights only"),
    (yaml.YAMLError("mapping values are not allowed\n  in line 3"),
     "rotarium job: error: YAMLError: mapping values are not allowed in line 3"),
])
def test_expected_errors_end_in_one_line_and_exit_code_2(monkeypatch, capsys, error, expected):
    assert _main_raising(monkeypatch, error) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    assert _main_raising(monkeypatch, KeyboardInterrupt()) == 130
    assert capsys.readouterr().err == "rotarium job: interrupted\n"


def test_a_bug_still_shows_its_traceback(monkeypatch):
    with pytest.raises(ZeroDivisionError):
        _main_raising(monkeypatch, ZeroDivisionError("a bug"))


@pytest.mark.slow
def test_sigint_during_training_exits_130_without_a_traceback(tmp_path, corpus):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    # Python's SIGINT handler in the child, as in a terminal: a runner that a shell started in the background passes
    # SIGINT on ignored, and a process started with SIGINT ignored keeps ignoring it
    foreground = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "runpy.run_module('rotarium', run_name='__main__', alter_sys=True)")
    process = subprocess.Popen(
        [sys.executable, "-c", foreground, "train", *cli_args(corpus, train__max_steps=100000),
         "--output-dir", str(run)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(1)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "rotarium train: interrupted\n" in err, err[-3000:]
    assert not (run / ".lock").exists()


@pytest.mark.slow
def test_synthetic_checks_options_device_and_output_before_training(tmp_path):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    small = ["--steps", "1", "--eval-lengths", "8"]
    results = run_cli_cases({
        "mistyped option": ["synthetic", "s2", *small, "--option", "selective_rope_decya=false"],
        "mistyped option in a sweep": ["synthetic", "sweep", "s2", "--families", "transformer", *small,
                                       "--output-dir", str(tmp_path / "sweep"), "--option",
                                       "selective_rope_decya=false"],
        "option the run sets": ["synthetic", "s2", *small, "--option", "hidden_size=8"],
        "cuda without CUDA": ["synthetic", "s2", *small, "--device", "cuda"],
        "not a device": ["synthetic", "s2", *small, "--device", "gpu0"],
        "read-only sweep folder": ["synthetic", "sweep", "s2", "--families", "transformer", *small,
                                   "--output-dir", str(read_only / "sweep")],
    }, tmp_path, skip_if_writable={"read-only sweep folder": read_only})
    for name in ("mistyped option", "mistyped option in a sweep"):
        message = error_line(results[name], "synthetic")
        assert "--option selective_rope_decya" in message and "did you mean selective_rope_decay" in message
    assert "`--option hidden_size` is set by --hidden-size" in error_line(results["option the run sets"], "synthetic")
    if not __import__("torch").cuda.is_available():
        assert "--device cuda" in error_line(results["cuda without CUDA"], "synthetic")
    assert "--device 'gpu0' is not a device" in error_line(results["not a device"], "synthetic")
    if results["read-only sweep folder"] is not None:
        message = error_line(results["read-only sweep folder"], "synthetic")
        assert "--output-dir" in message and "not writable" in message
    assert not (tmp_path / "sweep").exists()
