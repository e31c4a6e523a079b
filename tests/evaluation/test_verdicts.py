"""The verdict rules (rotarium/evaluation/verdicts.py, docs/results.md "How verdicts are decided") on hand-made
per-seed tables: one for each category, the issue's cases among them, and the order of the checks."""
import math

import pytest

from rotarium.evaluation.verdicts import (
    DEGRADES,
    DOES_NOT_HOLD,
    HOLDS,
    IN_DISTRIBUTION_ONLY,
    MIXED,
    NOT_MEASURED,
    NOT_TESTABLE,
    OUTSIDE_REGIME,
    Precondition,
    Scale,
    Verdict,
    accuracy_bounds,
    decide,
    generation_bounds,
    uniform_guess,
)

PERPLEXITY = Scale("perplexity", lower_is_better=True, margin=0.01, relative=True)
ACCURACY = Scale("token accuracy", lower_is_better=False, margin=0.01, relative=False)


def seeds(*values):
    return dict(enumerate(values))


def test_holds_needs_every_seed_ahead_by_more_than_the_seeds_spread():
    at = {"rove": seeds(80.0, 82.0, 81.0), "rope": seeds(100.0, 101.0, 99.0)}
    verdict = decide("rove", ("rope",), at, PERPLEXITY)
    assert (verdict.category, verdict.held, verdict.seeds) == (HOLDS, 3, 3)
    assert str(verdict) == "holds (3/3 seeds)"
    assert "rove ahead of rope (perplexity) by" in verdict.reason and "spread 2.5%" in verdict.reason


def test_an_effect_in_every_seed_but_within_the_seeds_spread_does_not_hold():
    """FoX at 16x in the RoVE-paper table: about 1-3% ahead in every seed, where the seeds span 83-112."""
    at = {"rove": seeds(81.7, 99.4, 108.6), "rope": seeds(82.6, 101.8, 111.5)}
    verdict = decide("rove", ("rope",), at, PERPLEXITY)
    assert str(verdict) == "does not hold (0/3 seeds)"
    assert "1.1% to 2.6%" in verdict.reason and "spread 28.4%" in verdict.reason


def test_mixed_counts_the_seeds_paired_not_the_medians():
    # the medians say RoVE ahead (0.60 against 0.32); seed 2 says the opposite
    at = {"rove": seeds(0.60, 0.62, 0.55), "rope": seeds(0.30, 0.32, 0.58)}
    assert str(decide("rove", ("rope",), at, ACCURACY)) == "mixed (2/3 seeds)"
    # within the margin is not ahead
    assert str(decide("rove", ("rope",), {"rove": seeds(0.305, 0.306, 0.304), "rope": seeds(0.30, 0.30, 0.30)},
                       ACCURACY)) == "does not hold (0/3 seeds)"


def test_the_option_must_be_ahead_of_every_other_column():
    at = {"selective_rope": seeds(0.99, 0.9, 0.98), "nope": seeds(0.7, 0.95, 0.7),  # NoPE ahead in seed 1
          "rope": seeds(0.6, 0.6, 0.6)}
    verdict = decide("selective_rope", ("nope", "rope"), at, ACCURACY)
    assert (verdict.category, verdict.held) == (MIXED, 2)


def test_a_threshold_claim_needs_the_option_there_and_the_others_short_of_it():
    at = {"selective_rope": seeds(1.0, 0.995, 0.97), "nope": seeds(0.6, 0.6, 0.6), "rope": seeds(0.7, 0.99, 0.7)}
    verdict = decide("selective_rope", ("nope", "rope"), at, ACCURACY, solved=0.99)
    assert str(verdict) == "mixed (1/3 seeds)"  # seed 1: RoPE solves it too; seed 2: not solved
    assert "reaching 0.99 (token accuracy)" in verdict.reason


def test_not_measured_without_a_seed_that_has_every_column():
    verdict = decide("rove", ("rope",), {"rove": seeds(1.0), "rope": {1: 2.0}}, PERPLEXITY)
    assert verdict == Verdict(NOT_MEASURED, 0, 0, "no seed has rove and rope measured")
    assert str(verdict) == "not measured"


