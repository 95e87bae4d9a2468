"""Study v4's rules (normlab/study/rules.py) on synthetic records: v3's flaws (a coin-flip LR choice, an arm that
had not flattened, 5-seed tests that could never decide, an A/A arm that was a copy) must be caught."""

import math

import numpy as np
import pytest
from scipy import stats

from normlab.study import rules
from normlab.study.records import RunRecord
from normlab.study.seedstats import Paired, holm, paired_test, sign_flip_p

LN2 = math.log(2)


def run(exit_step: int, steps: int = 320, final_loss: float = 0.4, evals=None, seed: int = 0,
        batch: int | None = None) -> RunRecord:
    """A synthetic record: train loss at ln 2 until `exit_step`, then `final_loss`; evaluations {step: accuracy};
    `batch`: its examples per step, where the record says it."""
    loss = [LN2 if s < exit_step else final_loss for s in range(1, steps + 1)]
    return RunRecord.from_dict({"seed": seed, "curves": {"step": list(range(1, steps + 1)), "loss": loss,
                                                         "eval": [{"step": s, "accuracy": a, "loss": 1 - a}
                                                                  for s, a in (evals or {}).items()]},
                                **({"examples_per_step": batch} if batch else {})})


# --- the floor --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [3, 5, 6, 8, 10])
def test_floor_is_the_smallest_p_scipy_and_the_sign_flip_test_can_reach(k):
    d = np.arange(1, k + 1, dtype=float)  # all positive: the most extreme data there is
    assert stats.wilcoxon(d).pvalue == pytest.approx(rules.test_floor(k))
    assert paired_test(d, "permutation").p == pytest.approx(rules.test_floor(k))
    assert rules.test_floor(k) == pytest.approx(2.0 ** (1 - k))


def test_sign_flip_p_does_not_depend_on_the_outcome_s_scale():
    """Tokens/s differences (study docs_long's T-ln at its runner-up LRs): summed in another order, the observed
    signs came out 1.5e-11 short of themselves and the exact p read 0, below the test's floor."""
    d = np.array([-7546.2, -7782.1, -7237.6, -6979.6, -7072.7, -6396.0, -7267.2, -6853.5, -7328.3, -7618.5])
    for scale in (1e-6, 1.0, 1e6):
        assert sign_flip_p(d * scale) == rules.test_floor(len(d))
    mixed = np.array([3.0, -1.0, 2.0, 5.0, -0.5, 4.0])  # flipping a subset summing to <= 0 or >= 12.5: 8 of 64
    assert sign_flip_p(mixed * 1e5) == sign_flip_p(mixed) == pytest.approx(8 / 64)


def test_sign_flip_p_beyond_16_seeds_is_a_monte_carlo_p_never_0():
    d = np.full(20, 1e4)  # exact p 2 / 2**20; 20,000 draws see none beyond the observed: (0 + 1) / 20,001
    assert sign_flip_p(d) == pytest.approx(1 / 20001)


def test_floor_after_holm_is_the_family_times_the_floor():
    k, m = 8, 6
    best = {f"h{i}": rules.test_floor(k) for i in range(m)}  # every test at its floor
    assert min(holm(best).values()) == pytest.approx(rules.test_floor(k, m)) == pytest.approx(m * 2.0 ** (1 - k))


def test_a_five_seed_test_is_refused_and_a_ten_seed_family_of_six_is_not():
    # v3's S5a/b, S8a-c, E1a/b: 5 seeds, floor 0.0625 > 0.05 even alone
    assert rules.test_floor(5) == 0.0625
    with pytest.raises(rules.PlanError, match="E1a"):
        rules.check_plan([rules.PlannedTest("E1a", seeds=5), rules.PlannedTest("P4", seeds=10, family=6)])
    # P2's coarse grid: 10 seeds, but only 5 pairs ever differed
    with pytest.raises(rules.PlanError, match="P2"):
        rules.check_plan([rules.PlannedTest("P2", seeds=10, nonzero=5)])
    rows = rules.check_plan([rules.PlannedTest("P4", seeds=10, family=6, effect=0.03, sd=0.02)])
    assert rows[0]["floor"] == pytest.approx(6 / 512) and 0 < rows[0]["power"] < 1


def test_power_matches_a_simulation_of_the_t_test_and_grows_with_seeds():
    rng = np.random.default_rng(1)
    simulated = np.mean([stats.ttest_1samp(rng.normal(0.02, 0.02, 10), 0).pvalue < 0.05 for _ in range(4000)])
    assert rules.power(0.02, 0.02, 10) == pytest.approx(simulated, abs=0.03)
    assert rules.power(0.02, 0.02, 20) > rules.power(0.02, 0.02, 10) > rules.power(0.02, 0.02, 5)


# --- intervals and p from one method ---------------------------------------------------------------------------

