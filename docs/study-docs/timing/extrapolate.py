"""Study size x measured step-time ratios -> slot-seconds and wall time with 2 slots (predictions.md, "Run time").
    python extrapolate.py 6.7 1.5 9.3 3.1 3.7 4.3
(the ratios of ln_random, ln_grouped, bn_random, bn_grouped, mbn_random, mbn_grouped)
"""
import sys

R = dict(zip(["ln_random", "ln_grouped", "bn_random", "bn_grouped", "mbn_random", "mbn_grouped"],
             map(float, sys.argv[1:7])))
T_REF = 18.7 * 0.77 / 416          # s per training step of the pre-LN sentence run, one of 2 slots (v4 quick notes)
DOC_TOKENS, STEP_TOKENS = 47.8, 1526
def eval_s(arm):                   # dev (1,001) + eval (1,987) documents forward; the BN family scores eval twice
    docs = 2988 + (1987 if arm.startswith(("bn", "mbn")) else 0)
    grouped = R[arm.split("_")[0] + "_grouped"]
    return docs * DOC_TOKENS / (3 * STEP_TOKENS) * T_REF * grouped
def run_s(arm, steps, evals, startup=2.0):
    return steps * T_REF * R[arm] + evals * eval_s(arm) + startup
def study(steps=864, evals=6, tune_lrs=5, tune_seeds=4, board_seeds=10, aa_seeds=10, tune_steps=None):
    tot = 0.0
    for arm in R:
        tot += tune_lrs * tune_seeds * run_s(arm, tune_steps or steps, 1)
        tot += 2 * board_seeds * run_s(arm, steps, evals)
        if arm.startswith("mbn"):
            tot += aa_seeds * run_s(arm, steps, evals)
    score = sum((2 * board_seeds + (aa_seeds if a.startswith("mbn") else 0)) * eval_s(a) for a in R)
    return tot + score
for arm in R:
    print(f"{arm:12} {run_s(arm, 864, 6):6.0f} slot-s a board run ({eval_s(arm):.1f} s an evaluation)")
plans = {"planned (864 steps, tune 5x4, board 2x10, aa 10)": {},
         "one epoch (432 steps), eval every 72": dict(steps=432),
         "864 steps, tune 3 LRs x 2 seeds": dict(tune_lrs=3, tune_seeds=2),
         "432 steps, tune 3x2, evals 4": dict(steps=432, tune_lrs=3, tune_seeds=2, evals=4)}
for name, kw in plans.items():
    s = study(**kw)
    print(f"{name:55} {s:8.0f} slot-s = {s / 2 / 3600:.1f} h wall with --parallel 2")
s = study(steps=432, tune_lrs=3, tune_seeds=2, board_seeds=8, aa_seeds=8, evals=3)
print(f"{'432 steps, tune 3x2, board 8 seeds, aa 8, evals 3':55} {s:8.0f} slot-s = {s / 2 / 3600:.1f} h wall")
s = study(steps=432, tune_lrs=3, tune_seeds=2, board_seeds=10, aa_seeds=0, evals=3)
print(f"{'432 steps, tune 3x2, board 10 seeds, no aa runs, evals 3':55} {s:8.0f} slot-s = {s / 2 / 3600:.1f} h wall")