@pytest.mark.parametrize("rove", [0.9, 0.1, 1.0])
def test_fewer_than_three_seeds_decide_nothing(rove):
    """A partial sweep's first seeds: far ahead, far behind or solved, one seed has no spread to exceed and two barely
    sample it, so a verdict from them would be their own noise's (docs/results.md: three seeds or more)."""
    at = {"rove": {2: rove}, "rope": {0: 0.5, 1: 0.5, 2: 0.3}}
    for measured in (1, 2):
        for solved in (None, 0.99):
            verdict = decide("rove", ("rope",), at, ACCURACY, solved=solved)
            assert verdict == Verdict(NOT_MEASURED, 0, measured, f"{measured} of the 3 seeds a verdict needs (to weigh "
                                      "an effect against the seeds' spread) have rove and rope measured")
        at["rove"][1] = rove
    # a third seed makes the same numbers a verdict
    at["rove"][0] = rove
    assert decide("rove", ("rope",), at, ACCURACY).category != NOT_MEASURED


@pytest.mark.parametrize("transformer", [False, True])
def test_a_gap_beyond_training_no_wider_than_at_it_is_in_distribution_only(transformer):
    """The issue's cases, per seed from the text tables: FoX's RoVE 7.2% below RoPE at 128 and 7.2% at 1024; the
    Transformer's RoVE perplexity rising more than RoPE's beyond training, +7.9% against +5.1% (its gap
    narrows)."""
    if transformer:
        train = {"rove": seeds(110.3, 108.0, 112.0), "rope": seeds(143.1, 140.0, 146.0)}
        at = {c: {s: x * (1.079 if c == "rove" else 1.051) for s, x in v.items()} for c, v in train.items()}
    else:
        train = {"rove": seeds(85.3, 73.3, 89.1), "rope": seeds(91.9, 80.4, 96.2)}
        at = {"rove": seeds(84.5, 72.5, 88.4), "rope": seeds(91.1, 79.6, 95.3)}
    verdict = decide("rove", ("rope",), at, PERPLEXITY, train=train)
    assert (verdict.category, verdict.held, verdict.seeds) == (IN_DISTRIBUTION_ONLY, 3, 3)
    assert str(verdict) == "in distribution only (3/3 seeds)"
    assert "no wider than at the training length" in verdict.reason
    # the same numbers at the training length itself: a plain comparison, decided by the seeds
    assert decide("rove", ("rope",), train, PERPLEXITY).category != IN_DISTRIBUTION_ONLY


def test_a_gap_that_widens_beyond_training_holds_and_one_seed_widening_is_mixed():
    train = {"rove": seeds(100.0, 100.0, 100.0), "rope": seeds(100.0, 100.0, 100.0)}
    at = {"rove": seeds(101.0, 101.5, 101.2), "rope": seeds(150.0, 151.0, 149.0)}
    assert str(decide("rove", ("rope",), at, PERPLEXITY, train=train)) == "holds (3/3 seeds)"
    # seed 0's gap is the one it had at the training length, seeds 1 and 2 widen
    train = {"rove": seeds(67.0, 100.0, 100.0), "rope": seeds(100.0, 100.0, 100.0)}
    verdict = decide("rove", ("rope",), at, PERPLEXITY, train=train)
    assert str(verdict) == "mixed (2/3 seeds)" and "wider than at the training length" in verdict.reason


def test_a_beyond_claim_without_cells_at_the_training_length_is_decided_by_its_own_length():
    """RULER's vt fits no prompt at the training length: the gap's growth cannot be checked, the comparison can."""
    at = {"rove": seeds(1.0, 1.0, 1.0), "rope": seeds(2.0, 2.0, 2.0)}
    assert str(decide("rove", ("rope",), at, PERPLEXITY, train={})) == "holds (3/3 seeds)"
    # a seed with no cell there cannot show a widening gap when the others can
    train = {"rove": seeds(1.9), "rope": seeds(2.0)}
    assert str(decide("rove", ("rope",), at, PERPLEXITY, train=train)) == "mixed (1/3 seeds)"


