"""The ``rotarium`` command line: one sub-command per job, each defined beside the code it runs.

A module that adds commands exposes ``add_commands(subparsers)``, registering parsers whose defaults hold
``func`` (called with the parsed arguments).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "rotarium.training.cli",    # train
    "rotarium.evaluation.cli",  # eval, generate
    "rotarium.hub.cli",         # export, push
    "rotarium.hub.convert",     # convert
    "rotarium.synthetic.cli",   # synthetic
    "rotarium.synthetic.text",  # extrapolation
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rotarium", description="Train, evaluate, sample from, export, publish and "
                                     "convert rotarium models, and run the synthetic tasks.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `rotarium train` takes free-form `--section.key value` config overrides; other commands take none
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as error:  # bad input: a clear message, no traceback
        print(f"rotarium {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
