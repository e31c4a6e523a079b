"""The ``rotarium`` command line: one sub-command per job, each defined beside the code it runs.

A module that adds commands exposes ``add_commands(subparsers)``, registering parsers whose defaults hold
``func`` (called with the parsed arguments).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMAND_MODULES = (
    "rotarium.data.cli",        # prepare
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
    from rotarium.utils.interrupts import interrupts_recorded

    try:
        with interrupts_recorded():
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"rotarium {args.command}: interrupted", file=sys.stderr)
        return 130  # the shell's code for a command ended by SIGINT
    except expected_errors() as error:
        if os.environ.get("ROTARIUM_TRACEBACK"):
            raise
        print(f"rotarium {args.command}: error: {describe(error)}", file=sys.stderr)
        return 2


def expected_errors() -> tuple[type[BaseException], ...]:
    """What bad input or the machine raises, as opposed to a bug: bad values (``ValueError``, which the commands
    raise with a message naming the flag or file, and which JSON and Unicode decoding errors are), files that
    cannot be read or written (``OSError``), a damaged weights file, a pickle ``weights_only`` refuses, a YAML file
    that does not parse, and memory the device does not have."""
    import pickle

    import torch
    import yaml
    from safetensors import SafetensorError

    return (ValueError, OSError, SafetensorError, pickle.UnpicklingError, yaml.YAMLError, torch.OutOfMemoryError)


def describe(error: BaseException) -> str:
    """``error``'s message on one line, prefixed by its kind where the message alone does not say it."""
    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in message:
        message = f"{error.filename}: {message}"
    if not isinstance(error, ValueError):
        message = f"{type(error).__name__}: {message}"
    return message


if __name__ == "__main__":
    sys.exit(main())