def test_behind_everywhere_is_does_not_hold_not_in_distribution_only():
    train = {"rove": seeds(120.0, 121.0, 122.0), "rope": seeds(100.0, 100.0, 100.0)}
    at = {"rove": seeds(125.0, 126.0, 127.0), "rope": seeds(100.0, 101.0, 100.0)}
    assert decide("rove", ("rope",), at, PERPLEXITY, train=train).category == DOES_NOT_HOLD


def test_ruler_at_zero_percent_with_nlls_of_a_uniform_guess_is_not_testable():
    """The issue's case: no generation holds an answer and every NLL sits near log(4096) = 8.3 nats."""
    vocab = 4096
    assert math.log(vocab) == pytest.approx(8.318, abs=1e-3)
    nll = {"rove": seeds(7.13, 7.11, 7.15), "rope": seeds(8.27, 8.01, 8.54)}
    scores = {"rove": seeds(0.0, 0.0, 0.0), "rope": seeds(0.0, 0.0, 0.0)}
    bounds = (uniform_guess(vocab), *generation_bounds(scores))
    verdict = decide("rove", ("rope",), nll, PERPLEXITY, bounds=bounds)
    assert (verdict.category, str(verdict)) == (NOT_TESTABLE, "not testable at this scale")
    assert verdict.reason == ("every compared cell at a floor: NLL within 25% of a uniform guess's (log 4096 = 8.32 "
                              "nats) in 6/6; no generated answer right (0%) in 6/6")
    # one cell where a model generates an answer makes the comparison testable again
    scores = {"rove": seeds(0.05, 0.0, 0.0), "rope": seeds(0.0, 0.0, 0.0)}
    nll = {"rove": seeds(2.0, 1.9, 2.1), "rope": seeds(8.27, 8.01, 8.54)}
    bounds = (uniform_guess(vocab), *generation_bounds(scores))
    assert decide("rove", ("rope",), nll, PERPLEXITY, bounds=bounds).category == HOLDS


def test_a_perplexity_near_the_vocabulary_size_is_a_floor():
    bound = uniform_guess(4096, perplexity=True)
    assert bound.threshold == pytest.approx(4096 ** 0.75)
    at = {"rove": seeds(3000.0, 2900.0, 3100.0), "rope": seeds(4000.0, 4090.0, 4050.0)}
    assert decide("rove", ("rope",), at, PERPLEXITY, bounds=(bound,)).category == NOT_TESTABLE
    at = {"rove": seeds(300.0, 290.0, 310.0), "rope": seeds(4000.0, 4090.0, 4050.0)}
    assert decide("rove", ("rope",), at, PERPLEXITY, bounds=(bound,)).category == HOLDS


def test_every_cell_at_the_ceiling_is_not_testable_but_one_seed_below_it_is_compared():
    """MQAR at the training length: DeltaNet is 100% (99.8% once) with every option; GLA + RoPE is 76.4% in seed 1,
    so GLA's cells do not all saturate and the claim is decided by the seeds."""
    deltanet = {"selective_rope": seeds(1.0, 0.998, 1.0), "rope": seeds(1.0, 1.0, 1.0)}
    verdict = decide("selective_rope", ("rope",), deltanet, ACCURACY, bounds=accuracy_bounds())
    assert verdict.category == NOT_TESTABLE and verdict.reason == (
        "every compared cell at a ceiling: 100% accuracy in 6/6")
    gla = {"selective_rope": seeds(1.0, 1.0, 0.9941), "rope": seeds(0.9902, 0.7637, 0.9883)}
    verdict = decide("selective_rope", ("rope",), gla, ACCURACY, bounds=accuracy_bounds())
    assert str(verdict) == "mixed (1/3 seeds)"