def test_sign_flip_interval_is_the_inverted_test():
    d = np.array([0.03, 0.01, 0.04, -0.005, 0.02, 0.025, 0.015, 0.035, 0.01, 0.02])
    lo, hi = rules.sign_flip_interval(d)
    assert lo < d.mean() < hi
    p = lambda delta: paired_test(d - delta, "permutation").p  # noqa: E731 - a one-line local helper
    assert p(lo + 1e-4) >= 0.05 > p(lo - 1e-3) and p(hi - 1e-4) >= 0.05 > p(hi + 1e-3)
    est = rules.estimate(d, "permutation")
    assert (est.lo, est.hi) == (lo, hi) and (est.p < 0.05) == (lo > 0)  # the interval excludes 0 iff p < alpha
    assert rules.sign_flip_interval(d[:5]) == (-math.inf, math.inf)  # 5 seeds: no shift can be rejected


# --- the LR choice ----------------------------------------------------------------------------------------------

def test_a_coin_flip_tuning_is_flagged_as_a_near_tie():
    # v3's pre-LN: 0.4602 at 3.16e-3 vs 0.4649 at 1e-3, seeds 0.045 apart
    choice = rules.choose_lrs({1e-3: [0.462, 0.468, 0.459, 0.470], 3.16e-3: [0.438, 0.483, 0.445, 0.475],
                               1e-2: [0.55, 0.56, 0.54, 0.57]})
    assert (choice["lr"], choice["runner_up"]) == (3.16e-3, 1e-3)
    assert isinstance(choice["lr"], float) and isinstance(choice["runner_up"], float)
    assert choice["near_tie"] and choice["gap"] < choice["seed_sd"]
    clear = rules.choose_lrs({1e-3: [0.40, 0.41, 0.40, 0.41], 3.16e-3: [0.47, 0.48, 0.47, 0.48]})
    assert clear["lr"] == 1e-3 and not clear["near_tie"]
    diverged = rules.choose_lrs({1e-3: [0.40, 0.41], 1e-2: [0.41, math.inf]})
    assert diverged["runner_up"] == 1e-2 and not diverged["near_tie"]
    assert rules.choose_lrs({1e-3: [0.4]}) == {"lr": 1e-3}  # one LR: no runner-up to choose


# --- the robustness rule ----------------------------------------------------------------------------------------

def est(mean, n=10):
    return Paired(mean, mean - 0.01, mean + 0.01, 0.0, n, "t")


def robust(by_rank: dict, sign: int) -> str:
    return rules.robust_verdict({k: rules.single_verdict(e, p, sign) for k, (e, p) in by_rank.items()})


def test_a_claim_stands_only_where_both_lrs_agree():
    assert robust({0: (est(+0.05), 0.001), 1: (est(+0.04), 0.01)}, +1) == "confirmed"
    assert robust({0: (est(-0.05), 0.001), 1: (est(-0.04), 0.01)}, +1) == "refuted"
    assert robust({0: (est(+0.01), 0.4), 1: (est(-0.01), 0.5)}, +1) == "not separated"
    # v3's headline: significant at the coin-flip LR, not at the runner-up -> no claim about the norm
    assert robust({0: (est(+0.054), 0.008), 1: (est(+0.017), 0.2)}, -1) == rules.DEPENDS
    assert robust({0: (est(+0.05), 0.001), 1: (est(-0.05), 0.001)}, +1) == rules.DEPENDS
    # a rank whose exact test could not reach alpha leaves the claim undecided, whatever the other says
    assert rules.robust_verdict({0: "confirmed", 1: f"{rules.UNDECIDED} (p >= 0.5)"}).startswith(rules.UNDECIDED)


def test_the_robustness_rule_flips_a_verdict_read_from_synthetic_runs():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.005, 10)
    bn = {0: 0.76 + noise, 1: 0.755 + noise}
    ln = {0: 0.705 + noise + rng.normal(0, 0.01, 10), 1: 0.742 + noise + rng.normal(0, 0.01, 10)}
    by_rank = {}
    for k in (0, 1):
        e = rules.estimate(bn[k] - ln[k], "t")
        by_rank[k] = (e, e.p)
    assert rules.single_verdict(*by_rank[0], sign=-1) == "refuted"  # what the best LR alone would say
    bn[1] = ln[1] + rng.normal(0, 0.01, 10)  # at the runner-up LR the gap is gone
    e = rules.estimate(bn[1] - ln[1], "t")
    by_rank[1] = (e, e.p)
    assert robust(by_rank, -1) == rules.DEPENDS


# --- the horizon rule -------------------------------------------------------------------------------------------

