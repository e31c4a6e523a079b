"""``rotarium synthetic TASK`` (one run) and ``rotarium synthetic sweep TASK`` (every family x positional option)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable

import yaml

from rotarium.utils.argtypes import int_list

EPILOG = """\
tasks (CPU defaults in brackets; a sweep of 4 families x 4 options x 3 seeds prints its expected time first):
  mqar     multi-query associative recall [trained at length 32 with 4 pairs, vocabulary 32, evaluated at 32, 64
           and 128; width 64, 4 heads, 1500 steps of 32; paper: 512, 64 pairs, 8192]
  copying  copy a string of 26 letters [trained on lengths 2-24, evaluated at 24, 48, 96, 192; width 96, 4 heads,
           1000 steps of 20; paper: 2-64, evaluated up to 512]
  s2       word problem of S2 (parity) [1 layer, width 64, trained at length 32, evaluated at 32, 128 (4x) and
           512 (16x); a sweep tries lr 1e-3, 3e-3 and 1e-2; paper: length 128, evaluated at 512]
  a3       word problem of A3 (= Z3), same settings as s2 (no --paper: the reference has no A3 setting)

--paper takes the Selective RoPE reference's setting of mqar, copying or s2 (model family, depth, width, heads,
short convolution, Selective RoPE temperature, bias and phase gate, optimiser, lengths), scaled down only in
steps, batch and width, and prints the scaling; explicit flags win. docs/reference_settings.md maps every option.

examples:
  rotarium synthetic s2 --family transformer --position selective_rope --option selective_rope_decay=false
  rotarium synthetic sweep copying --output-dir docs/synthetic   (prints its expected time; a rerun resumes)