def test_a_floor_and_a_ceiling_side_by_side_are_a_difference_not_a_saturation():
    at = {"selective_rope": seeds(1.0, 1.0, 1.0), "rope": seeds(0.0, 0.0, 0.0)}
    assert str(decide("selective_rope", ("rope",), at, ACCURACY, bounds=accuracy_bounds())) == "holds (3/3 seeds)"
    at = {"selective_rope": seeds(0.0, 0.003, 0.0), "rope": seeds(0.0, 0.0, 0.0)}
    verdict = decide("selective_rope", ("rope",), at, ACCURACY, bounds=accuracy_bounds())
    assert verdict.category == NOT_TESTABLE and "at a floor: 0% accuracy in 6/6" in verdict.reason


def yarn_regime(rope_train, rope_beyond):
    return Precondition("RoPE degrading beyond the training length", seeds(*rope_beyond), seeds(*rope_train))


def test_yarn_without_rope_degrading_is_outside_the_papers_regime():
    """RoVE + YaRN: YaRN repairs RoPE beyond its training length; where RoPE's perplexity hardly rises there (the
    Transformer of the RoVE-paper table: 139-169 at 256, 161-189 at 4096) there is nothing to repair."""
    at = {"rove+yarn": seeds(104.6, 142.1, 139.0), "rove": seeds(110.6, 139.9, 139.3),
          "rope+yarn": seeds(152.5, 180.3, 183.3)}
    regime = yarn_regime((139.4, 169.0, 169.5), (161.5, 180.6, 189.5))
    verdict = decide("rove+yarn", ("rove", "rope+yarn"), at, PERPLEXITY, precondition=regime)
    assert (verdict.category, str(verdict)) == (OUTSIDE_REGIME, "outside the paper's regime")
    assert verdict.reason == ("the claim relies on RoPE degrading beyond the training length: in 0/3 seeds, "
                              "1.07-1.16x")
    # RoPE degrading in every seed: the claim is decided by the seeds
    regime = yarn_regime((100.0, 100.0, 100.0), (400.0, 500.0, DEGRADES * 100.0 + 1))
    at = {"rove+yarn": seeds(50.0, 51.0, 50.5), "rove": seeds(80.0, 81.0, 80.5), "rope+yarn": seeds(70.0, 71.0, 70.5)}
    assert str(decide("rove+yarn", ("rove", "rope+yarn"), at, PERPLEXITY, precondition=regime)) == (
        "holds (3/3 seeds)")
    # ... and in one seed only: still outside it, as a claim needs every seed
    regime = yarn_regime((100.0, 100.0, 100.0), (400.0, 110.0, 120.0))
    verdict = decide("rove+yarn", ("rove", "rope+yarn"), at, PERPLEXITY, precondition=regime)
    assert verdict.category == OUTSIDE_REGIME and "in 1/3 seeds" in verdict.reason


def test_the_checks_run_in_order_floor_then_regime_then_in_distribution_then_seeds():
    nll = {"rove": seeds(8.2, 8.1, 8.15), "rope": seeds(8.3, 8.25, 8.28)}
    regime = yarn_regime((100.0, 100.0, 100.0), (101.0, 101.0, 101.0))  # absent too
    train = {"rove": seeds(8.2, 8.1, 8.15), "rope": seeds(8.3, 8.25, 8.28)}
    assert decide("rove", ("rope",), nll, PERPLEXITY, train=train, bounds=(uniform_guess(4096),),
                  precondition=regime).category == NOT_TESTABLE
    at = {"rove": seeds(80.0, 81.0, 80.5), "rope": seeds(100.0, 101.0, 100.5)}
    assert decide("rove", ("rope",), at, PERPLEXITY, train=at, bounds=(uniform_guess(4096, perplexity=True),),
                  precondition=regime).category == OUTSIDE_REGIME
    present = yarn_regime((100.0, 100.0, 100.0), (200.0, 200.0, 200.0))
    assert decide("rove", ("rope",), at, PERPLEXITY, train=at, precondition=present).category == (
        IN_DISTRIBUTION_ONLY)


