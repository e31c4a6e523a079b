"""``rotarium extrapolation``: length extrapolation on text, RoVE's headline claim, as a resumable sweep.

Every family x positional option x seed trains the same small model (the training job's, ``rotarium train``) for
the same number of tokens at one sequence length on the same corpus with one shared tokenizer, then scores the
run's held-out documents at context lengths from the training length to a multiple of it
(:func:`rotarium.evaluation.perplexity.perplexity_by_context`). Each finished run appends its rows to
``extrapolation.csv``; a rerun skips the runs there with the same settings and resumes an interrupted run from its
last checkpoint. ``extrapolation.md`` (median and min-max over seeds, the claims checked seed by seed) and
``extrapolation.png`` are written from the CSV.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rotarium.synthetic.runner import FAMILIES, POSITIONS, seconds_per_call
from rotarium.synthetic.sweep import verdict
from rotarium.utils.argtypes import int_list
from rotarium.utils.files import check_writable_folder, read_csv_rows, write_csv_atomic, write_text_atomic
from rotarium.utils.plots import save_figure

if TYPE_CHECKING:
    from rotarium.training.config import Config

# Debian's python3-doc package (`apt-get install python3-doc`): Python's full documentation as reStructuredText,
# many times the embedded corpus, so that long held-out documents exist at every length the table reads.
PYTHON_DOCS = "/usr/share/doc/python3/html/_sources"
# The command's training defaults over the training job's (4 layers, width 256, 4 heads, 16 x 128 tokens a step):
# sized so that a whole table (4 families x 4 options x 3 seeds) is a CPU job; a validation loss only at the start
# and the end (the table scores the held-out documents itself), a checkpoint every 50 steps for resuming, one thread
# per run.
DEFAULTS = {"train.max_steps": 100, "train.save_every": 50, "train.eval_every": 1_000_000, "train.num_threads": 1,
            "train.keep_checkpoints": 1, "data.max_validation_tokens": 8192, "train.eval_batches": 4}
CSV_FIELDS = ("family", "position", "seed", "context_length", "loss", "perplexity", "windows", "tokens",
              "train_length", "train_tokens", "steps", "batch_size", "lr", "num_layers", "hidden_size", "num_heads",
              "parameters", "train_seconds", "eval_seconds", "settings")
# A whole run over its training steps at the probe's pace: the checkpoints, the validation at the start and the
# end, tokenising the corpus and scoring the held-out documents at every context length.
RUN_OVER_PROBE = 1.5
MARGIN = 0.01  # relative: "lower perplexity" means lower by at least 1%


@dataclass(frozen=True)
class Unit:
    family: str
    position: str
    seed: int


def _run_name(unit: Unit) -> str:
    return f"{unit.family}-{unit.position}-seed{unit.seed}"


def unit_config(overrides: dict[str, Any], unit: Unit, tokenizer: Path) -> Config:
    from rotarium.training.config import load_config

    return load_config(None, {**DEFAULTS, **overrides, "model.family": unit.family,
                              "model.position_encoding": unit.position, "train.seed": unit.seed,
                              "tokenizer.name": str(tokenizer), "eval.run_after": False})


def settings_key(config: Config) -> str:
    """What the runs of one table share, as the CSV writes it: every config value but the unit's own."""
    flat = {f"{section}.{k}": v for section, values in config.to_dict().items() for k, v in values.items()}
    for key in ("model.family", "model.position_encoding", "train.seed", "train.num_threads", "tokenizer.name",
                "train.save_every", "train.keep_checkpoints", "train.report_to", "train.eval_every"):
        flat.pop(key, None)
    return json.dumps(flat, sort_keys=True, default=str)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return read_csv_rows(path, ints=("seed", "context_length", "windows", "train_length", "steps", "num_layers",
                                     "hidden_size"),
                         floats=("train_seconds", "eval_seconds", "lr"), optional_floats=("loss", "perplexity"))


