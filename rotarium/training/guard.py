"""Which training losses are healthy, and so which checkpoints are good.

A step's loss is bad when it is not finite or when it is a spike: above ``train.spike_factor`` times the reference
level, the lowest median of ``train.spike_window`` consecutive finite losses seen so far, and never more than
ln(vocabulary size), the loss of a uniform guess (the reference until a first window is full). The reference is the
lowest median rather than the latest one so that a slow blow-up, whose running median climbs with it, crosses the
threshold as surely as a sudden spike. A checkpoint is good when no step since the previous checkpoint (or since the
start) had a bad loss. So a run that recovers from a transient spike writes good checkpoints again, while the
checkpoints written during a blow-up, whose every interval holds bad steps, are never good.

The guard's counters are a part of the trainer state (:meth:`LossGuard.state_dict`, saved by every checkpoint), so
a resumed run goes on with them.
"""
from __future__ import annotations

import copy
import math
import statistics
from typing import Any


class LossGuard:
    """``observe(step, loss)`` after each step; ``checkpoint_verdict()`` when a checkpoint is written."""

    def __init__(self, spike_factor: float, window: int, vocab_size: int):
        self.spike_factor, self.window = spike_factor, window
        self.ceiling = math.log(vocab_size)
        self.state: dict[str, Any] = {"recent": [], "reference": None, "bad_since_good": 0,
                                      "first_bad_since_good": None, "bad_since_checkpoint": 0}

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Goes on with the counters a checkpoint saved (a key it lacks keeps its fresh value)."""
        self.state.update(copy.deepcopy({key: state[key] for key in self.state if key in state}))

    @property
    def threshold(self) -> float:
        reference = self.state["reference"]
        return self.spike_factor * min(self.ceiling, reference if reference is not None else math.inf)

    def observe(self, step: int, loss: float) -> str | None:
        """Records the loss of ``step``; returns why it is bad, or ``None`` when it is healthy."""
        problem = None
        if not math.isfinite(loss):
            problem = f"non-finite loss ({loss})"
        elif self.spike_factor and loss > self.threshold:
            problem = (f"loss {loss:.4g} above the spike threshold {self.threshold:.4g} "
                       f"(train.spike_factor={self.spike_factor:g} x the lowest running median)")
        if math.isfinite(loss):
            recent = self.state["recent"]
            recent.append(loss)
            del recent[:-self.window]
            if len(recent) == self.window:
                median = statistics.median(recent)
                reference = self.state["reference"]
                self.state["reference"] = median if reference is None else min(reference, median)
        if problem is not None:
            self.state["bad_since_checkpoint"] += 1
            self.state["bad_since_good"] += 1
            if self.state["first_bad_since_good"] is None:
                self.state["first_bad_since_good"] = {"step": step, "problem": problem}
        return problem

    @property
    def healthy_since_good(self) -> bool:
        return self.state["bad_since_good"] == 0

    def describe_trouble(self) -> str:
        """The bad steps since the last good checkpoint, in a few words."""
        first = self.state["first_bad_since_good"]
        if first is None:
            return "no bad step"
        return f"{self.state['bad_since_good']} bad step(s), the first at step {first['step']}: {first['problem']}"

    def checkpoint_verdict(self) -> dict[str, Any]:
        """What a checkpoint written now records in its trainer state: ``good`` and, if not, why. Starts the next
        interval, so call it once per checkpoint, before the trainer state is saved with it."""
        good = self.state["bad_since_checkpoint"] == 0
        verdict = {"good": True} if good else {"good": False, "why_not_good": self.describe_trouble()}
        self.state["bad_since_checkpoint"] = 0
        if good:
            self.state["bad_since_good"], self.state["first_bad_since_good"] = 0, None
        return verdict
