"""What a checkpoint carries across a resume, one owner per part.

Each part that a resumed run must go on with is an object with ``state_dict()`` and ``load_state_dict()``, as
torch's optimizer is and torchtitan's components are (``Stateful``): the loop's counters (:class:`LoopCounters`),
the loss guard (:class:`~rotarium.training.guard.LossGuard`) and the data position (the training loader's,
:class:`~rotarium.data.loader.TrainLoader`). :class:`TrainerState` saves and loads them by name into the
checkpoint's ``trainer_state.json``: the counters' keys at its top level, each other part under its name
(``guard``, ``data``), the keys every rotarium has written there. The weights, the optimizer and the RNG states are
accelerate's (``state/``), saved and loaded by ``save_state``/``load_state``.

A part a checkpoint does not hold (one written before rotarium saved that part) is left as it was built: the guard's
counters start afresh, the data position is the one the step implies.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Stateful(Protocol):
    """A part of the training state: what it saves, and how it goes on from what it saved."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class LoopCounters:
    """The loop's counters: the optimizer steps taken, the tokens trained on, and the non-finite steps (in a row,
    and skipped in all)."""
    step: int = 0
    tokens: int = 0
    bad_steps_in_a_row: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            if isinstance(state.get(field.name), int):
                setattr(self, field.name, state[field.name])


class TrainerState:
    """``trainer_state.json`` from its parts: ``counters`` at the top level, each of ``parts`` under its name.
    :meth:`load_state_dict` loads the counters first, so a part restored after them may read the step they hold; a
    part the state lacks loads an empty one."""

    def __init__(self, counters: LoopCounters, parts: dict[str, Stateful]):
        self.counters, self.parts = counters, parts

    def state_dict(self) -> dict[str, Any]:
        return {**self.counters.state_dict(), **{name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state)
        for name, part in self.parts.items():
            part.load_state_dict(state[name] if isinstance(state.get(name), dict) else {})


class SavedPart:
    """A part as a checkpoint saved it, held rather than applied: what ``--resume``'s checks read of a checkpoint
    (the data position it recorded) before the run's own parts exist."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.saved)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state


class PositionedLoader(Protocol):
    """A training loader whose position a checkpoint records (:class:`~rotarium.data.loader.TrainLoader`)."""

    def position(self, step: int) -> dict[str, Any]: ...

    def restore(self, step: int, position: dict[str, Any]) -> None: ...


class DataPosition:
    """The data position as a part: ``loader``'s position before the counters' step, each process's entries under
    ``processes`` gathered by ``gather`` (a collective, so taken on every process, only when a checkpoint is
    written); loaded, it restores the loader at the counters' step, before its first batch."""

    def __init__(self, loader: PositionedLoader, counters: LoopCounters,
                 gather: Callable[[list[Any]], list[Any]]):
        self.loader, self.counters, self.gather = loader, counters, gather

    def state_dict(self) -> dict[str, Any]:
        position = self.loader.position(self.counters.step)
        if "processes" in position:
            position["processes"] = self.gather(position["processes"])
        return position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.restore(self.counters.step, state)