def shared_tokenizer(overrides: dict[str, Any], folder: Path) -> Path:
    """One BPE for every run (perplexities compare only under one tokenizer), trained once on the documents seed 0
    does not hold out; a ``tokenizer.name`` override is used instead when given."""
    from rotarium.data.documents import iter_documents, split_documents
    from rotarium.data.tokenizer import train_bpe
    from rotarium.training.config import load_config
    from rotarium.utils.files import write_folder_atomic

    config = load_config(None, {**DEFAULTS, **overrides})
    if config.tokenizer.name is not None:
        return Path(config.tokenizer.name)
    target = folder / "tokenizer"
    if not (target / "tokenizer_config.json").is_file():
        documents = split_documents(list(iter_documents(config.data)), config.data.validation_fraction, 0)[0]
        tokenizer = train_bpe(documents[:config.tokenizer.train_documents], config.tokenizer.vocab_size)
        write_folder_atomic(target, tokenizer.save_pretrained)
    return target


def train_and_score(overrides: dict[str, Any], unit: Unit, tokenizer: str, run_dir: str,
                    multiples: tuple[int, ...], eval_tokens: int, progress: bool = False) -> list[dict[str, Any]]:
    """Trains one unit (resuming its run folder) and scores its held-out documents at every context length."""
    import torch

    from rotarium.evaluation.perplexity import perplexity_by_context, stream_tokens
    from rotarium.training.trainer import Trainer

    config = unit_config(overrides, unit, Path(tokenizer))
    start = time.perf_counter()
    trainer = Trainer(config, run_dir, resume=True)
    result = trainer.train()
    train_seconds = time.perf_counter() - start
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    L = config.data.seq_len
    tokens = stream_tokens(trainer.tokenizer, trainer.data.validation_documents)
    with torch.no_grad():
        scores = perplexity_by_context(model, tokens, [m * L for m in multiples], max_tokens=eval_tokens,
                                       batch_size=config.train.batch_size, progress=progress)
    m, t = config.model, config.train
    shared = {"family": unit.family, "position": unit.position, "seed": unit.seed, "train_length": L,
              "train_tokens": result.steps * trainer.tokens_per_step, "steps": t.max_steps,
              "batch_size": t.batch_size, "lr": config.optim.lr, "num_layers": m.num_hidden_layers,
              "hidden_size": m.hidden_size, "num_heads": m.num_heads,
              "parameters": sum(p.numel() for p in model.parameters()), "train_seconds": round(train_seconds, 1),
              "eval_seconds": round(time.perf_counter() - start - train_seconds, 1),
              "settings": settings_key(config)}
    return [{**shared, **{k: s[k] for k in ("context_length", "loss", "perplexity", "windows", "tokens")}}
            for s in scores]


def _worker(args: tuple) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    return train_and_score(*args)


def seconds_per_step(config: Config, tokenizer: Path, steps: int = 3, warmup: int = 1) -> float:
    """A training step's wall time for ``config`` on one thread: a batch of random tokens through the model with
    labels, backward and AdamW."""
    import torch

    from rotarium.data.tokenizer import load_tokenizer
    from rotarium.training.build import build_model
    from rotarium.training.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(config, load_tokenizer(str(tokenizer)))
    optimizer = build_optimizer(model, config.optim)
    tokens = torch.randint(0, model.config.vocab_size, (config.train.batch_size, config.data.seq_len))

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return seconds_per_call(step, steps, warmup)


def expected_seconds(configs: list, tokenizer: Path) -> float:
    """The runs' expected time on one thread each, from a few timed steps of each family x option."""
    per_step: dict[tuple[str, str], float] = {}
    total = 0.0
    for config in configs:
        key = (config.model.family, config.model.position_encoding)
        if key not in per_step:
            per_step[key] = seconds_per_step(config, tokenizer)
        total += RUN_OVER_PROBE * config.train.max_steps * per_step[key]
    return total


