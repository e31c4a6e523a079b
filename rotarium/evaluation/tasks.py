"""The interface every evaluation of ``rotarium eval`` has: perplexity, RULER's tasks, lm-eval's task sets.

An evaluation is an :class:`EvalTask`: its name, the flag that asks for it and the flags only it reads, the lengths
it runs at, the files it writes, and four steps the command takes in order: :meth:`EvalTask.prepare` (check its
settings and read what it needs, before the model loads), :meth:`EvalTask.evaluate` (run it on the loaded model, to a
result record), :meth:`EvalTask.summary` (the table the command prints) and :meth:`EvalTask.save` (its written
outputs). ``rotarium.evaluation.registry.EVAL_TASKS`` lists them; the command's flags, its refusals of a flag that
the evaluations asked for would ignore, and its help are read from that list, as lm-eval's task registry and
torchtitan's validator keep one definition per task and per setting.

Flags every evaluation reads keep one meaning: ``--context-lengths`` are the lengths it runs at (each evaluation's
:meth:`EvalTask.default_lengths` without it), ``--batch-size`` the sequences in one forward pass (perplexity's
windows, RULER's prompts, lm-eval's requests), and ``--rope-scaling`` names its files (:mod:`.outputs`).

The jobs that evaluate a model they have just trained (``rotarium train``'s evaluation at the end, ``rotarium
extrapolation``'s scoring) run the same tasks: they build an :class:`EvalRun` with :meth:`EvalRun.of` and hand
:meth:`EvalTask.evaluate` what :meth:`EvalTask.prepare` would have read (the texts they hold), so there is one way to
run an evaluation.
"""
from __future__ import annotations

import argparse
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Flag:
    """A command-line flag of one evaluation: its name and ``argparse``'s ``add_argument`` keywords. Its default is
    ``None`` (or ``False`` for a switch): the evaluation fills in its own, so a flag left out is told from one given."""
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def attribute(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def given(self, args: argparse.Namespace) -> bool:
        value = getattr(args, self.attribute, None)
        return value is not None and value is not False

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.name, **self.options)


@dataclass(frozen=True)
class EvalRun:
    """What the command hands every evaluation: its parsed flags, where results go (``what``: how messages name
    that folder) and ``--rope-scaling`` as ``rope_parameters`` (or None). A job that runs an evaluation itself may say
    how titles name the model (``label``; the ``--model`` folder's name by default), the length the model was trained
    at where it knows it (``train_length``; the model config's ``max_position_embeddings`` by default) and whether
    progress bars show (``progress``)."""
    args: argparse.Namespace
    output: Path
    what: str
    rope_scaling: dict[str, Any] | None = None
    label: str | None = None
    train_length: int | None = None
    progress: bool = True

    @classmethod
    def of(cls, model_name: str, output: str | os.PathLike, *, context_lengths: Sequence[int], batch_size: int,
           **settings: Any) -> EvalRun:
        """The run of a job other than the command (``rotarium train``, ``rotarium extrapolation``): the settings
        every evaluation reads (``model_name``, how records name the model; ``context_lengths``, ``batch_size``, and
        the other fields of this class as ``settings``). It hands :meth:`EvalTask.evaluate` what ``prepare`` would
        have read from an evaluation's own flags, so those are not set."""
        args = argparse.Namespace(model=model_name, context_lengths=list(context_lengths), batch_size=batch_size)
        return cls(args, Path(output), "the evaluation folder", **settings)

    @property
    def model_name(self) -> str:
        return self.args.model

    @property
    def local(self) -> bool:
        """Whether ``--model`` is a folder here (else a Hub id)."""
        return Path(self.args.model).exists()

    @property
    def scaled(self) -> str:
        """`` with RoPE scaling {...}`` under ``--rope-scaling``, else empty: what titles and headings add."""
        return f" with RoPE scaling {json.dumps(self.rope_scaling)}" if self.rope_scaling is not None else ""

    def title(self, what: str) -> str:
        """The title of a table or plot: the model's label (its folder name), its scaling, and ``what`` was
        measured."""
        label = self.label if self.label is not None else Path(self.model_name).name
        return f"{label}{self.scaled}: {what}"

    def lengths(self, task: EvalTask, train_length: int | None) -> list[int] | None:
        """``--context-lengths`` as given, else ``task``'s own defaults."""
        return self.args.context_lengths or task.default_lengths(train_length)

    def training_length(self, model: PreTrainedModel) -> int | None:
        """The length ``model`` was trained at: ``train_length`` where given, else :func:`training_length`."""
        return self.train_length if self.train_length is not None else training_length(model)


def training_length(model: PreTrainedModel) -> int | None:
    """The length ``model`` was trained at (its config's ``max_position_embeddings``), which tables mark."""
    return getattr(model.config, "max_position_embeddings", None)


class EvalTask(ABC):
    """One evaluation of ``rotarium eval``. Subclasses set the class attributes and the five methods; the command
    calls :meth:`prepare` for every evaluation asked for before loading the model once, then :meth:`evaluate`,
    prints :meth:`summary`, and calls :meth:`save` for each."""

    name: str                    # the registry's key
    selector: Flag | None = None  # the flag asking for it, whose value names its tasks; None: the evaluation run
    # when no selector is given (one evaluation, perplexity)
    flags: tuple[Flag, ...] = ()  # the flags only it reads: refused when it does not run
    result_files: tuple[str, ...] = ()  # the files :meth:`save` writes (renamed under --rope-scaling), checked first
    lengths_help: str = ""       # its default lengths in words, for --context-lengths' help

    @property
    def label(self) -> str:
        """How messages name it: its selector (``--ruler``), or its name for the default evaluation."""
        return self.selector.name if self.selector is not None else self.name

    def choices(self) -> Sequence[str] | None:
        """The task names its selector takes, where they are a fixed list (RULER's); None where they are not."""
        return None

    def selected(self, args: argparse.Namespace) -> bool:
        return self.selector is not None and self.selector.given(args)

    @abstractmethod
    def default_lengths(self, train_length: int | None) -> list[int] | None:
        """The context lengths it runs at without ``--context-lengths``, from the model's training length (None when
        the model has none); None: the lengths are the evaluation's own affair (lm-eval's tasks)."""

    @abstractmethod
    def prepare(self, run: EvalRun) -> Any:
        """Checks its flags and where its results go, and reads what it needs, before the model loads: raises
        ``ValueError`` naming the flag. What it returns is handed to :meth:`evaluate`."""

    @abstractmethod
    def evaluate(self, prepared: Any, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 run: EvalRun) -> dict[str, Any]:
        """Runs on the loaded ``model``: the result record that :meth:`summary` and :meth:`save` read."""

    @abstractmethod
    def summary(self, record: dict[str, Any], run: EvalRun) -> str:
        """What the command prints of ``record``: its table, with a heading where it has one."""

    @abstractmethod
    def save(self, record: dict[str, Any], run: EvalRun) -> tuple[Path, ...]:
        """Writes :attr:`result_files` into ``run.output`` (named after ``run.rope_scaling``); returns their paths."""

    def wrote(self, paths: Sequence[Path]) -> str:
        """The line the command prints after :meth:`save`."""
        return f"wrote {', '.join(map(str, paths))}"


def listing(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