"""


def choice_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose among {', '.join(choices)}; got {text!r}")
        return values
    return parse


def _option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--option takes KEY=VALUE (a model-config field), got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def _float_list(flag: str):
    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes numbers separated by commas, got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be positive numbers, got {text!r}")
        return values
    return parse


def _common(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    from rotarium.synthetic.runner import FAMILIES, POSITIONS

    size = parser.add_argument_group("model and training (default: the task's CPU setting)")
    size.add_argument("--layers", type=int, default=None, help="number of blocks")
    size.add_argument("--hidden-size", type=int, default=None, help="model width")
    size.add_argument("--heads", type=int, default=None, help="attention / recurrent heads")
    size.add_argument("--steps", type=int, default=None, help="training steps (a fresh batch each)")
    size.add_argument("--batch-size", type=int, default=None, help="sequences per step and per evaluation batch")
    if sweep:
        size.add_argument("--lr", type=_float_list("--lr"), default=None,
                          help="peak learning rate(s), comma-separated: each is a row of the table (warmup 10%%, "
                               "cosine to 10%%)")
    else:
        size.add_argument("--lr", type=float, default=None, help="peak learning rate (warmup 10%%, cosine to 10%%)")
    size.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                      help="a model-config field, e.g. selective_rope_decay=false or rope_theta=500 (repeatable)")
    task = parser.add_argument_group("task")
    task.add_argument("--train-length", type=int, default=None,
                      help="training sequence length (copying: the longest string; s2/a3: the word length)")
    task.add_argument("--eval-lengths", type=int_list("--eval-lengths"), default=None,
                      help="comma-separated evaluation lengths")
    task.add_argument("--num-pairs", type=int, default=None, help="mqar: key-value pairs per sequence")
    task.add_argument("--vocab-size", type=int, default=None, help="mqar: vocabulary size")
    task.add_argument("--paper", action="store_true",
                      help="the Selective RoPE reference's setting of the task, scaled down for a CPU (see below)")
    task.add_argument("--eval-batches", type=int, default=4, help="evaluation batches per length (default 4)")
    if sweep:
        parser.add_argument("--seeds", type=int_list("--seeds", minimum=0), default=[0, 1, 2],
                            help="comma-separated seeds, each a run of every cell (default 0,1,2)")
        parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                            help="runs at a time, one process and one thread each (default: 2, or 1 on one core)")
    else:
        parser.add_argument("--seed", type=int, default=0, help="seed of the model and the training batches")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (default cpu)")
    parser.set_defaults(families=FAMILIES, positions=POSITIONS)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from rotarium.synthetic.runner import FAMILIES, POSITIONS
    from rotarium.synthetic.tasks import TASKS

    synthetic = subparsers.add_parser(
        "synthetic", help="train small models on MQAR, copying or state tracking and report accuracy",
        description="Synthetic tasks generated on the fly (no data files): one run, or a sweep over every "
                    "family x positional option that writes a Markdown table, a CSV and a PNG plot.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tasks = synthetic.add_subparsers(dest="synthetic_command", metavar="TASK")
    for name, spec in TASKS.items():
        run = tasks.add_parser(name, help=spec.description, description=f"One run of {name}: {spec.description}.")
        run.add_argument("--family", choices=FAMILIES, default=None,
                         help="model family (default: transformer; with --paper the reference's)")
        run.add_argument("--position", choices=POSITIONS, default="selective_rope", help="positional option")
        run.add_argument("--json", action="store_true", help="print the result as JSON")
        _common(run)
        run.set_defaults(func=run_one, task=name)
    sweep = tasks.add_parser(
        "sweep", help="every family x positional option x seed of a task: table, CSV, plot",
        description="Runs every family x positional option x lr x seed of TASK and writes TASK.md (median and "
                    "min-max over seeds, the papers' claims checked seed by seed), TASK.csv and TASK.png into "
                    "--output-dir. Each run is saved as it ends; running it again skips the runs already there "
                    "(--rerun: not). Prints the expected time first.")
    sweep.add_argument("task", choices=list(TASKS), help="the task")
    sweep.add_argument("--families", type=choice_list(FAMILIES), default=list(FAMILIES),
                       help=f"comma-separated subset of {','.join(FAMILIES)}")
    sweep.add_argument("--positions", type=choice_list(POSITIONS), default=list(POSITIONS),
                       help=f"comma-separated subset of {','.join(POSITIONS)}")
    sweep.add_argument("--output-dir", default="docs/synthetic", help="where the table, CSV and plot go")
    sweep.add_argument("--rerun", action="store_true", help="run every combination again")
    sweep.add_argument("--report-only", action="store_true",
                       help="train nothing: write the table of the runs already in the CSV (partial if some are not)")
    _common(sweep, sweep=True)
    sweep.set_defaults(func=run_sweep)
    synthetic.set_defaults(func=lambda args: synthetic.print_help() or 2)


def _settings(args: argparse.Namespace, family: str | None = None, position: str = "selective_rope",
              lr: float | None = None, seed: int = 0):
    """The run's settings, unresolved (a sweep resolves each family on its own), after printing what a --paper run
    scales down or cannot express."""
    from rotarium.synthetic.runner import RunSettings, paper_scaling

    settings = RunSettings(
        task=args.task, family=family, position=position, num_layers=args.layers, hidden_size=args.hidden_size,
        num_heads=args.heads, steps=args.steps, batch_size=args.batch_size, lr=lr,
        train_length=args.train_length, eval_lengths=args.eval_lengths, num_pairs=args.num_pairs,
        vocab_size=args.vocab_size, eval_batches=args.eval_batches, seed=seed, model_options=dict(args.option),
        device=args.device, paper=args.paper)
    for line in paper_scaling(settings):  # on stderr, so that --json output stays one JSON line
        print(f"--paper: {line}", file=sys.stderr)
    return settings


def run_one(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rotarium.synthetic.runner import train_and_evaluate

    result = train_and_evaluate(_settings(args, args.family, args.position, args.lr, args.seed).resolved())
    if args.json:
        print(json.dumps({"settings": asdict(result.settings), "train_loss": result.train_loss,
                          "train_seconds": result.train_seconds, "parameters": result.parameters,
                          "evaluations": result.evaluations}))
        return 0
    s = result.settings
    print(f"{s.task}, {s.family} with {s.position}: {result.parameters:,} parameters, {s.steps} steps in "
          f"{result.train_seconds:.0f} s, final training loss {result.train_loss:.4f}")
    print("| length | token accuracy | sequence accuracy |\n|---:|---:|---:|")
    for e in result.evaluations:
        beyond = " (beyond training)" if e["length"] > s.train_length else ""
        print(f"| {e['length']}{beyond} | {e['accuracy']:.4f} | {e['sequence_accuracy']:.4f} |")
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from rotarium.synthetic.sweep import sweep

    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    base = _settings(args)
    # the command that regenerates the table (a --report-only table is one the same command completes)
    argv = [a for a in sys.argv[1:] if a != "--report-only"]
    command = "rotarium " + " ".join(shlex.quote(a) for a in argv) if argv[:1] == ["synthetic"] else None
    csv_path, md_path, png_path = sweep(base, args.output_dir, families=tuple(args.families),
                                        positions=tuple(args.positions), lrs=tuple(args.lr or ()),
                                        seeds=tuple(args.seeds), command=command, rerun=args.rerun, jobs=args.jobs,
                                        report_only=args.report_only)
    print(md_path.read_text())
    print(f"wrote {md_path}, {csv_path} and {png_path}")
    return 0