def run_units(overrides: dict[str, Any], units: list[Unit], output_dir: Path, runs_dir: Path, *,
              multiples: tuple[int, ...], eval_tokens: int, jobs: int = 1, progress: bool = True,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every unit not yet in ``output_dir/extrapolation.csv`` with these settings; returns the rows of this sweep."""
    csv_path = output_dir / "extrapolation.csv"
    tokenizer = shared_tokenizer(overrides, runs_dir)
    rows = read_rows(csv_path)
    configs = {u: unit_config(overrides, u, tokenizer) for u in units}
    lengths = {m * configs[units[0]].data.seq_len for m in multiples}

    def done(unit: Unit) -> bool:
        key = settings_key(configs[unit])
        return lengths <= {r["context_length"] for r in rows if (r["family"], r["position"], r["seed"]) ==
                           (unit.family, unit.position, unit.seed) and r["settings"] == key}

    todo = [u for u in units if not done(u)]
    expected = expected_seconds([configs[u] for u in todo], tokenizer) / max(1, min(jobs, len(todo)))
    log(f"{len(units) - len(todo)} of {len(units)} runs already done; {len(todo)} to run with {jobs} process(es), "
        f"expected about {expected / 60:.0f} min on this machine (timed from a few steps of each family x option; "
        "longer if other work shares its cores)")

    def record(unit: Unit, new: list[dict[str, Any]]) -> None:
        nonlocal rows
        key = settings_key(configs[unit])
        rows = [r for r in rows if not ((r["family"], r["position"], r["seed"]) == (unit.family, unit.position,
                                                                                     unit.seed)
                                        and r["settings"] == key)] + new
        write_csv_atomic(csv_path, rows, CSV_FIELDS)  # a sweep killed half-way keeps every finished unit
        ppl = ", ".join(f"{r['context_length']}: {r['perplexity']}" for r in new)
        log(f"{unit.family} {unit.position} seed {unit.seed}: perplexity {ppl} ({new[0]['train_seconds']:.0f} s)")

    tasks = [(u, (overrides, u, str(tokenizer), str(runs_dir / _run_name(u)), multiples, eval_tokens)) for u in todo]
    if jobs <= 1 or len(tasks) <= 1:
        for unit, args in tasks:
            record(unit, train_and_score(*args, progress=progress))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_worker, args): unit for unit, args in tasks}
            for future in as_completed(futures):
                record(futures[future], future.result())
    keys = {(u.family, u.position, u.seed): settings_key(configs[u]) for u in units}
    return [r for r in rows if keys.get((r["family"], r["position"], r["seed"])) == r["settings"]
            and r["context_length"] in lengths]


# ------------------------------------------------------------------------------------------------------- report
def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """``(family, position, context_length)`` -> median, min, max perplexity over seeds and ``by_seed``."""
    groups: dict[tuple[str, str, int], dict[int, float]] = {}
    for r in rows:
        if r["perplexity"] is not None:
            groups.setdefault((r["family"], r["position"], r["context_length"]), {})[r["seed"]] = r["perplexity"]
    return {k: {"median": statistics.median(v.values()), "min": min(v.values()), "max": max(v.values()),
                "by_seed": v} for k, v in groups.items()}


@dataclass(frozen=True)
class TextClaim:
    """``option`` has a perplexity lower than every option of ``against`` by at least ``MARGIN`` (relative), seed
    by seed, at every context length of ``where`` (``train``: the training length; ``beyond``: each longer one)."""

    text: str
    option: str
    against: tuple[str, ...]
    where: str


CLAIMS = (
    TextClaim("RoVE's perplexity beyond the training length is lower than RoPE's (RoVE paper)",
              "rove", ("rope",), "beyond"),
    TextClaim("Selective RoPE's perplexity at the training length is lower than RoPE's (Selective RoPE paper)",
              "selective_rope", ("rope",), "train"),
    TextClaim("Selective RoPE's perplexity beyond the training length is lower than RoPE's",
              "selective_rope", ("rope",), "beyond"),
)


def check_claim(claim: TextClaim, cells: dict, family: str, length: int) -> tuple[int, int]:
    options = (claim.option, *claim.against)
    by_option = [cells.get((family, o, length), {}).get("by_seed", {}) for o in options]
    seeds = sorted(set.intersection(*(set(b) for b in by_option)))
    held = sum(by_option[0][s] <= (1 - MARGIN) * min(b[s] for b in by_option[1:]) for s in seeds)
    return held, len(seeds)


def markdown_report(rows: list[dict[str, Any]], command: str | None, corpus: str, seeds: tuple[int, ...],
                    units: int) -> str:
    first = rows[0]
    L = first["train_length"]
    cells = aggregate(rows)
    runs = {(r["family"], r["position"], r["seed"]): r for r in rows}
    seconds = [r["train_seconds"] + r["eval_seconds"] for r in runs.values()]
    out = ["## Length extrapolation on text", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    out += [(f"Budget: {first['num_layers']} layers, width {first['hidden_size']}, {first['num_heads']} heads; "
            f"{first['steps']} steps of {first['batch_size']} x {L} tokens ({int(first['train_tokens']):,} training "
            f"tokens per run), lr {first['lr']:g}; corpus `{corpus}`, one shared BPE; seeds "
            f"{', '.join(map(str, seeds))}. Wall time per run (training and evaluation, one thread; longer on a "
            f"shared CPU): median "
            f"{statistics.median(seconds) / 60:.1f} min (min-max {min(seconds) / 60:.1f}-{max(seconds) / 60:.1f}); "
            f"{sum(seconds) / 60:.0f} min for the {len(runs)} runs one after another."), "",
            (f"Status: **complete**, all {len(runs)} runs." if len(runs) >= units else
             f"Status: **partial**, {len(runs)} of {units} runs; cells with fewer seeds say how many."), "",
            ("Cells: perplexity on each run's held-out documents, median over seeds [min-max]; the same tokens are "
            "scored at every context length."), ""]
    positions = [p for p in POSITIONS if any(r["position"] == p for r in rows)]
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    lengths = sorted({r["context_length"] for r in rows})
    for length in lengths:
        kind = f"beyond training, {length // L}x" if length > L else "the training length"
        out += [f"**Context {length} ({kind})**", "", "| family | " + " | ".join(positions) + " |",
                "|---|" + "---:|" * len(positions)]
        for family in families:
            line = []
            for position in positions:
                c = cells.get((family, position, length))
                if c is None:
                    line.append("-")
                    continue
                n = len(c["by_seed"])
                few = f" {n} seed{'s' * (n > 1)}" if n < len(seeds) else ""
                line.append(f"{c['median']:.1f} [{c['min']:.1f}-{c['max']:.1f}]{few}")
            out.append(f"| {family} | " + " | ".join(line) + " |")
        out.append("")
    out += ["### Claims, seed by seed", "",
            (f"A claim holds for a family only when it holds for every seed (paired by seed); \"lower\" means lower by "
            f"at least {100 * MARGIN:.0f}%."), ""]
    for claim in CLAIMS:
        claim_lengths = [x for x in lengths if (x > L) == (claim.where == "beyond")]
        out += [f"**{claim.text}**", "", "| family | " + " | ".join(f"context {x}" for x in claim_lengths) + " |",
                "|---|" + "---|" * len(claim_lengths)]
        for family in families:
            out.append(f"| {family} | " + " | ".join(verdict(*check_claim(claim, cells, family, x))
                                                      for x in claim_lengths) + " |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = aggregate(rows)
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    positions = [p for p in POSITIONS if any(r["position"] == p for r in rows)]
    lengths = sorted({r["context_length"] for r in rows})
    L = rows[0]["train_length"]
    fig, axes = plt.subplots(1, len(families), figsize=(3.4 * len(families), 3.4), squeeze=False)
    for ax, family in zip(axes[0], families):
        for position in positions:
            points = [(x, cells[(family, position, x)]) for x in lengths if (family, position, x) in cells]
            if points:
                xs = [x for x, _ in points]
                color = f"C{POSITIONS.index(position)}"  # one colour per option in every panel
                ax.plot(xs, [c["median"] for _, c in points], marker="o", label=position, color=color)
                ax.fill_between(xs, [c["min"] for _, c in points], [c["max"] for _, c in points], color=color,
                                alpha=0.15)
        ax.axvline(L, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(family)
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("perplexity (median, min-max)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"perplexity against context length (dashed: training length {L})")
    fig.tight_layout()
    save_figure(fig, path)


def extrapolation_sweep(overrides: dict[str, Any], output_dir: str | os.PathLike, runs_dir: str | os.PathLike, *,
                        families: tuple[str, ...] = FAMILIES, positions: tuple[str, ...] = POSITIONS,
                        seeds: tuple[int, ...] = (0, 1, 2), multiples: tuple[int, ...] = (1, 2, 4, 8),
                        eval_tokens: int = 16384, jobs: int = 1, command: str | None = None, progress: bool = True,
                        log: Callable[[str], None] = print) -> tuple[Path, Path, Path]:
    for key in ("model.family", "model.position_encoding", "train.seed"):
        if key in overrides:
            raise ValueError(f"--{key} is set per run here; use --families, --positions or --seeds")
    output_dir, runs_dir = Path(output_dir), Path(runs_dir)
    check_writable_folder(output_dir, "--output-dir")  # before the runs, whose rows it records as each ends
    check_writable_folder(runs_dir, "--runs-dir")
    output_dir.mkdir(parents=True, exist_ok=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    units = [Unit(f, p, s) for s, f, p in itertools.product(seeds, families, positions)]
    start = time.perf_counter()
    rows = run_units(overrides, units, output_dir, runs_dir, multiples=multiples, eval_tokens=eval_tokens,
                     jobs=jobs, progress=progress, log=log)
    log(f"ran for {(time.perf_counter() - start) / 60:.1f} min")
    paths = tuple(output_dir / f"extrapolation.{ext}" for ext in ("csv", "md", "png"))
    corpus = {**DEFAULTS, **overrides}.get("data.source", "embedded")
    write_text_atomic(paths[1], markdown_report(rows, command, str(corpus), seeds, len(units)) + "\n")
    plot(rows, paths[2])
    return paths


# ---------------------------------------------------------------------------------------------------------- CLI
def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from rotarium.synthetic.cli import choice_list

    parser = subparsers.add_parser(
        "extrapolation", help="perplexity against context length of every family x positional option on text",
        description="Trains the training job's model (4 layers, width 256; any --section.key override of "
                    "`rotarium train`) of every family x positional option x seed for the same tokens on one corpus "
                    "with one shared tokenizer, and scores each run's held-out documents from the training length "
                    "to 8x it. Writes extrapolation.md (median and min-max over seeds, the papers' claims checked "
                    "seed by seed), .csv and .png. Each run is saved as it ends; a rerun skips finished runs and "
                    "resumes an interrupted one. Prints the expected time first.",
        epilog=f"default corpus: {PYTHON_DOCS} (Debian: apt-get install python3-doc); any local folder or file: "
               "--data.source PATH. Defaults over the training job's: "
               + ", ".join(f"{k} {v}" for k, v in DEFAULTS.items()) + ".")
    parser.add_argument("--families", type=choice_list(FAMILIES), default=list(FAMILIES),
                        help=f"comma-separated subset of {','.join(FAMILIES)}")
    parser.add_argument("--positions", type=choice_list(POSITIONS), default=list(POSITIONS),
                        help=f"comma-separated subset of {','.join(POSITIONS)}")
    parser.add_argument("--seeds", type=int_list("--seeds", minimum=0), default=[0, 1, 2],
                        help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--multiples", type=int_list("--multiples"), default=[1, 2, 4, 8],
                        help="context lengths as multiples of data.seq_len (default 1,2,4,8)")
    parser.add_argument("--eval-tokens", type=int, default=16384,
                        help="held-out tokens scored at each context length (default 16384)")
    parser.add_argument("--output-dir", default="docs/text_extrapolation", help="where the table, CSV and plot go")
    parser.add_argument("--runs-dir", default="runs/extrapolation", help="the run folders (checkpoints, models)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs at a time, one process and one thread each (default: 2, or 1 on one core)")
    parser.set_defaults(func=run_extrapolation, accepts_overrides=True)


def run_extrapolation(args: argparse.Namespace) -> int:
    from rotarium.training.config import parse_overrides

    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.eval_tokens < 1:
        raise ValueError(f"--eval-tokens must be positive, got {args.eval_tokens}")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds has a seed twice: {args.seeds}")
    overrides = parse_overrides(args.overrides)
    if "data.source" not in overrides:
        if not Path(PYTHON_DOCS).is_dir():
            raise ValueError(f"the default corpus {PYTHON_DOCS} is not installed: apt-get install python3-doc, or "
                             "pass --data.source FOLDER")
        overrides["data.source"] = PYTHON_DOCS
    command = ("rotarium " + " ".join(shlex.quote(a) for a in sys.argv[1:])
               if sys.argv[1:2] == ["extrapolation"] else None)
    _, md_path, _ = extrapolation_sweep(
        overrides, args.output_dir, args.runs_dir, families=tuple(args.families), positions=tuple(args.positions),
        seeds=tuple(args.seeds), multiples=tuple(args.multiples), eval_tokens=args.eval_tokens, jobs=args.jobs,
        command=command)
    print(md_path.read_text())
    return 0
