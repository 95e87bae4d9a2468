"""Study v5's numbers recomputed from its committed records alone, for docs/study-v5/scorecard.md: each cell's exits,
every contrast of predictions.md at both LR ranks (exact sign-flip test, its inverted interval, Holm over the seven
contrasts of one outcome at one rank), single swaps inside pre-LN, the final norm's accuracy effect at every
evaluation, the horizon rule's ranking, and the 16-step spread. Numpy and the records only (not the report code), so
that it checks normlab/study/report_v5.py rather than repeating it.
    python docs/study-v5/scorecard.py            # reads docs/study-v5/factorial and docs/study-v4/quick"""

import gzip
import itertools
import json
import math
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RECORDS, V4 = HERE / "factorial", HERE.parent / "study-v4" / "quick"
PLATEAU, MARGIN, WINDOW = math.log(2), 0.05, 20  # exit: first step whose 20-step mean train loss < ln 2 - 0.05
FACTORS = ("block", "emb", "final")  # the report's order
CELLS = [f"{b}_{f}_{e}" for e in ("off", "on") for b in ("ln", "mbn") for f in ("ln", "mbn")]  # BLOCK_FINAL_EMB
CENTER = "ln_ln_off_center"
# the two cells v4 already had, retrained on v5's machine at v4's LRs for them: v4's name, v5's experiment
RETRAINED = {"ln_ln_off": ("ln_pre", "ln_ln_off_here"), "mbn_mbn_off": ("masked_batchnorm", "mbn_mbn_off_here")}
RANKS = ("best", "runner-up")


def exit_step(run: dict) -> float:
    """The plateau exit; a run that never leaves enters as its last step."""
    steps, loss = run["curves"]["step"], np.asarray(run["curves"]["loss"], dtype=float)
    mean = np.convolve(loss, np.ones(WINDOW) / WINDOW, mode="valid")  # mean[i] ends at step index i + WINDOW - 1
    below = np.nonzero(mean < PLATEAU - MARGIN)[0]
    return float(steps[below[0] + WINDOW - 1] if below.size else steps[-1])


def final_accuracy(run: dict) -> float:
    return run["scores"]["val/sorted/running"]["accuracy"]


def accuracy_at(run: dict) -> dict:
    return {e["step"]: e["accuracy"] for e in run["curves"]["eval"]}


def sign_flip_p(d: np.ndarray) -> float:
    """Exact two-sided sign-flip p of mean(d) = 0 over all 2^n sign patterns."""
    signs = np.array(list(itertools.product((-1, 1), repeat=len(d))))
    return float(np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-12))


def interval(d: np.ndarray, alpha: float = 0.05) -> tuple:
    """The shifts the sign-flip test does not reject at alpha, by bisection on each side of the mean."""
    def edge(outside: float) -> float:
        inside = d.mean()
        for _ in range(50):
            mid = (inside + outside) / 2
            inside, outside = (inside, mid) if sign_flip_p(d - mid) < alpha else (mid, outside)
        return inside

    span = np.ptp(d) + 1e-12
    return edge(d.mean() - 2 * span), edge(d.mean() + 2 * span)


def holm(ps: dict) -> dict:
    out, running = {}, 0.0
    for i, (k, p) in enumerate(sorted(ps.items(), key=lambda kv: kv[1])):
        running = max(running, min(1.0, (len(ps) - i) * p))
        out[k] = running
    return out


def paired(d) -> str:
    """mean [interval] and the unadjusted p of per-seed differences."""
    d = np.asarray(d, dtype=float)
    lo, hi = interval(d)
    return f"{d.mean():+.3g} [{lo:+.3g}, {hi:+.3g}] p {sign_flip_p(d):.3g} ({np.count_nonzero(d)} non-zero)"


def cell_runs(runs: list, sel: dict, v4_sel: dict, cell: str, rank: int) -> dict:
    """{seed: run} of a cell at its best (0) or runner-up (1) LR: the retrained cells at v4's LRs for them (their
    `*_here` runs and the `check` run at seed 0), every other cell on the board at its own LR from the sweep."""
    v4_name, here = RETRAINED.get(cell, (None, None))
    choice = v4_sel[f"tune/{v4_name}/wuon"] if v4_name else sel[f"tune/{cell}/wuon"]
    lr = choice["lr" if rank == 0 else "runner_up"]
    experiments = {here, "check"} if here else {"board"}
    return {r["seed"]: r for r in runs if r["variant"] == cell and r["experiment"] in experiments
            and math.isclose(r["lr"], lr)}


def contrast(y: dict, factors: tuple) -> float:
    """A main effect (one factor: level 2 - level 1, averaged over the other factors' level pairs) or an
    interaction (several) over the eight cells' values y[cell]: each difference sums 2^k signed cells."""
    def high(cell: str, factor: str) -> bool:
        block, final, emb = cell.split("_")
        return {"block": block == "mbn", "final": final == "mbn", "emb": emb == "on"}[factor]

    signed = [y[c] * math.prod(1 if high(c, f) else -1 for f in factors) for c in CELLS]
    return float(np.mean(signed) * 2 ** len(factors))


