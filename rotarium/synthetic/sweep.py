"""Sweeps: every family x positional option x learning rate x seed of a task as resumable units, aggregated over
seeds (median and min-max per cell), with the papers' claims checked seed by seed.

Every finished unit's rows go into ``<task>.csv`` at once (written atomically), so a sweep killed half-way keeps
what it finished and a rerun skips the units already there with the same settings. The table, the claims and the
plot are written from the CSV's rows of this sweep's settings.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rotarium.evaluation.verdicts import Scale, Verdict, accuracy_bounds, decide, reason_lines, rules
from rotarium.synthetic.runner import (
    FAMILIES,
    POSITIONS,
    RunResult,
    RunSettings,
    seconds_per_step,
    train_and_evaluate,
)
from rotarium.synthetic.tasks import TASKS
from rotarium.utils.files import check_writable_folder, read_csv_rows, write_csv_atomic, write_text_atomic
from rotarium.utils.plots import save_figure

SEEDS = (0, 1, 2)
CSV_FIELDS = ("task", "family", "position", "eval_length", "accuracy", "sequence_accuracy", "train_length",
              "train_loss", "train_seconds", "steps", "batch_size", "lr", "num_layers", "hidden_size", "num_heads",
              "parameters", "seed", "model_options", "num_pairs", "vocab_size", "optim_options", "eval_seconds",
              "eval_batches")
# A CSV without the eval_batches column holds runs evaluated on this many batches, the only number sweeps used then.
EVAL_BATCHES_OF_OLDER_CSVS = 4
# A cell "learns the task in distribution" when every seed reaches this token accuracy at the training length. The
# word problems ask for every position right: a model that gets the first positions of a word and guesses the last
# few scores above 90% without tracking the state; 99% is where the reference stops training.
LEARNED = {"s2": 0.99, "a3": 0.99}
LEARNED_DEFAULT = 0.9


# ------------------------------------------------------------------------------------------------------ CSV rows
def _task_fields(s: RunSettings) -> dict[str, str]:
    """The settings only one task reads (empty elsewhere)."""
    mqar = s.task == "mqar"
    # optim_options is empty with the training job's optimiser, as is a column a CSV lacks, so that such rows match
    return {"num_pairs": str(s.num_pairs) if mqar else "", "vocab_size": str(s.vocab_size) if mqar else "",
            "optim_options": json.dumps(s.optim_options) if s.optim_options else ""}


def result_rows(result: RunResult) -> list[dict[str, Any]]:
    s = result.settings
    return [{"task": s.task, "family": s.family, "position": s.position, "eval_length": e["length"],
             "accuracy": round(e["accuracy"], 4), "sequence_accuracy": round(e["sequence_accuracy"], 4),
             "train_length": s.train_length, "train_loss": round(result.train_loss, 4),
             "train_seconds": round(result.train_seconds, 1), "steps": s.steps, "batch_size": s.batch_size,
             "lr": s.lr, "num_layers": s.num_layers, "hidden_size": s.hidden_size, "num_heads": s.num_heads,
             "parameters": result.parameters, "seed": s.seed, "model_options": json.dumps(s.model_options),
             "eval_seconds": round(result.eval_seconds, 1), "eval_batches": s.eval_batches, **_task_fields(s)}
            for e in result.evaluations]


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    rows = read_csv_rows(path, ints=("eval_length", "train_length", "steps", "num_layers", "hidden_size",
                                     "num_heads", "seed"),
                         floats=("accuracy", "sequence_accuracy", "train_loss", "train_seconds", "lr"),
                         optional_floats=("eval_seconds",))
    for row in rows:
        row["eval_seconds"] = row["eval_seconds"] or 0.0  # None when the CSV has no such column
        row["eval_batches"] = int(row.get("eval_batches") or EVAL_BATCHES_OF_OLDER_CSVS)
    return rows


# --------------------------------------------------------------------------------------------------------- units
@dataclass(frozen=True)
class Unit:
    """One run of a sweep: what varies between the runs of one table."""

    family: str
    position: str
    lr: float
    seed: int


def sweep_units(families: tuple[str, ...], positions: tuple[str, ...], lrs: tuple[float, ...],
                seeds: tuple[int, ...]) -> list[Unit]:
    """Seed-major, so that a sweep stopped early has whole tables of its first seeds."""
    return [Unit(f, p, lr, s) for s in seeds for lr in lrs for f in families for p in positions]


def unit_settings(base: RunSettings, unit: Unit) -> RunSettings:
    return RunSettings(**{**asdict(base), "family": unit.family, "position": unit.position, "lr": unit.lr,
                          "seed": unit.seed}).resolved()


def _shared(s: RunSettings | dict[str, Any]) -> dict[str, str]:
    """What every unit of one table shares, as the CSV writes it (a unit's own family, option, lr and seed aside)."""
    if isinstance(s, RunSettings):
        values = {"task": s.task, "steps": s.steps, "batch_size": s.batch_size, "num_layers": s.num_layers,
                  "hidden_size": s.hidden_size, "num_heads": s.num_heads, "train_length": s.train_length,
                  "model_options": json.dumps(s.model_options), "eval_batches": s.eval_batches, **_task_fields(s)}
        return {k: str(v) for k, v in values.items()}
    keys = ("task", "steps", "batch_size", "num_layers", "hidden_size", "num_heads", "train_length",
            "model_options", "eval_batches", "num_pairs", "vocab_size", "optim_options")
    return {k: "" if s.get(k) is None else str(s[k]) for k in keys}


def _is_unit(row: dict[str, Any], unit: Unit, shared: dict[str, str]) -> bool:
    return (row["family"] == unit.family and row["position"] == unit.position and float(row["lr"]) == unit.lr
            and int(row["seed"]) == unit.seed and _shared(row) == shared)


def is_done(rows: list[dict[str, Any]], settings: RunSettings, unit: Unit) -> bool:
    """A unit is done when the CSV holds its rows at every evaluation length."""
    shared = _shared(settings)
    lengths = {r["eval_length"] for r in rows if _is_unit(r, unit, shared)}
    return set(settings.eval_lengths) <= lengths


# ----------------------------------------------------------------------------------------------------- budget
# A whole run over its steps at the probe's pace: evaluation, and what a long run in a worker process adds to a
# short probe (start-up, the loop's bookkeeping, caches shared with the other worker).
RUN_OVER_PROBE = 1.3


def expected_seconds(planned: list[RunSettings]) -> float:
    """The runs' expected time on one thread each, from a few timed training steps of each family x option (the
    same for every seed and learning rate)."""
    per_step: dict[str, float] = {}
    total = 0.0
    for s in planned:
        key = json.dumps([s.family, s.position, s.model_options, _shared(s)], sort_keys=True)
        if key not in per_step:
            per_step[key] = seconds_per_step(s)
        total += RUN_OVER_PROBE * s.steps * per_step[key]
    return total


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core: small models gain little from threads


def _train(settings: RunSettings) -> RunResult:
    return train_and_evaluate(settings, progress=False)


def plan(base: RunSettings, units: list[Unit]) -> list[tuple[Unit, RunSettings]]:
    """Every unit with its resolved settings (with ``paper`` the model options depend on the family)."""
    return [(unit, unit_settings(base, unit)) for unit in units]


def rows_of(rows: list[dict[str, Any]], planned: list[tuple[Unit, RunSettings]]) -> list[dict[str, Any]]:
    """The rows of the planned units at their evaluation lengths: the table of one sweep."""
    keyed = {(u.family, u.position, u.lr, u.seed): (_shared(s), set(s.eval_lengths)) for u, s in planned}
    out = []
    for r in rows:
        shared, lengths = keyed.get((r["family"], r["position"], float(r["lr"]), int(r["seed"])), (None, ()))
        if shared == _shared(r) and r["eval_length"] in lengths:
            out.append(r)
    return out


def run_units(planned: list[tuple[Unit, RunSettings]], csv_path: Path, *, rerun: bool = False, jobs: int = 1,
              progress: bool = True, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Trains every planned unit not yet in ``csv_path`` (all of them with ``rerun``), ``jobs`` at a time, writing
    the CSV after each; returns all its rows."""
    rows = read_rows(csv_path)
    todo = [(unit, settings) for unit, settings in planned if rerun or not is_done(rows, settings, unit)]
    if rerun:
        rows = [r for r in rows if not any(_is_unit(r, u, _shared(s)) for u, s in todo)]
        write_csv_atomic(csv_path, rows, CSV_FIELDS)  # a sweep killed half-way keeps every finished unit
    expected = expected_seconds([s for _, s in todo]) / max(1, min(jobs, len(todo)))
    log(f"{len(planned) - len(todo)} of {len(planned)} runs already done; {len(todo)} to run with {jobs} "
        f"process(es), expected about {expected / 60:.0f} min on this machine (timed from a few steps of each "
        "family x option; longer if other work shares its cores)")

    def record(unit: Unit, result: RunResult) -> None:
        nonlocal rows
        # read again: another sweep may have added its runs to the same CSV since
        rows = [r for r in read_rows(csv_path) if not _is_unit(r, unit, _shared(result.settings))]
        rows += result_rows(result)
        write_csv_atomic(csv_path, rows, CSV_FIELDS)
        accuracies = ", ".join(f"{e['length']}: {e['accuracy']:.3f}" for e in result.evaluations)
        log(f"{result.settings.task} {unit.family} {unit.position} lr {unit.lr:g} seed {unit.seed}: accuracy "
            f"{accuracies} ({result.train_seconds:.0f} s)")

    if jobs <= 1 or len(todo) <= 1:
        for unit, settings in todo:
            record(unit, train_and_evaluate(settings, progress=progress))
        return rows
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init) as pool:
        futures = {pool.submit(_train, settings): unit for unit, settings in todo}
        for future in as_completed(futures):
            record(futures[future], future.result())
    return rows


# -------------------------------------------------------------------------------------------------- aggregation
def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, str, float, int], dict[str, Any]]:
    """``(family, position, lr, eval_length)`` -> median, min and max of the token accuracy over seeds, the median
    sequence accuracy, and ``accuracy_by_seed``."""
    groups: dict[tuple[str, str, float, int], dict[int, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["position"], float(r["lr"]), r["eval_length"]), {})[r["seed"]] = r
    out = {}
    for key, by_seed in groups.items():
        accuracy = [r["accuracy"] for r in by_seed.values()]
        out[key] = {"median": statistics.median(accuracy), "min": min(accuracy), "max": max(accuracy),
                    "sequence_median": statistics.median(r["sequence_accuracy"] for r in by_seed.values()),
                    "seeds": sorted(by_seed), "accuracy_by_seed": {s: r["accuracy"] for s, r in by_seed.items()}}
    return out


@dataclass(frozen=True)
class Claim:
    """A claim of the papers as a test on one family (and lr) at one evaluation length, decided seed by seed by
    :func:`rotarium.evaluation.verdicts.decide`.

    With ``solved``: ``option`` reaches ``solved`` token accuracy and every option of ``against`` stays below it.
    Without: ``option`` beats every option of ``against`` in token accuracy (:data:`ACCURACY`). ``where``: ``train``
    (the training length) or ``beyond`` (every longer evaluation length, each on its own).
    """

    text: str
    option: str
    against: tuple[str, ...]
    where: str
    solved: float | None = None


MARGIN = 0.01
ACCURACY = Scale("token accuracy", lower_is_better=False, margin=MARGIN, relative=False)
CLAIMS: dict[str, tuple[Claim, ...]] = {
    "copying": (
        Claim("Selective RoPE extrapolates on copying where RoPE fails (Selective RoPE paper)",
              "selective_rope", ("rope",), "beyond"),
        Claim("RoVE extrapolates beyond the training length better than RoPE (RoVE paper)",
              "rove", ("rope",), "beyond")),
    "mqar": (
        Claim("Selective RoPE improves MQAR over RoPE (Selective RoPE paper)", "selective_rope", ("rope",), "train"),),
    "s2": (
        Claim("Selective RoPE solves S2 parity in distribution, unlike NoPE and RoPE (Selective RoPE paper)",
              "selective_rope", ("nope", "rope"), "train", solved=LEARNED["s2"]),
        Claim("... and beyond the training length (the reference tests at 4x)",
              "selective_rope", ("nope", "rope"), "beyond", solved=LEARNED["s2"]),
        Claim("The weaker form: Selective RoPE learns S2 better than NoPE and RoPE, solved or not",
              "selective_rope", ("nope", "rope"), "train"),
        Claim("The weaker form beyond the training length", "selective_rope", ("nope", "rope"), "beyond")),
    "a3": (
        Claim("Selective RoPE solves the A3 (= Z3) word problem in distribution, unlike NoPE and RoPE (not a claim "
              "of the papers: the S2 claim carried over to rotations by thirds)",
              "selective_rope", ("nope", "rope"), "train", solved=LEARNED["a3"]),),
}


def check_claim(claim: Claim, cells: dict[tuple[str, str, float, int], dict[str, Any]], family: str, lr: float,
                length: int, train_length: int) -> Verdict:
    """The verdict on ``claim`` for one family and lr at ``length``, from the seeds with every option measured (beyond
    the training length, compared with the same options' gap at it)."""
    options = (claim.option, *claim.against)

    def by_seed(at: int) -> dict[str, dict[int, float]]:
        return {o: cells.get((family, o, lr, at), {}).get("accuracy_by_seed", {}) for o in options}

    return decide(claim.option, claim.against, by_seed(length), ACCURACY,
                  train=by_seed(train_length) if length > train_length else None, solved=claim.solved,
                  bounds=accuracy_bounds())


# ------------------------------------------------------------------------------------------------------- report
def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _row_keys(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    lrs = sorted({float(r["lr"]) for r in rows})
    return [(f, lr) for f in FAMILIES for lr in lrs if any(r["family"] == f and float(r["lr"]) == lr for r in rows)]


def _row_label(family: str, lr: float, several_lrs: bool) -> str:
    return f"{family}, lr {lr:g}" if several_lrs else family


def _model_options(rows: list[dict[str, Any]]) -> str:
    """The model options of the table, per family when they differ (a ``paper`` sweep gives each its own)."""
    by_family = {r["family"]: r["model_options"] for r in rows if r["model_options"] not in ("", "{}")}
    if not by_family:
        return ""
    if len(set(by_family.values())) == 1:
        return f"; model options {next(iter(by_family.values()))}"
    return "; model options " + "; ".join(f"{family}: {options}" for family, options in by_family.items())


def markdown_report(rows: list[dict[str, Any]], command: str | None = None, seeds: tuple[int, ...] | None = None,
                    units: list[Unit] | None = None) -> str:
    """The table of one sweep: the command and budget at the head, then per evaluation length the median token
    accuracy over seeds with its min-max (and the median sequence accuracy), then which runs learn the task in
    distribution, then every claim of the papers for the task, family by family, seed by seed. ``units``: the
    sweep's runs, so that a partial table shows every planned row and column ("-" where nothing finished yet)."""
    task = rows[0]["task"]
    spec = TASKS[task]
    first = rows[0]
    train_length = first["train_length"]
    cells = aggregate(rows)
    seeds_found = sorted({r["seed"] for r in rows})
    seeds = tuple(seeds) if seeds else tuple(seeds_found)
    lrs = sorted({float(r["lr"]) for r in rows} | {u.lr for u in units or ()})
    several = len(lrs) > 1
    runs = {(r["family"], r["position"], float(r["lr"]), r["seed"]): r for r in rows}
    seconds = [r["train_seconds"] + r["eval_seconds"] for r in runs.values()]
    out = [f"## {task}: {spec.description}", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    out += [f"Budget: {first['num_layers']} layer(s), width {first['hidden_size']}, {first['num_heads']} heads; "
            f"{first['steps']} steps of {first['batch_size']} sequences, lr {', '.join(f'{x:g}' for x in lrs)} "
            f"(warmup a tenth, then cosine"
            + (f"; optimiser {first['optim_options']}" if first.get("optim_options") else "") + "); "
            f"trained at length {train_length} {spec.length_unit}"
            + (f", {first['num_pairs']} key-value pairs, vocabulary {first['vocab_size']}" if first.get("num_pairs")
               else "")
            + _model_options(rows)
            + f"; seeds {', '.join(map(str, seeds))}. Wall time per run (training and evaluation, one thread; "
            f"longer on a shared CPU): median "
            f"{statistics.median(seconds):.0f} s (min-max {min(seconds):.0f}-{max(seconds):.0f}); "
            f"{sum(seconds) / 60:.0f} min for the {len(runs)} runs one after another.", ""]
    complete = units is not None and len(runs) >= len(units)
    out += [(f"Status: **complete**, all {len(runs)} runs." if complete else
             f"Status: **partial**, {len(runs)} of {len(units or ())} runs; cells with fewer seeds say how many, and "
             "\"-\" marks cells not run yet. Running the command again trains only the missing runs.")
            if units is not None else f"Runs: {len(runs)}.", ""]
    out += ["Cells: token accuracy %, median over seeds [min-max], (median sequence accuracy %).", ""]
    planned = {(u.family, u.position, u.lr) for u in units or ()}
    positions = [p for p in POSITIONS if any(r["position"] == p for r in rows) or any(k[1] == p for k in planned)]
    row_keys = [(f, lr) for f in FAMILIES for lr in lrs
                if any(r["family"] == f and float(r["lr"]) == lr for r in rows) or any(k[0] == f and k[2] == lr
                                                                                          for k in planned)]
    lengths = sorted({r["eval_length"] for r in rows})
    for length in lengths:
        kind = f"beyond training, {length / train_length:g}x" if length > train_length else "in distribution"
        out += [f"**Evaluated at length {length} ({kind})**", "",
                "| family | " + " | ".join(positions) + " |", "|---|" + "---:|" * len(positions)]
        for family, lr in row_keys:
            line = []
            for position in positions:
                c = cells.get((family, position, lr, length))
                if c is None:
                    line.append("-")
                    continue
                few = f" {len(c['seeds'])} seed{'s' * (len(c['seeds']) > 1)}" if len(c["seeds"]) < len(seeds) else ""
                line.append(f"{_pct(c['median'])} [{_pct(c['min'])}-{_pct(c['max'])}] "
                            f"({100 * c['sequence_median']:.0f}){few}")
            out.append(f"| {_row_label(family, lr, several)} | " + " | ".join(line) + " |")
        out.append("")
    learned_at = LEARNED.get(task, LEARNED_DEFAULT)
    out += [(f"**Learned in distribution** (every seed at least {100 * learned_at:.0f}% token accuracy at length "
             f"{train_length}):"), ""]
    for family, lr in row_keys:
        learned = [p for p in positions if (c := cells.get((family, p, lr, train_length))) and c["min"] >= learned_at]
        out.append(f"- {_row_label(family, lr, several)}: {', '.join(learned) if learned else 'none'}")
    out.append("")
    claims = CLAIMS.get(task, ())
    if claims:
        out += ["### Claims, seed by seed", "", rules(ACCURACY), ""]
    for claim in claims:
        test = (f"{claim.option} at least {100 * claim.solved:.0f}% and {', '.join(claim.against)} below"
                if claim.solved is not None else f"{claim.option} beats {', '.join(claim.against)}")
        claim_lengths = [length for length in lengths if (length > train_length) == (claim.where == "beyond")]
        out += [f"**{claim.text}**: {test}.", "",
                "| family | " + " | ".join(f"length {length}" for length in claim_lengths) + " |",
                "|---|" + "---|" * len(claim_lengths)]
        verdicts = {(family, lr, length): check_claim(claim, cells, family, lr, length, train_length)
                    for family, lr in row_keys for length in claim_lengths}
        for family, lr in row_keys:
            out.append(f"| {_row_label(family, lr, several)} | " + " | ".join(
                str(verdicts[family, lr, length]) for length in claim_lengths) + " |")
        out.append("")
        out += reason_lines([(_row_label(family, lr, several), str(length), v)
                             for (family, lr, length), v in verdicts.items()], "length")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per family (and lr): median accuracy against evaluation length with the seeds' min-max as a band,
    one line per positional option (grouped bars with min-max whiskers when there is one evaluation length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = aggregate(rows)
    row_keys = _row_keys(rows)
    several = len({lr for _, lr in row_keys}) > 1
    positions = [p for p in POSITIONS if any(r["position"] == p for r in rows)]
    lengths = sorted({r["eval_length"] for r in rows})
    task, train_length = rows[0]["task"], rows[0]["train_length"]
    if len(lengths) == 1:
        fig, ax = plt.subplots(figsize=(max(7, 1.8 * len(row_keys)), 3.5))
        width = 0.8 / len(positions)
        for i, position in enumerate(positions):
            c = [cells.get((f, position, lr, lengths[0])) for f, lr in row_keys]
            median = [x["median"] if x else 0.0 for x in c]
            error = [[x["median"] - x["min"] if x else 0.0 for x in c], [x["max"] - x["median"] if x else 0.0
                                                                          for x in c]]
            ax.bar([j + i * width for j in range(len(row_keys))], median, width, yerr=error, capsize=2,
                   label=position)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(row_keys))],
                      [_row_label(f, lr, several) for f, lr in row_keys], fontsize=8)
        ax.set_ylabel("token accuracy (median, min-max)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{task} (length {lengths[0]})")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    else:
        # one row of panels per lr, one column per family
        families = list(dict.fromkeys(f for f, _ in row_keys))
        lrs = sorted({lr for _, lr in row_keys})
        fig, axes = plt.subplots(len(lrs), len(families), figsize=(3.2 * len(families), 3.0 * len(lrs)),
                                 sharey=True, squeeze=False)
        for ax in axes.flat:
            ax.set_visible(False)
        for family, lr in row_keys:
            ax = axes[lrs.index(lr)][families.index(family)]
            ax.set_visible(True)
            for position in positions:
                points = [(length, cells[(family, position, lr, length)]) for length in lengths
                          if (family, position, lr, length) in cells]
                if points:
                    xs = [p[0] for p in points]
                    color = f"C{POSITIONS.index(position)}"  # one colour per option in every panel
                    ax.plot(xs, [p[1]["median"] for p in points], marker="o", label=position, color=color)
                    ax.fill_between(xs, [p[1]["min"] for p in points], [p[1]["max"] for p in points],
                                    color=color, alpha=0.15)
            ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_title(_row_label(family, lr, several), fontsize=9)
            ax.set_xlabel("evaluation length")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        for row in axes:
            row[0].set_ylabel("token accuracy (median, min-max)")
        handles = [plt.Line2D([], [], color=f"C{POSITIONS.index(p)}", marker="o", label=p) for p in positions]
        axes[0][-1].legend(handles=handles, fontsize=8)
        fig.suptitle(f"{task} (dashed: training length {train_length})")
    fig.tight_layout()
    save_figure(fig, path)


def sweep(base: RunSettings, output_dir: str | os.PathLike, *, families: tuple[str, ...] = FAMILIES,
          positions: tuple[str, ...] = POSITIONS, lrs: tuple[float, ...] | None = None,
          seeds: tuple[int, ...] = SEEDS, command: str | None = None, rerun: bool = False, jobs: int = 1,
          report_only: bool = False, progress: bool = True, log: Callable[[str], None] = print
          ) -> tuple[Path, Path, Path]:
    """Every family x option x lr x seed of ``base.task`` (``lrs``: the task's ``sweep_lrs``, else its lr); writes
    ``<task>.csv`` after every run, then ``<task>.md`` and ``<task>.png`` from the rows of this sweep's settings.
    ``report_only``: trains nothing, writes the table of the runs already finished (marked partial if some are not).
    """
    output_dir = Path(output_dir)
    check_writable_folder(output_dir, "--output-dir")  # before the runs, whose rows it records as each ends
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = (output_dir / f"{base.task}.{ext}" for ext in ("csv", "md", "png"))
    if not lrs:  # the task's sweep of learning rates, unless the run sets one (or --paper sets the reference's)
        resolved = base.resolved()
        spec_lrs = TASKS[base.task].sweep_lrs
        lrs = spec_lrs if spec_lrs and base.lr is None and not base.paper else (resolved.lr,)
    units = sweep_units(families, positions, lrs, seeds)
    planned = plan(base, units)
    if report_only:
        rows = read_rows(csv_path)
    else:
        start = time.perf_counter()
        rows = run_units(planned, csv_path, rerun=rerun, jobs=jobs, progress=progress, log=log)
        log(f"ran for {(time.perf_counter() - start) / 60:.1f} min")
    table = rows_of(rows, planned)
    if not table:
        raise ValueError(f"no finished runs for {csv_path}")
    write_text_atomic(md_path, markdown_report(table, command, seeds, units) + "\n")
    plot(table, png_path)
    return csv_path, md_path, png_path