def test_a_cell_that_is_not_a_number_is_not_measured_whatever_the_column_order():
    """A diverged run's NaN perplexity is no measurement: its seed is left out as a missing cell's is, and neither the
    order of the other columns nor the spread (NaN beside numbers) decides the verdict."""
    nan = math.nan
    at = {"rove": seeds(100.0, 101.0, 100.5, 100.2), "rope": seeds(150.0, 151.0, 152.0, 150.5),
          "nope": seeds(nan, 160.0, 161.0, 160.5)}
    for against in (("rope", "nope"), ("nope", "rope")):
        assert str(decide("rove", against, at, PERPLEXITY)) == "holds (3/3 seeds)"
    # in the option's own column, and in the cells at the training length (a seed without them cannot widen)
    at = {"rove": seeds(nan, 101.0, 100.5, 100.2), "rope": seeds(150.0, 151.0, 152.0, 150.5)}
    assert str(decide("rove", ("rope",), at, PERPLEXITY)) == "holds (3/3 seeds)"
    train = {"rove": seeds(120.0, 120.0, nan, 120.0), "rope": seeds(150.0, 151.0, 152.0, 150.5)}
    assert str(decide("rove", ("rope",), at, PERPLEXITY, train=train)) == "mixed (2/3 seeds)"
    # too few seeds left with numbers
    at["rope"] = seeds(150.0, nan, 152.0, nan)
    assert decide("rove", ("rope",), at, PERPLEXITY).category == NOT_MEASURED


@pytest.mark.parametrize(("option", "other"), [((0.29, 0.291, 0.292), (0.28, 0.281, 0.282)),
                                               ((0.58, 0.581, 0.582), (0.57, 0.571, 0.572))])
def test_a_lead_of_exactly_the_margin_counts_whatever_the_rounding_of_the_difference(option, other):
    """0.29 - 0.28 is 0.00999... in binary floating point, 0.58 - 0.57 is 0.01000...: both are one point, which the
    rules count ("at least the margin"); and a lead of exactly the seeds' spread does not ("more than")."""
    at = {"rove": seeds(*option), "rope": seeds(*other)}
    assert str(decide("rove", ("rope",), at, ACCURACY)) == "holds (3/3 seeds)"
    train = {"rove": seeds(0.5, 0.5, 0.5), "rope": seeds(0.5, 0.5, 0.5)}  # a gap of 0 at the training length
    assert str(decide("rove", ("rope",), at, ACCURACY, train=train)) == "holds (3/3 seeds)"
    assert str(decide("rove", ("rope",), at, ACCURACY, solved=option[0])) == "holds (3/3 seeds)"
    spread = {"rove": seeds(0.22, 0.23, 0.24), "rope": seeds(0.20, 0.21, 0.22)}  # ahead by 2 points, spread 2 points
    assert str(decide("rove", ("rope",), spread, ACCURACY)) == "does not hold (0/3 seeds)"


def test_a_seed_whose_precondition_is_not_a_number_is_not_measured():
    """A diverged RoPE run's NaN perplexity says nothing of whether RoPE degrades: that seed leaves the verdict, and
    with fewer than three seeds left the claim is not measured, not outside the paper's regime."""
    at = {"rove+yarn": seeds(50.0, 51.0, 50.5, 50.2), "rove": seeds(80.0, 81.0, 80.5, 80.2),
          "rope+yarn": seeds(70.0, 71.0, 70.5, 70.2)}
    degrading = DEGRADES * 100.0 + 1
    regime = yarn_regime((100.0, 100.0, 100.0, 100.0), (degrading, degrading, degrading, float("nan")))
    assert str(decide("rove+yarn", ("rove", "rope+yarn"), at, PERPLEXITY, precondition=regime)) == (
        "holds (3/3 seeds)")
    regime = yarn_regime((100.0, 100.0, float("nan"), 100.0), (degrading, degrading, degrading, float("nan")))
    verdict = decide("rove+yarn", ("rove", "rope+yarn"), at, PERPLEXITY, precondition=regime)
    assert verdict.category == NOT_MEASURED, verdict