def effects(arms: dict, fn, name: str) -> None:
    """Every contrast at both ranks: estimate [interval] | Holm p over the seven (floor at the non-zero pairs)."""
    keys = [k for n in (1, 2, 3) for k in itertools.combinations(FACTORS, n)]
    for rank in (0, 1):
        seeds = sorted(set.intersection(*(set(arms[c, rank]) for c in CELLS)))
        d = {k: np.array([contrast({c: fn(arms[c, rank][s]) for c in CELLS}, k) for s in seeds]) for k in keys}
        adjusted = holm({k: sign_flip_p(v) for k, v in d.items()})
        for k in keys:
            lo, hi = interval(d[k])
            floor = min(1.0, len(keys) * 2.0 ** (1 - np.count_nonzero(d[k])))
            print(f"{name} {' x '.join(k):20} {RANKS[rank]:9} {d[k].mean():+.3g} [{lo:+.3g}, {hi:+.3g}] "
                  f"Holm p {adjusted[k]:.3g} (floor {floor:.3g})")
        if fn is exit_step:  # not predicted, outside the family: is F's effect larger than B's, seed by seed?
            print(f"{name} final - block (post hoc) {RANKS[rank]:9} {paired(d['final',] - d['block',])}")


def swaps(arms: dict) -> None:
    """Single swaps inside pre-LN, per seed (unadjusted): each cell at its own LR of a rank, then at one LR."""
    base = "ln_ln_off"
    for (a, ra), rb in [(("ln_mbn_off", 0), 0), (("ln_mbn_off", 1), 1), (("mbn_ln_off", 0), 0),
                        (("mbn_ln_off", 1), 1), ((CENTER, 0), 0), ((CENTER, 1), 1),
                        (("ln_mbn_off", 1), 0), (("mbn_ln_off", 0), 1)]:
        x, y = arms[a, ra], arms[base, rb]
        lrs = f"{next(iter(x.values()))['lr']:g} - {next(iter(y.values()))['lr']:g}"
        d = [exit_step(x[s]) - exit_step(y[s]) for s in sorted(set(x) & set(y))]
        print(f"exit {a} ({RANKS[ra]}) - {base} ({RANKS[rb]}), LR {lrs}: {paired(d)}")


def by_evaluation(arms: dict, rank: int) -> None:
    """The final norm's accuracy effect at every evaluation (unadjusted), the eight cells' ranking by mean accuracy
    at each evaluation (ties to the name, as the horizon rule), and what broke the rule."""
    steps = sorted(set.intersection(*(set(accuracy_at(r)) for c in CELLS for r in arms[c, rank].values())))
    seeds = sorted(set.intersection(*(set(arms[c, rank]) for c in CELLS)))
    order = {}
    for step in steps:
        d = [contrast({c: accuracy_at(arms[c, rank][s])[step] for c in CELLS}, ("final",)) for s in seeds]
        print(f"accuracy final {RANKS[rank]:9} step {step:3}: {paired(d)}")
    for step in steps:
        mean = {c: np.mean([accuracy_at(r)[step] for r in arms[c, rank].values()]) for c in CELLS}
        order[step] = sorted(CELLS, key=lambda c: (-mean[c], c))
        print(f"ranking {RANKS[rank]:9} step {step:3}: " + " > ".join(f"{c} {mean[c]:.4f}" for c in order[step]))
    a, b = steps[-2:]
    moved = [f"{c} {order[a].index(c) + 1}->{order[b].index(c) + 1}" for c in CELLS
             if order[a].index(c) != order[b].index(c)]
    medians = {c: np.median([exit_step(r) for r in arms[c, rank].values()]) for c in CELLS}
    late = [f"{c} {m:g}" for c, m in medians.items() if m > steps[-1] / 3]
    print(f"horizon {RANKS[rank]}: rank changes {a}->{b}: {', '.join(moved) or 'none'}; median exit beyond step "
          f"{steps[-1] / 3:.1f}: {', '.join(late) or 'none'}")


def main() -> None:
    with gzip.open(RECORDS / "runs.jsonl.gz", "rt") as f:
        runs = [json.loads(line) for line in f]
    sel = json.loads((RECORDS / "selection.json").read_text())
    v4_sel = json.loads((V4 / "selection.json").read_text())
    arms = {(c, r): cell_runs(runs, sel, v4_sel, c, r) for c in [*CELLS, CENTER] for r in (0, 1)}
    for (c, r), by in arms.items():
        ex, acc = [exit_step(x) for x in by.values()], [final_accuracy(x) for x in by.values()]
        print(f"cell {c:17} {RANKS[r]:9} LR {next(iter(by.values()))['lr']:g} seeds {len(by)} median exit "
              f"{np.median(ex):g} mean {np.mean(ex):.1f} accuracy {np.mean(acc):.4f}")
    nine = [exit_step(x) for s, x in arms["ln_ln_off", 0].items() if s != 0]
    print(f"cell ln_ln_off best, seeds 1-9 (without the check's seed 0): median exit {np.median(nine):g}")
    effects(arms, exit_step, "exit")
    effects(arms, final_accuracy, "accuracy")
    swaps(arms)
    for rank in (0, 1):
        by_evaluation(arms, rank)
    spread = {}
    for row in map(json.loads, (RECORDS / "signal.jsonl").read_text().splitlines()):
        spread.setdefault(row["variant"], []).append(1 - row["cosine"][-1])
    print("spread after 16 steps (1 - cosine, mean over seeds):",
          ", ".join(f"{a} {np.mean(v):.3g}" for a, v in spread.items()))


if __name__ == "__main__":
    main()
