"""The verdict on a paper's claim, decided from per-seed numbers by one set of rules (docs/results.md, "How verdicts
are decided"). Every table that checks a claim (the synthetic sweeps, ``rotarium extrapolation`` and the RoVE
paper's table made by it) calls :func:`decide`.

A claim says that one column of a table (a positional option, ``rove+yarn``, ...) is ahead of others at one length.
The checks run in this order, the first that applies deciding, because each later one assumes the earlier passed: a
comparison of cells that cannot differ says nothing about regimes or gaps, and a gap the paper's regime never
produced says nothing about that regime.

1. *not measured*: fewer than :data:`MIN_SEEDS` seeds have every compared column.
2. *not testable at this scale*: every compared cell at a floor, or every one at a ceiling (:class:`Bound`).
3. *outside the paper's regime*: what the claim relies on (:class:`Precondition`) is absent in some seed.
4. *in distribution only* (a comparison beyond the training length, with cells at the training length): the
   option is ahead in some seed, and in every seed where it is, its gap is no wider than at the training length by
   the margin (the difference of differences, per seed).
5. *holds* when every seed counts, *does not hold* when none does, *mixed* otherwise. A seed counts when the option
   is ahead of the best other column by at least the margin and by more than the seeds' spread (and, beyond the
   training length, with a gap wider than at it by the margin); for a threshold claim (``solved``), when the option
   reaches the threshold and every other column stays short of it.

The spread is the largest range over the seeds of any compared column at the claim's length, in the claim's units
(for a relative scale, the range over the column's median): an effect no larger than how much one seed's model
differs from another's is not one the seeds can tell.

A cell that is not a finite number (a diverged run's NaN) is not measured, as a missing one. Amounts equal to within
floating-point rounding are equal (0.29 - 0.28 is one point, as 0.58 - 0.57 is): a lead of exactly the margin counts,
one of exactly the spread does not.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

HOLDS = "holds"
IN_DISTRIBUTION_ONLY = "in distribution only"
NOT_TESTABLE = "not testable at this scale"
OUTSIDE_REGIME = "outside the paper's regime"
MIXED = "mixed"
DOES_NOT_HOLD = "does not hold"
NOT_MEASURED = "not measured"
# The categories whose label carries the seed count; the tables print the reason of the others and of *in distribution
# only*, which a seed count alone does not explain.
COUNTED = (HOLDS, MIXED, DOES_NOT_HOLD, IN_DISTRIBUTION_ONLY)
EXPLAINED = (IN_DISTRIBUTION_ONLY, NOT_TESTABLE, OUTSIDE_REGIME)
FLOOR, CEILING = "floor", "ceiling"

# An accuracy within half a point of 0% or 100%: two such cells cannot differ by a one-point margin.
SATURATED = 0.005
# A mean NLL per token within a quarter of log(vocabulary) of a uniform guess: the answer's tokens get at most
# vocabulary^-3/4 of the probability each (1 in 512 for 4096 tokens), where a model that had found the answer gives
# it a probability near one.
NEAR_UNIFORM = 0.25
# "Degrades beyond the training length": a perplexity there above 1.5x its own at the training length, far more than
# a longer context or the seeds move a perplexity, far less than the collapse a length-extrapolation paper repairs.
DEGRADES = 1.5

# The seeds a verdict needs: a seed counts only by more than the seeds' spread, which one seed does not have and two
# barely sample; results are evidence only with three or more seeds (docs/results.md).
MIN_SEEDS = 3
# The relative rounding under which two amounts are one: differences of the tables' numbers (0.29 - 0.28 =
# 0.0099999...) land a few ulps off the amount they are.
ROUNDING = 1e-9

Table = Mapping[str, Mapping[int, float]]  # column -> seed -> number


@dataclass(frozen=True)
class Scale:
    """How a claim's numbers compare: ``lower_is_better`` (perplexity, NLL) or not (accuracy); ``margin``, the least
    effect that counts, as a fraction of the other column's value when ``relative``, else in the numbers' units."""

    name: str
    lower_is_better: bool
    margin: float
    relative: bool

    def best(self, values: Sequence[float]) -> float:
        return min(values) if self.lower_is_better else max(values)

    def effect(self, value: float, other: float) -> float:
        """How far ``value`` is ahead of ``other`` (negative when behind)."""
        gain = other - value if self.lower_is_better else value - other
        return gain / other if self.relative else gain

    def spread(self, values: Sequence[float]) -> float:
        width = max(values) - min(values)
        return width / statistics.median(values) if self.relative else width

    def amount(self, x: float) -> str:
        return f"{100 * x:.1f}%" if self.relative else f"{100 * x:.1f} points"

    def span(self, xs: Sequence[float]) -> str:
        return _span(xs, self.amount, " to ")

    def reaches(self, value: float, threshold: float) -> bool:
        return _at_least(threshold, value) if self.lower_is_better else _at_least(value, threshold)


def _at_least(x: float, bound: float) -> bool:
    """``x >= bound``, ``x`` within rounding (:data:`ROUNDING`) of ``bound`` included."""
    return x >= bound or math.isclose(x, bound, rel_tol=ROUNDING)


def _more_than(x: float, bound: float) -> bool:
    """``x > bound`` by more than rounding (:data:`ROUNDING`)."""
    return not _at_least(bound, x)


def _finite_cells(cells: Mapping[int, float]) -> dict[int, float]:
    """``cells`` (seed -> number) without those that are not finite numbers (a diverged run's NaN): they are not
    measured."""
    return {s: v for s, v in cells.items() if math.isfinite(v)}


def _finite(table: Table) -> dict[str, dict[int, float]]:
    """``table`` with :func:`_finite_cells` of every column."""
    return {column: _finite_cells(cells) for column, cells in table.items()}


@dataclass(frozen=True)
class Bound:
    """A floor (no better than a guess) or ceiling (saturated) of a cell: reached at or above ``threshold`` when
    ``above``, else at or below it. ``values``: the numbers it reads per column and seed (a RULER cell's generation
    score beside its NLL); ``None`` reads the compared numbers."""

    kind: str
    what: str
    threshold: float
    above: bool
    values: Table | None = None

    def reached(self, value: float) -> bool:
        return value >= self.threshold if self.above else value <= self.threshold


@dataclass(frozen=True)
class Precondition:
    """What the paper's claim relies on, per seed: ``values`` above ``factor`` times ``reference`` (a perplexity
    beyond the training length against the same model's at it)."""

    what: str
    values: Mapping[int, float]
    reference: Mapping[int, float]
    factor: float = DEGRADES


@dataclass(frozen=True)
class Verdict:
    """``category`` (one of this module's names), ``held`` of ``seeds`` seeds (for *in distribution only*: the seeds
    where the option is ahead), and why, in one line."""

    category: str
    held: int
    seeds: int
    reason: str

    def __str__(self) -> str:
        if self.category in COUNTED:
            return f"{self.category} ({self.held}/{self.seeds} seeds)"
        return self.category


def accuracy_bounds(values: Table | None = None) -> tuple[Bound, Bound]:
    """0% and 100% accuracy, within :data:`SATURATED`."""
    return (Bound(FLOOR, "0% accuracy", SATURATED, above=False, values=values),
            Bound(CEILING, "100% accuracy", 1 - SATURATED, above=True, values=values))


def generation_bounds(scores: Table) -> tuple[Bound, Bound]:
    """No generated answer right, every one right (``scores``: the fraction of right answers)."""
    return (Bound(FLOOR, "no generated answer right (0%)", 0.0, above=False, values=scores),
            Bound(CEILING, "every generated answer right (100%)", 1.0, above=True, values=scores))


def uniform_guess(vocab_size: int, values: Table | None = None, *, perplexity: bool = False) -> Bound:
    """A mean NLL per token (a perplexity with ``perplexity``) within :data:`NEAR_UNIFORM` of log(``vocab_size``)."""
    nats = (1 - NEAR_UNIFORM) * math.log(vocab_size)
    what = (f"{'perplexity' if perplexity else 'NLL'} within {100 * NEAR_UNIFORM:.0f}% of a uniform guess's "
            f"(log {vocab_size} = {math.log(vocab_size):.2f} nats)")
    return Bound(FLOOR, what, math.exp(nats) if perplexity else nats, above=True, values=values)


def _span(xs: Sequence[float], show: Callable[[float], str], joint: str) -> str:
    """The least and the largest of ``xs``, one of them where they read the same."""
    return joint.join(dict.fromkeys(show(x) for x in (min(xs), max(xs))))


def _names(columns: Sequence[str]) -> str:
    return " and ".join(columns)


def _at_bound(kind: str, bounds: Sequence[Bound], at: Table, cells: list[tuple[str, int]]) -> str | None:
    """Why every cell is at a bound of ``kind``, or ``None`` where one is not."""
    reached = []
    for bound in (b for b in bounds if b.kind == kind):
        values = at if bound.values is None else bound.values
        reached.append((bound, {(c, s) for c, s in cells if s in values.get(c, {}) and bound.reached(values[c][s])}))
    if not reached or set().union(*(hit for _, hit in reached)) != set(cells):
        return None
    return (f"every compared cell at a {kind}: "
            + "; ".join(f"{b.what} in {len(hit)}/{len(cells)}" for b, hit in reached if hit))


def _outcome(held: int, seeds: int) -> str:
    return HOLDS if held == seeds else DOES_NOT_HOLD if held == 0 else MIXED


def decide(option: str, against: Sequence[str], at: Table, scale: Scale, *, train: Table | None = None,
           solved: float | None = None, bounds: Sequence[Bound] = (),
           precondition: Precondition | None = None) -> Verdict:
    """The verdict on "``option`` is ahead of every column of ``against``" from the numbers ``at`` the claim's length,
    paired by seed. ``train``: the same columns at the training length, for a claim beyond it; ``solved``: a threshold
    claim instead (``option`` reaches it, every other column stays short); ``bounds``: the floors and ceilings of a
    cell; ``precondition``: what the paper's claim relies on. The checks and their order: the module's docstring."""
    columns = (option, *against)
    at, train = _finite(at), None if train is None else _finite(train)
    seeds = sorted(set.intersection(*(set(at.get(c, {})) for c in columns)))
    n = len(seeds)
    if not seeds:
        return Verdict(NOT_MEASURED, 0, 0, f"no seed has {_names(columns)} measured")
    if n < MIN_SEEDS:
        return Verdict(NOT_MEASURED, 0, n, f"{n} of the {MIN_SEEDS} seeds a verdict needs (to weigh an effect against "
                                           f"the seeds' spread) have {_names(columns)} measured")
    for kind in (FLOOR, CEILING):
        why = _at_bound(kind, bounds, at, [(c, s) for c in columns for s in seeds])
        if why:
            return Verdict(NOT_TESTABLE, 0, n, why)
    if precondition is not None:
        # a seed whose precondition is not measured (a diverged run's NaN) is not one where the regime is absent
        values, reference = _finite_cells(precondition.values), _finite_cells(precondition.reference)
        known = [s for s in seeds if s in values and s in reference]
        if len(known) < MIN_SEEDS:
            return Verdict(NOT_MEASURED, 0, len(known), f"{len(known)} of the {MIN_SEEDS} seeds a verdict needs have "
                                                        f"{precondition.what} measured")
        seeds, n = known, len(known)
        ratios = [values[s] / reference[s] for s in seeds]
        present = sum(ratio > precondition.factor for ratio in ratios)
        if present < n:
            measured = f", {_span(ratios, '{:.2f}'.format, '-')}x" if ratios else ""
            return Verdict(OUTSIDE_REGIME, 0, n, f"the claim relies on {precondition.what}: in {present}/{n} seeds"
                                                 f"{measured}")
    if solved is not None:
        held = sum(scale.reaches(at[option][s], solved) and not any(scale.reaches(at[c][s], solved) for c in against)
                   for s in seeds)
        return Verdict(_outcome(held, n), held, n, f"{option} reaching {solved:g} ({scale.name}) and "
                                                   f"{_names(against)} short of it in {held}/{n} seeds")

    def gap(table: Table, s: int) -> float:
        return scale.effect(table[option][s], scale.best([table[c][s] for c in against]))

    effect = {s: gap(at, s) for s in seeds}
    spread = max(scale.spread([at[c][s] for s in seeds]) for c in columns)
    ahead = [s for s in seeds if _at_least(effect[s], scale.margin)]
    lead = f"{option} ahead of {_names(against)} ({scale.name}) by {scale.span(list(effect.values()))}"
    paired = [s for s in seeds if train is not None and all(s in train.get(c, {}) for c in columns)]
    growth = {s: effect[s] - gap(train, s) for s in paired}
    # a seed without cells at the training length cannot show its gap widening
    widened = {s: not paired or _at_least(growth.get(s, -math.inf), scale.margin) for s in seeds}
    if paired and ahead and not any(widened[s] for s in ahead):
        return Verdict(IN_DISTRIBUTION_ONLY, len(ahead), n,
                       f"{lead}, ahead in {len(ahead)}/{n} seeds, but no wider than at the training length: the gap "
                       f"grows by {scale.span(list(growth.values()))}, under the margin {scale.amount(scale.margin)}")
    held = sum(s in ahead and _more_than(effect[s], spread) and widened[s] for s in seeds)
    wider = " and a gap wider than at the training length by the margin" if paired else ""
    return Verdict(_outcome(held, n), held, n,
                   f"{lead}; a seed counts with at least {scale.amount(scale.margin)}, more than the seeds' spread "
                   f"{scale.amount(spread)}{wider}: {held}/{n}")


def rules(scale: Scale) -> str:
    """The rules in a sentence, for the head of a table of verdicts."""
    return (f"Verdicts by the rules of docs/results.md (\"How verdicts are decided\"), paired by seed: *holds* when in "
            f"every seed the option is ahead by at least {scale.amount(scale.margin)} and by more than the seeds' "
            "spread (beyond the training length, with a gap wider than there); *in distribution only* when its gap "
            "beyond the training length is no wider than at it; *not testable at this scale* when every compared cell "
            "is at a floor or every one at a ceiling; *outside the paper's regime* when what the claim relies on is "
            "absent; *mixed (k/n seeds)* and *does not hold* otherwise.")


def reason_lines(verdicts: Sequence[tuple[str, str, Verdict]], columns: str) -> list[str]:
    """A bullet per row of a table of verdicts and reason, for the verdicts decided before the seeds were counted or by
    the gap at the training length: ``(row, column, verdict)`` triples, the columns of one reason joined after
    ``columns`` (``"context"``: "- fox, context 512, 1024: ..."). Empty when there is none."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for row, column, v in verdicts:
        if v.category in EXPLAINED:
            grouped.setdefault((row, v.category, v.reason), []).append(column)
    lines = [f"- {row}, {columns} {', '.join(at)}: {category}: {reason}."
             for (row, category, reason), at in grouped.items()]
    return [*lines, ""] if lines else []