def test_an_unflattened_arm_gets_horizon_too_short():
    evals = {288: 0.70, 320: 0.74}
    fast = [run(60, evals={288: 0.75, 320: 0.76}, seed=s) for s in range(5)]
    slow = [run(160 + s, evals=evals, seed=s) for s in range(5)]  # v3's pre-LN: median exit 164 of 320
    h = rules.horizon({"bn": fast, "ln": slow})
    assert h["bn"]["ok"] and not h["ln"]["exit_ok"] and not h["ln"]["ok"]
    # the 20-step mean crosses ln 2 - 0.05 four steps after the drop: the median seed's drop at 162 -> 165
    assert h["ln"]["median_exit"] == 165 > 320 / 3
    # a seed that never left the plateau counts as infinitely late
    assert rules.median_exit([run(60), run(400), run(400)]) == math.inf


def test_a_ranking_that_changes_at_the_last_evaluation_is_not_settled():
    a = [run(50, evals={256: 0.74, 288: 0.75, 320: 0.76})]
    b = [run(50, evals={256: 0.73, 288: 0.76, 320: 0.75})]  # b ahead at 288, behind at 320
    c = [run(50, evals={256: 0.60, 288: 0.61, 320: 0.62})]
    settled = rules.ranking_settled({"a": a, "b": b, "c": c})
    assert settled == {"a": False, "b": False, "c": True}
    h = rules.horizon({"a": a, "b": b})
    assert not h["a"]["ok"] and h["a"]["exit_ok"]


def test_arms_of_different_batch_sizes_are_held_to_the_same_third_of_the_data():
    """Two epochs at batch 32 (832 steps) beside the same data at batch 8 (3,328 steps): an exit is early when it
    is within the first third of the examples, and evaluations pair by the examples seen (step 64 of 32 with step
    256 of 8), not by the step number."""
    b32_evals = {s: 0.70 + s / 1e4 for s in range(64, 833, 64)}  # still rising; last two at 768 and 832
    b8_evals = {4 * s: v + 0.01 for s, v in b32_evals.items()}  # ahead of it at every evaluation
    b8_evals[3072] -= 0.05  # behind at its second-to-last evaluation only: the ranking moved
    late = [run(400, steps=832, batch=32, evals=b32_evals, seed=s) for s in range(3)]  # 400 > 832 / 3
    early = [run(1000, steps=3328, batch=8, evals=b8_evals, seed=s) for s in range(3)]  # 1000 < 3328 / 3
    h = rules.horizon({"b32": late, "b8": early})
    assert not h["b32"]["exit_ok"] and h["b8"]["exit_ok"]
    # each in its own steps, read over 640 examples: 20 steps of 32 cross 3 steps after the drop, 80 of 8 13 after
    assert h["b32"]["median_exit"] == 403 and h["b8"]["median_exit"] == 1013
    assert h["b32"]["settled"] is False and h["b8"]["settled"] is False  # at 768 vs 3072 b8 is behind
    b8_evals[3072] += 0.05
    early = [run(1000, steps=3328, batch=8, evals=b8_evals, seed=s) for s in range(3)]
    assert rules.ranking_settled({"b32": late, "b8": early}) == {"b32": True, "b8": True}
    # records that do not say their batch are read in steps, as before
    assert rules.horizon({"a": [run(60)], "b": [run(100)]})["b"]["exit_ok"]  # 103 <= 320 / 3


# --- the A/A control --------------------------------------------------------------------------------------------

def test_aa_on_disjoint_seed_sets_keeps_the_false_positive_rate_and_catches_a_shift():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.74, 0.015, 20), rng.normal(0.74, 0.015, 20)  # one arm, two disjoint seed sets
    fpr = rules.aa_false_positive_rates(a, b, n=10, reps=400)
    assert set(fpr) == {"t", "permutation"} and all(0 <= v <= 0.1 for v in fpr.values())
    shifted = rules.aa_false_positive_rates(a + 0.03, b, n=10, reps=200)  # not an A/A: must be found
    assert shifted["t"] > 0.8
    with pytest.raises(ValueError, match="seed set"):
        rules.aa_false_positive_rates(a[:5], b, n=10)
    e = rules.aa_interval(a, b, "permutation")
    assert e.n == 20 and e.lo < 0 < e.hi


def test_spearman_exact_matches_scipy_and_has_its_floor():
    x = [0.8, 0.5, 0.02, 0.019, 0.019, 0.0001, 0.003]  # a spread per arm
    y = [50, 58, 120, 150, 160, 140, 90]  # median exit per arm
    rho, p = rules.spearman_exact(x, y)
    assert rho == pytest.approx(stats.spearmanr(x, y).statistic)
    ref = stats.permutation_test((x,), lambda a: stats.spearmanr(a, y).statistic, permutation_type="pairings",
                                 alternative="less", n_resamples=np.inf)
    assert p == pytest.approx(ref.pvalue)
    assert rules.spearman_exact(range(7), range(7, 0, -1))[1] == pytest.approx(1 / 5040)  # the floor
    with pytest.raises(ValueError, match="orderings"):
        rules.spearman_exact(range(9), range(9))
