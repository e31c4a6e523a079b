"""bf16 autocast against float32 over the default run's first steps: the loss curves must agree within 1%.

Each seed trains ``rotarium train``'s embedded default in float32 (``--train.mixed_precision no``) and under bf16
autocast (``bf16``), with the same weights, data order and validation split (the seed sets all three), so the two
curves differ only by rounding; and in float32 again with each step's batch in two micro-batches (gradient
accumulation), which differs from the first only in the order its sums are rounded: how far that run drifts from the
first is how far these curves move under float32's own rounding, the scale against which bf16's difference is read.
A run already finished in ``--output-dir`` with the same settings is read again, not retrained. The verdict
compares, seed by seed, every validation loss and every logged training loss (the mean of its window of
``train.log_every`` steps) of the bf16 run with the float32 run's at the same step; the plot shows the curves and
their relative differences against the 1% band.

``python benchmarks/bf16_loss.py [--seeds 0,1,2] [--steps 200] [--output-dir runs/bf16_loss]
[--plot docs/train/bf16_loss_curve.png]``
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from rotarium.training.metrics import metric_points
from rotarium.training.run_folder import FINAL, METRICS, TRAINING_ARGS
from rotarium.utils.devices import cpu_bf16_matmul, read_cpuinfo
from rotarium.utils.files import read_jsonl
from rotarium.utils.plots import save_figure

# Each run's settings beside the default run's. The accumulated float32 run takes the same 16 sequences a step in
# two micro-batches of 8 (and the same validation sequences in batches of 8), so it differs from the reference only
# in how float32 rounds the sums: how far it drifts is how far float32's own rounding moves these curves.
CONTENDERS = {
    "float32": {"train.mixed_precision": "no"},
    "bf16": {"train.mixed_precision": "bf16"},
    "float32-accumulated": {"train.mixed_precision": "no", "train.batch_size": 8,
                            "train.gradient_accumulation_steps": 2, "train.eval_batches": 16},
}
REFERENCE = "float32"
TOLERANCE = 0.01


def run_dir(output_dir: Path, seed: int, contender: str) -> Path:
    return output_dir / f"seed{seed}_{contender}"


def finished(folder: Path, settings: dict[str, object]) -> bool:
    """Whether ``folder`` holds a final model trained with ``settings`` (its saved training arguments)."""
    try:
        saved = json.loads((folder / FINAL / TRAINING_ARGS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and all(saved.get(key) == value for key, value in settings.items())


def train(folder: Path, settings: dict[str, object]) -> None:
    """``rotarium train`` on the embedded default with ``settings``, unless ``folder`` holds that run finished."""
    if finished(folder, settings):
        return
    command = [sys.executable, "-m", "rotarium", "train", "--output-dir", str(folder), "--overwrite"]
    for key, value in settings.items():
        command += [f"--{key}", str(value)]
    log = folder.with_suffix(".log")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        if subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"error: {' '.join(command[2:])} failed; its output: {log}")


def curves(folder: Path) -> dict[str, dict[int, float]]:
    """``{"loss": {step: logged training loss}, "val_loss": {step: validation loss}}`` of a run."""
    records = read_jsonl(folder / METRICS)
    return {key: dict(metric_points(records, key)) for key in ("loss", "val_loss")}


def relative_differences(reference: dict[int, float], other: dict[int, float]) -> dict[int, float]:
    """``other / reference - 1`` at every step both runs logged."""
    return {step: other[step] / reference[step] - 1 for step in sorted(reference.keys() & other.keys())}


def largest(reference: dict[str, dict[int, float]], other: dict[str, dict[int, float]]) -> tuple[float, float, int]:
    """``(largest |validation difference|, the largest training-loss difference, its step)`` of two runs."""
    val = relative_differences(reference["val_loss"], other["val_loss"])
    train_diff = relative_differences(reference["loss"], other["loss"])
    if not val or not train_diff:
        raise SystemExit("error: two runs of a seed share no logged step; were they trained with the same "
                         "train.log_every and train.eval_every?")
    step = max(train_diff, key=lambda s: abs(train_diff[s]))
    return max(abs(d) for d in val.values()), train_diff[step], step


def compare(runs: dict[int, dict[str, dict[str, dict[int, float]]]]) -> bool:
    """Prints each seed's validation losses and largest differences against float32, and the verdict: bf16 within
    TOLERANCE of float32 at every logged step. ``runs[seed][contender]`` as :func:`curves`."""
    passed = True
    print("| seed | validation, float32 / bf16 | bf16: largest validation difference | bf16: largest training "
          "difference (step) | float32 accumulated: validation | training (step) |\n|---|---|---:|---:|---:|---:|")
    for seed, run in runs.items():
        reference = run[REFERENCE]
        pairs = ", ".join(f"{reference['val_loss'][s]:.3f}/{run['bf16']['val_loss'][s]:.3f}"
                          for s in sorted(reference["val_loss"].keys() & run["bf16"]["val_loss"].keys()))
        val, train_diff, step = largest(reference, run["bf16"])
        own_val, own_train, own_step = largest(reference, run["float32-accumulated"])
        print(f"| {seed} | {pairs} | {val:.2%} | {train_diff:+.2%} ({step}) | {own_val:.2%} | "
              f"{own_train:+.2%} ({own_step}) |")
        passed &= val <= TOLERANCE and abs(train_diff) <= TOLERANCE
    print(f"\nbf16 within {TOLERANCE:.0%} of float32 at every logged step of every seed: "
          f"{'PASS' if passed else 'FAIL'}")
    return passed


def plot(runs: dict[int, dict[str, dict[str, dict[int, float]]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, differences) = plt.subplots(1, 2, figsize=(11, 4))
    for seed, run in runs.items():
        reference = run[REFERENCE]
        color = losses.plot(*zip(*sorted(reference["loss"].items())), label=f"seed {seed} float32")[0].get_color()
        losses.plot(*zip(*sorted(run["bf16"]["loss"].items())), "--", color=color, label=f"seed {seed} bf16")
        for contender, style in (("bf16", "-"), ("float32-accumulated", ":")):
            diff = relative_differences(reference["loss"], run[contender]["loss"])
            differences.plot(list(diff), [100 * d for d in diff.values()], style, color=color,
                             label=f"seed {seed} {contender}")
        val = relative_differences(reference["val_loss"], run["bf16"]["val_loss"])
        differences.plot(list(val), [100 * d for d in val.values()], "o", color=color,
                         label=f"seed {seed} bf16, validation")
    losses.set(xlabel="step", ylabel="training loss", title="default run: float32 (solid), bf16 autocast (dashed)")
    losses.legend(fontsize=7)
    differences.axhspan(-100 * TOLERANCE, 100 * TOLERANCE, color="0.9", label="target")
    differences.axhline(0, color="0.5", linewidth=0.5)
    differences.set(xlabel="step", ylabel="run / float32 - 1 (%)",
                    title="training loss against float32")
    differences.legend(fontsize=6, ncol=2)
    save_figure(fig, png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--steps", type=int, default=200, help="train.max_steps of every run")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bf16_loss"), help="where the runs go")
    parser.add_argument("--plot", type=Path, default=Path("docs/train/bf16_loss_curve.png"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    unit = cpu_bf16_matmul(read_cpuinfo())
    print(f"bf16 matrix products of this CPU: {unit or 'none (bf16 runs slower than float32 here)'}")
    jobs = [(seed, name) for seed in seeds for name in CONTENDERS]
    for seed, name in tqdm(jobs, desc="runs"):
        settings = {"train.max_steps": args.steps, "train.seed": seed, **CONTENDERS[name]}
        train(run_dir(args.output_dir, seed, name), settings)
    runs = {seed: {name: curves(run_dir(args.output_dir, seed, name)) for name in CONTENDERS} for seed in seeds}
    passed = compare(runs)
    plot(runs, args.plot)
    print(f"plot: {args.plot}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
