"""benchmarks/bf16_loss.py: the verdict and the plot from finished runs, which it does not train again."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bf16_loss(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("bf16_loss")


def finished_run(folder: Path, settings: dict, losses: dict[int, float], val_losses: dict[int, float]) -> None:
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "training_args.json").write_text(json.dumps(settings))
    records = [{"step": s, "loss": v} for s, v in losses.items()] + [{"step": s, "val_loss": v}
                                                                     for s, v in val_losses.items()]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("bf16_offset, verdict", [(0.005, "PASS"), (0.02, "FAIL")])
def test_finished_runs_are_read_compared_and_plotted(bf16_loss, tmp_path, monkeypatch, capsys, bf16_offset, verdict):
    runs, png = tmp_path / "runs", tmp_path / "curve.png"
    float32 = {10: 8.0, 20: 6.0, 30: 5.0}
    offsets = {"float32": 0.0, "bf16": bf16_offset, "float32-accumulated": 0.003}
    for seed in (0, 1):
        for name, settings in bf16_loss.CONTENDERS.items():
            losses = {s: v * (1 + offsets[name] * (s == 20)) for s, v in float32.items()}
            finished_run(runs / f"seed{seed}_{name}", {"train.max_steps": 200, "train.seed": seed, **settings},
                         losses, {0: 8.4, 30: 5.1})
    monkeypatch.setattr(bf16_loss.subprocess, "run", lambda *a, **k: pytest.fail("a finished run is trained again"))
    monkeypatch.setattr(sys, "argv", ["bf16_loss.py", "--seeds", "0,1", "--output-dir", str(runs), "--plot", str(png)])
    with pytest.raises(SystemExit) as stop:
        bf16_loss.main()
    out = capsys.readouterr().out
    assert stop.value.code == (0 if verdict == "PASS" else 1)
    assert f"every seed: {verdict}" in out
    assert f"| 0.00% | +{bf16_offset:.2%} (20) | 0.00% | +0.30% (20) |" in out
    assert png.stat().st_size > 0


def test_only_a_run_finished_with_the_same_settings_is_kept(bf16_loss, tmp_path, monkeypatch):
    settings = {"train.max_steps": 200, "train.seed": 0, "train.mixed_precision": "no"}
    finished_run(tmp_path / "run", settings, {10: 1.0}, {})
    commands = []
    monkeypatch.setattr(bf16_loss.subprocess, "run", lambda command, **k: commands.append(command) or
                        subprocess.CompletedProcess(command, 0))
    bf16_loss.train(tmp_path / "run", settings)
    assert commands == []
    for changed in ({"train.seed": 1}, {"train.mixed_precision": "bf16"}, {"train.num_threads": 1}):
        bf16_loss.train(tmp_path / "run", {**settings, **changed})
        (key, value), = changed.items()
        command = commands.pop()
        assert command[command.index(f"--{key}") + 1] == str(value)
