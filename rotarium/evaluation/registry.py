"""The evaluations ``rotarium eval`` runs, the only list of them: the command's flags, its refusals of a flag that
the evaluations asked for would ignore, and its help are read from here. Adding one is its :class:`EvalTask` class
and an entry below (docs/design.md, "Where an evaluation is declared")."""
from __future__ import annotations

import argparse

from rotarium.evaluation.downstream import LmEvalTasks
from rotarium.evaluation.perplexity import Perplexity
from rotarium.evaluation.ruler import Ruler
from rotarium.evaluation.tasks import EvalTask

# in the order the command runs them (and lists their flags)
EVAL_TASKS: dict[str, EvalTask] = {task.name: task for task in (Perplexity(), Ruler(), LmEvalTasks())}


def default_task() -> EvalTask:
    """The evaluation run when no selector flag is given (perplexity): the one without a selector."""
    defaults = [task for task in EVAL_TASKS.values() if task.selector is None]
    if len(defaults) != 1:
        raise RuntimeError(f"EVAL_TASKS must hold one evaluation without a selector flag, holds {len(defaults)}")
    return defaults[0]


def selectable() -> list[EvalTask]:
    """The evaluations asked for by a flag (``--ruler``, ``--tasks``), which replace the default one."""
    return [task for task in EVAL_TASKS.values() if task.selector is not None]


def asked_for(args: argparse.Namespace) -> list[EvalTask]:
    """The evaluations ``args`` asks for, in :data:`EVAL_TASKS`' order: those whose selector is given, else the
    default one."""
    return [task for task in selectable() if task.selected(args)] or [default_task()]
