"""normlab.study's outcome rules and seed-level statistics, against hand-made curves and scipy's own tests."""

import math

import numpy as np
import pytest
from scipy import stats

from normlab.study import outcomes as oc
from normlab.study import seedstats as ss

LN2 = math.log(2)


def curve(*pieces):
    return [v for value, n in pieces for v in [value] * n]


@pytest.mark.parametrize("losses, expected", [
    (curve((LN2, 300)), oc.NEVER_LEARNED),
    (curve((LN2, 100), (0.45, 200)), oc.LEARNED),
    (curve((LN2, 100), (0.45, 100), (LN2, 100)), oc.DIVERGED),  # learned, then back on the plateau
    (curve((LN2, 100), (0.45, 100), (0.50, 100)), oc.LEARNED),  # a little worse at the end is not a blow-up
    (curve((LN2, 10), (float("nan"), 5)), oc.DIVERGED),
    (curve((0.66, 300)), oc.NEVER_LEARNED),  # below ln 2 but not clearly: still the plateau
])
def test_outcome_tells_never_learned_from_diverged(losses, expected):
    assert oc.outcome(losses) == expected


def test_a_run_stopped_as_diverged_is_diverged_whatever_its_curve():
    assert oc.outcome(curve((LN2, 50), (0.4, 50)), status="diverged") == oc.DIVERGED


def test_plateau_exit_is_the_first_step_the_moving_mean_is_clearly_below_ln2():
    losses = curve((LN2, 100), (0.4, 100))
    steps = list(range(1, 201))
    # the 20-step mean crosses ln 2 - 0.05 once enough of its window is at 0.4
    k = next(i for i in range(20, 200) if np.mean(losses[i - 19:i + 1]) < LN2 - oc.MARGIN)
    assert oc.plateau_exit_step(steps, losses) == k + 1
    assert oc.plateau_exit_step(steps, curve((LN2, 200))) is None
    assert oc.plateau_exit_step(steps[:60], curve((LN2, 30), (0.3, 10), (float("inf"), 20))) is not None


def test_the_outcome_window_is_a_number_of_examples_so_a_small_batch_s_noise_is_not_a_divergence():
    from normlab.study.records import RunRecord

    # learned at step 100; a lucky 20-step stretch at 0.30, a last 20 steps at 0.55: batch-8 noise, not a blow-up
    losses = curve((LN2, 100), (0.5, 100), (0.30, 20), (0.5, 160), (0.55, 20))
    steps = list(range(1, len(losses) + 1))
    at = {n: RunRecord(status="completed", curves={"step": steps, "loss": losses}, extra={"examples_per_step": n})
          for n in (8, 32)}
    assert oc.run_window(at[8]) == 80 and oc.run_window(at[32]) == oc.WINDOW == 20
    assert oc.run_outcome(at[32]) == oc.outcome(losses) == oc.DIVERGED  # 20 steps of 32: the rule as it was
    assert oc.run_outcome(at[8]) == oc.LEARNED  # 80 steps of 8: the same 640 examples
    assert oc.run_exit(at[8]) == oc.plateau_exit_step(steps, losses, window=80) > oc.run_exit(at[32])
    older = RunRecord(status="completed", curves={"step": steps, "loss": losses})  # before examples_per_step
    assert oc.run_window(older) == 20 and oc.exit_or_end(older) == oc.run_exit(at[32])


def test_largest_learning_lr():
    assert oc.largest_learning_lr({1e-3: oc.LEARNED, 1e-2: oc.LEARNED, 3e-2: oc.DIVERGED}) == 1e-2
    assert oc.largest_learning_lr({1e-3: oc.NEVER_LEARNED}) is None


def test_paired_tests_agree_with_scipy():
    d = np.array([0.03, 0.01, 0.05, -0.01, 0.02, 0.04, 0.00, 0.03, 0.02, 0.01])
    t = ss.paired_test(d, "t")
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    assert t.p == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue) and (t.lo, t.hi) == pytest.approx((ci.low, ci.high))
    exact = stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=np.inf).pvalue
    assert ss.paired_test(d, "permutation").p == pytest.approx(exact)
    with pytest.raises(ValueError, match="unknown test 'z'; choose one of t, permutation"):
        ss.paired_test(d, "z")


def test_holm_steps_down_and_stays_monotone():
    adjusted = ss.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": float("nan")})
    assert adjusted["a"] == pytest.approx(0.03) and adjusted["c"] == pytest.approx(0.06)
    assert adjusted["b"] == pytest.approx(0.06) and math.isnan(adjusted["d"])  # max(0.06, 1 x 0.04)
