"""Study v4's report (docs/study-v4/predictions.md), from the records alone, with its rules (rules.py): every claim
tested with both arms at their best LR and at their runner-up, a verdict only where the horizon rule holds, and
the provenance of the records. report.make_report writes it for a study with a `board` experiment (v4's presets);
v3's records keep v3's report."""

import math
from collections import Counter, namedtuple
from datetime import datetime, timedelta, timezone

import numpy as np

from normlab.study import markdown as md
from normlab.study import outcomes as oc
from normlab.study import rules
from normlab.study.analysis import Records, by_seed, largest_lr_by_seed, outcome_grid, paired, value
from normlab.study.seedstats import holm, paired_test

BOARD = "board"
PRIMARY = ("ln_pre", "ln_post", "custom_ln", "rmsnorm", "dyt", "batchnorm", "masked_batchnorm", "powernorm",
           "no_norm")
SLOW, FAST = ("ln_pre", "custom_ln", "rmsnorm", "dyt"), ("batchnorm", "masked_batchnorm", "no_norm", "ln_post")
AFTER_EXIT = 128  # matched_step_value: accuracy this many steps after each run's own plateau exit
AA_SEEDS = 8  # seeds per A/A resample (of 10 per set)
M1_ARMS = ("ln_pre", "custom_ln", "rmsnorm", "dyt", "batchnorm", "masked_batchnorm", "powernorm")


def is_v4(rec: Records) -> bool:
    """v4's presets: a `board` (quick, long, MLM) or only a `placement` at warmup on and off (P2)."""
    experiments = {e for r in rec.runs for e in r.get("experiments", [r["experiment"]])}
    return BOARD in experiments or experiments == {"placement"}


def choice(rec: Records, arm: str) -> dict | None:
    return rec.selection.get(f"tune/{arm}/wuon")


def runs_at(rec: Records, variant: str, rank: int, experiment: str = BOARD, tune: str | None = None) -> list[dict]:
    """The variant's runs at its tune arm's best (rank 0) or runner-up (rank 1) LR."""
    c = choice(rec, tune or variant)
    return rec.arm(experiment, variant, "on", rules.lr_of_rank(c, rank)) if c else []


def steps_of(runs: list[dict]) -> int:
    return max((r["curves"]["step"][-1] for r in runs if r.get("curves", {}).get("step")), default=0)


def exit_or_end(run: dict) -> float:
    """The run's plateau exit step; a run that never left the plateau enters as its length (H4, M2)."""
    c = run.get("curves", {})
    e = oc.plateau_exit_step(c.get("step", []), c.get("loss", []))
    return float(e if e is not None else (c.get("step") or [math.nan])[-1])


def per_seed(rec: Records, arms, rank: int, field: str, experiment: str = BOARD, tune=None) -> dict:
    """{seed: value}, averaged over `arms` (a name or a group) at the LR rank; field: accuracy, loss or exit."""
    arms = _arms(arms)
    fn = exit_or_end if field == "exit" else (lambda r: value(r, field))
    tables = [by_seed(runs_at(rec, a, rank, experiment, tune), fn) for a in arms]
    seeds = set.intersection(*(set(t) for t in tables)) if tables else set()
    return {s: float(np.mean([t[s] for t in tables])) for s in sorted(seeds)}


# a - b per seed; field: accuracy, loss or exit; sign: the predicted one; family: Holm's; a's experiment and tune arm
Claim = namedtuple("Claim", "id text a b field sign family experiment tune")
CLAIMS = tuple(Claim(*c) for c in (
    ("H1", "naive BN is less accurate than LN (Shen et al. 2020): accuracy, batchnorm - ln_pre",
     "batchnorm", "ln_pre", "accuracy", -1, "F1", BOARD, None),
    ("H2", "masked BN is more accurate than naive BN: accuracy, masked - naive",
     "masked_batchnorm", "batchnorm", "accuracy", +1, "F1", BOARD, None),
    ("H3", "DyT's validation loss is lower than LN's (arXiv 2604.23434): loss, dyt - ln_pre",
     "dyt", "ln_pre", "loss", -1, "F1", BOARD, None),
    ("H4", "per-token pre-norms leave the plateau later: exit step, {LN, hand-written LN, RMSNorm, DyT} - "
     "{BN, masked BN, no norm, post-LN}", SLOW, FAST, "exit", +1, "F1", BOARD, None),
    ("M2", "mean pooling moves pre-LN's plateau exit earlier: exit step, mean pooling - [CLS]",
     "ln_pre_meanpool", "ln_pre", "exit", -1, "M2", "mechanism", "ln_pre"),
    ("MLM1", "on MLM naive BN's masked-token loss is higher than LN's (Shen 2020): loss, batchnorm - ln_pre",
     "batchnorm", "ln_pre", "loss", +1, "MLM1", BOARD, None),
))


def _arms(x) -> tuple:
    return (x,) if isinstance(x, str) else tuple(x)


def claim_rows(rec: Records, test: str) -> list[dict]:
    """Every claim whose arms the records hold: estimate, Holm-adjusted p and verdict at each LR rank, the
    robustness rule's verdict, and the horizon rule's."""
    mlm = any(r.get("task") == "mlm" for r in rec.runs)
    rows = []
    for c in CLAIMS:
        if (c.id == "MLM1") != mlm:
            continue
        diffs = {k: paired(per_seed(rec, c.a, k, c.field, c.experiment, c.tune), per_seed(rec, c.b, k, c.field))
                 for k in (0, 1)}
        ests = {k: rules.estimate(d, test) for k, d in diffs.items()}
        if all(e.n < 2 for e in ests.values()):
            continue
        rows.append({"id": c.id, "claim": c.text, "family": c.family, "sign": c.sign, "est": ests, "field": c.field,
                     "arms": _arms(c.a) + _arms(c.b),
                     "nonzero": {k: sum(x != 0 for x in d if np.isfinite(x)) for k, d in diffs.items()}})
    for k in (0, 1):
        for family in {r["family"] for r in rows}:
            adjusted = holm({r["id"]: r["est"][k].p for r in rows if r["family"] == family})
            size = len(adjusted)
            for r in rows:
                if r["family"] == family:
                    r.setdefault("p", {})[k] = adjusted[r["id"]]
                    # an exact test's smallest p, after Holm: at or above alpha, "not separated" would be the
                    # design's verdict, not the data's (the t test has no such floor)
                    r.setdefault("floor", {})[k] = (rules.test_floor(r["nonzero"][k], size)
                                                    if test == "permutation" else 0.0)
    for r in rows:
        r["verdicts"] = {k: f"{rules.UNDECIDED} (p >= {r['floor'][k]:.3g})" if r["floor"][k] >= rules.ALPHA
                         else rules.single_verdict(r["est"][k], r["p"][k], r["sign"]) for k in (0, 1)}
        r["robust"] = (rules.UNDECIDED if any(r["floor"][k] >= rules.ALPHA for k in (0, 1)) else
                       rules.robust_verdict({k: (r["est"][k], r["p"][k]) for k in (0, 1)}, r["sign"]))
        # a claim about the exits is about leaving the plateau, not about where the arms end: no horizon rule
        r["horizon"], r["horizon_why"] = (None, "") if r["field"] == "exit" else claim_horizon(rec, r, mlm)
        r["verdict"] = r["robust"] if r["horizon"] in (None, True) else rules.HORIZON_TOO_SHORT
    return rows


def dyt_relative_change(rec: Records) -> str:
    """H3 beside the paper's number: DyT's mean validation loss relative to pre-LN's, at each LR rank."""
    parts = []
    for k, rank in enumerate(rules.RANKS):
        dyt, ln = (list(per_seed(rec, a, k, "loss").values()) for a in ("dyt", "ln_pre"))
        if dyt and ln:
            parts.append(f"{np.mean(dyt) / np.mean(ln) - 1:+.1%} at the {rank} LRs")
    return ("DyT's validation loss relative to pre-LN's: " + ", ".join(parts) +
            " (arXiv 2604.23434: -27% for GPT-2 64M on 1M tokens).") if parts else ""


def claim_horizon(rec: Records, row: dict, mlm: bool) -> tuple[bool, str]:
    """The horizon rule for the claim's arms at both LR ranks (for MLM only its ranking half): (ok, why not, e.g.
    "ranks swapped at the best LRs": the arms' order changed over the last two evaluations)."""
    failed = []
    for k, rank in enumerate(rules.RANKS):
        arms = {a: runs_at(rec, a, k) for a in row["arms"]}
        if not all(arms.values()):
            return False, f"no runs at the {rank} LRs"
        field = "loss" if mlm else "accuracy"
        verdict = rules.horizon(arms, steps_of([r for v in arms.values() for r in v]), field)
        why = (["ranks swapped"] if not all(v["settled"] for v in verdict.values()) else []) + \
            (["late exit"] if not mlm and not all(v["exit_ok"] for v in verdict.values()) else [])
        failed += [f"{w} at the {rank} LRs" for w in why]
    return not failed, "; ".join(failed)


def aa_section(rec: Records) -> dict | None:
    """pre-LN at its best LR on the board's seeds and on the aa experiment's disjoint seeds."""
    a = [value(r) for r in runs_at(rec, "ln_pre", 0)]
    b = [value(r) for r in runs_at(rec, "ln_pre", 0, "aa")]
    if min(len(a), len(b)) < AA_SEEDS:
        return None
    fpr = rules.aa_false_positive_rates(a, b, n=AA_SEEDS)
    est = rules.aa_interval(a, b, "t")
    ok = fpr["t"] <= rules.ALPHA and est.lo <= 0 <= est.hi
    test = "t" if ok else "permutation"
    return {"fpr": fpr, "estimate": rules.aa_interval(a, b, test), "test": test, "ok": ok, "n": (len(a), len(b))}


def p2_lines(rec: Records) -> list[str]:
    """P2: per seed, log10 of post-LN's largest learning LR with warmup minus without (Wilcoxon); undecidable
    when too few seeds differ for the test's floor to reach alpha."""
    on, off = (largest_lr_by_seed(rec, "ln_post", w) for w in ("on", "off"))
    diffs = paired(on, off)
    if not diffs:
        return []
    est = paired_test(diffs, "wilcoxon")
    nonzero = sum(d != 0 for d in diffs)
    floor = rules.test_floor(nonzero)
    verdict = (f"could not decide: {nonzero} of {len(diffs)} seeds differ, so p cannot go below {floor:.3g}"
               if floor >= rules.ALPHA else rules.single_verdict(est, est.p, +1))
    grid = " ".join(f"{g['variant']} wu{g['warmup']} {g['lr']:g}: {g[oc.LEARNED]}/{g['n']};"
                    for g in outcome_grid(rec, "placement"))
    return ["## P2: warmup and post-LN's largest learning LR", "",
            f"log10 largest learning LR, warmup on - off, per seed: {est.fmt()}; {nonzero} non-zero pairs, floor "
            f"{floor:.3g}. Verdict: **{verdict}**.", "", f"Seeds that learned / run: {grid}", ""]


def m1_lines(rec: Records, signal: list[dict]) -> list[str]:
    """M1: Spearman's rho, over the seven pre-norm arms with a norm, between the pooled-vector spread after the
    signal's Adam steps (median over seeds) and the arm's median plateau exit at its best LR (board)."""
    arms = [a for a in M1_ARMS if any(r["variant"] == a for r in signal) and runs_at(rec, a, 0)]
    if len(arms) < 3:
        return []
    spread = [float(np.median([1 - r["cosine"][-1] for r in signal if r["variant"] == a])) for a in arms]
    exits = [rules.median_exit(runs_at(rec, a, 0)) for a in arms]
    rho, p = rules.spearman_exact(spread, exits)
    verdict = "confirmed" if p < rules.ALPHA else "not separated"
    if rules.spearman_exact(spread, [-e for e in exits])[1] < rules.ALPHA:
        verdict = "refuted"
    rows = [[a, f"{sp:.2e}", f"{ex:.0f}"] for a, sp, ex in zip(arms, spread, exits)]
    return ["## M1: the spread of the classifier's input and the plateau exit", "",
            f"Spearman's rho over {len(arms)} arms: {rho:+.2f} (exact one-sided p {p:.3g}; predicted < 0). Verdict: "
            f"**{verdict}**.", ""] + md.table(["arm", "spread after the signal's steps",
                                               "median exit (board, best LR)"], rows)


def board_runs(rec: Records) -> dict:
    """{arm: (runs at its best LR, runs at its runner-up LR)} of a classification board (the figure's input)."""
    if any(r.get("task") == "mlm" for r in rec.runs):
        return {}
    arms = [a for a in PRIMARY if choice(rec, a) and runs_at(rec, a, 0)]
    return {a: (runs_at(rec, a, 0), runs_at(rec, a, 1)) for a in arms}


def figure_title(board: dict, name: str) -> str:
    runs = [r for pair in board.values() for r in pair[0]]
    seeds = len({r["seed"] for r in runs})
    return f"Which norm? Each at its best and its runner-up LR ({name}: {steps_of(runs)} steps on SST-2, {seeds} seeds)"


def board_lines(rec: Records) -> list[str]:
    mlm = any(r.get("task") == "mlm" for r in rec.runs)
    arms = [a for a in PRIMARY if choice(rec, a) and runs_at(rec, a, 0)]
    rows, on_dev = [], True
    for k, rank in enumerate(rules.RANKS):
        runs = {a: runs_at(rec, a, k) for a in arms}
        runs = {a: v for a, v in runs.items() if v}
        if not runs:
            continue
        field = "loss" if mlm else "accuracy"
        h = rules.horizon(runs, steps_of([r for v in runs.values() for r in v]), field)
        for a, rs in runs.items():
            c = choice(rec, a)
            best = [rules.best_evaluation(r) for r in rs]
            on_dev = on_dev and all(chosen for _, chosen in best)
            rows.append([a, rank, f"{rules.lr_of_rank(c, k):g}" + (" (near tie)" if c.get("near_tie") else ""),
                         md.mean_ci([value(r) for r in rs]), md.mean_ci([value(r, "loss") for r in rs]),
                         "" if mlm else md.mean_ci([v for v, _ in best]),
                         "" if mlm else md.mean_ci([rules.matched_step_value(r, AFTER_EXIT) for r in rs]),
                         "" if mlm else f"{h[a]['median_exit']:.0f}" + ("" if h[a]["exit_ok"] else " (late)"),
                         "yes" if h[a]["settled"] else "no", last_move(rs, field),
                         "yes" if h[a]["ok"] or (mlm and h[a]["settled"]) else "**horizon too short**"])
    if not rows:  # a study without a board (p2_v4)
        return []
    return ["## Every arm at its best and at its runner-up LR", "",
            "Validation, mean ± 95% t half-width over seeds: final accuracy and loss; the best logged evaluation "
            + ("(validation at the evaluation with the best dev accuracy, every 32 steps); " if on_dev else
               "(validation, every 32 steps: an upper bound, chosen on the split it reports); ") + "accuracy "
            f"{AFTER_EXIT} steps after each run's own plateau exit; median plateau exit (late: past the first third); "
            "whether the arm's rank among all arms held over the last two evaluations, and how far its mean "
            f"{'loss' if mlm else 'accuracy'} moved between them (the size of move that swaps the ranks of arms that "
            "close); the horizon rule (both). A claim's own horizon check ranks only the arms it compares "
            "(Verdicts).", ""] + \
        md.table(["arm", "LR rank", "LR", "final accuracy", "final loss",
                  "best eval, chosen on dev" if on_dev else "best logged eval", f"exit + {AFTER_EXIT}",
                "median exit", "rank settled", "last move", "horizon"], rows)


def last_move(runs: list[dict], field: str) -> str:
    """The change of the arm's mean `field` over seeds between its last two evaluations, as text."""
    means = list(rules.eval_means(runs, field).values())
    return f"{round(means[-1] - means[-2], 3) + 0.0:+.3f}" if len(means) >= 2 else ""  # + 0.0: no "-0.000"


def claim_lines(rows: list[dict], test: str, calibrated: bool) -> list[str]:
    table = [[r["id"], r["claim"], r["est"][0].fmt(), f"{r['p'][0]:.3g}", r["verdicts"][0], r["est"][1].fmt(),
              f"{r['p'][1]:.3g}", r["verdicts"][1],
              {None: "n/a", True: "yes", False: f"no: {r['horizon_why']}"}[r["horizon"]],
              f"**{r['verdict']}**"]
             for r in rows]
    return ["## Verdicts", "",
            f"Test for continuous quantities: **{test}** "
            + ("(chosen by the A/A control above). " if calibrated else "(no A/A control in these records). ")
            + "p values Holm-adjusted within each family (predictions.md) and LR rank; intervals from the same method "
            "as the p values. The robustness rule: a claim stands only where both LR ranks agree. "
            f"\"{rules.UNDECIDED}\": with this many seeds the exact test's p cannot go below alpha after Holm (its "
            "floor), so no result could have been significant.", ""] + \
        md.table(["id", "claim", "best LRs: estimate", "p (Holm)", "verdict", "runner-up LRs: estimate", "p (Holm)",
                "verdict", "horizon ok", "verdict (both LRs)"], table)


def provenance_lines(rec: Records, meta: dict) -> list[str]:
    commits = Counter(r.get("commit") or "none recorded" for r in rec.runs + rec.e1)
    machines = Counter(r.get("machine") or "none recorded" for r in rec.runs + rec.e1)
    calls = meta.get("invocations", [])
    lines = [f"- {len(rec.runs)} training runs and {len(rec.e1)} E1 rows; their commits: "
             + ", ".join(f"{c} ({n})" for c, n in commits.most_common()) + "; machines: "
             + "; ".join(f"{m} ({n})" for m, n in machines.most_common()),
             f"- Invocations ({len(calls)}): " + " ; ".join(
                 f"`{c['command']}` at {c['commit']} ({c['wall_s'] / 60:.1f} min)" for c in calls)
             if calls else "- Invocations: none recorded in study.json (the study's own notes give its times)"]
    if calls and (outside := started_outside(rec.runs, calls)):
        lines.append(f"- **{outside} of {len(rec.runs)} runs started outside every invocation listed**: meta.json "
                     f"lacks the invocations that trained them (the study's own notes give their times)")
    if rec.unfinished:  # a study stopped part-way reports what it has: say what it does not have
        seeds = Counter(r["seed"] for r in rec.unfinished)
        lines.append(f"- **Not trained** (the study was stopped before them, or they crashed; left out): "
                     f"{len(rec.unfinished)} of {len(rec.runs) + len(rec.unfinished)} runs, by seed: "
                     + ", ".join(f"{seed} ({n})" for seed, n in sorted(seeds.items())))
    return lines


def moment(text: str) -> datetime:
    """A time as study.json and the records write it; one without an offset (study.json's invocations before
    they wrote it) is taken as UTC, the clock of every machine that ran these studies."""
    t = datetime.fromisoformat(text.replace(" ", "T"))
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def started_outside(runs: list[dict], calls: list[dict]) -> int:
    """How many runs started in none of the invocations (each from its start for its wall time): meta.json should
    list every invocation that trained the records (a run without a start time is not counted)."""
    spans = [(moment(c["started"]), moment(c["started"]) + timedelta(seconds=c["wall_s"])) for c in calls
             if c.get("started")]
    return sum(1 for r in runs if r.get("started_at")
               and not any(a <= moment(r["started_at"]) <= b for a, b in spans))


def test_of(rec: Records) -> str:
    """The test for continuous quantities: the A/A control's choice where the records hold one, else the exact
    sign-flip test."""
    aa = aa_section(rec)
    return aa["test"] if aa else "permutation"


def arm_means(rec: Records, rank: int) -> dict:
    """{arm: mean final validation accuracy over seeds} at an LR rank, for the arms the records hold there."""
    seeds = {a: list(per_seed(rec, a, rank, "accuracy").values()) for a in PRIMARY if choice(rec, a)}
    return {a: float(np.mean(v)) for a, v in seeds.items() if v and np.isfinite(np.mean(v))}


def comparison_lines(rec: Records, rows: list[dict], other: Records, other_name: str) -> list[str]:
    """How this study's answer differs from `other`'s, a study of the same arms at the same LRs (long_v4 against
    quick_v4, whose LRs it took): each claim's estimate and verdict in both, and each arm's mean final accuracy and
    rank among the arms at each LR rank."""
    theirs = {r["id"]: r for r in claim_rows(other, test_of(other))}
    claims = [[r["id"], r["claim"], theirs[r["id"]]["est"][0].fmt(), theirs[r["id"]]["est"][1].fmt(),
               f"**{theirs[r['id']]['verdict']}**", r["est"][0].fmt(), r["est"][1].fmt(), f"**{r['verdict']}**",
               "same" if theirs[r["id"]]["verdict"] == r["verdict"] else
               "undecided here" if r["verdict"] == rules.UNDECIDED else "**changed**"]
              for r in rows if r["id"] in theirs]
    arms = []
    for k, rank in enumerate(rules.RANKS):
        before, now = arm_means(other, k), arm_means(rec, k)
        order = {name: sorted(m, key=m.get, reverse=True) for name, m in (("before", before), ("now", now))}
        arms += [[a, rank, f"{before[a]:.3f}", order["before"].index(a) + 1, f"{now[a]:.3f}",
                  order["now"].index(a) + 1, f"{now[a] - before[a]:+.3f}"] for a in PRIMARY if a in before and a in now]
    return [f"## Against {other_name}", "",
            f"The same arms at the same LRs in {other_name}'s records: each claim's estimate (best LRs; runner-up "
            "LRs) and verdict in both, each with its own study's test.", ""] + \
        md.table(["id", "claim", f"{other_name}: best", f"{other_name}: runner-up", f"{other_name}: verdict",
                  "here: best", "here: runner-up", "here: verdict", "verdict"], claims) + \
        ["", "Each arm's mean final validation accuracy over seeds and its rank among the arms (1 = highest).", ""] + \
        md.table(["arm", "LR rank", f"{other_name}: accuracy", f"{other_name}: rank", "here: accuracy",
                  "here: rank", "change"], arms) + [""]


def write_markdown(rec: Records, meta: dict, signal: list[dict] = (), figures=(), compare=None) -> str:
    """report.md of a v4 study; `compare`: (name, Records) of the study whose answer this one re-tests."""
    aa = aa_section(rec)
    test = aa["test"] if aa else "permutation"
    rows = claim_rows(rec, test)
    lines = [f"# Study v4 ({meta.get('name') or 'unnamed'}): report", "",
             "Generated by `python scripts/report.py FOLDER` from the records alone. Predictions: "
             "[predictions.md](../predictions.md) (each preset's report is a folder of docs/study-v4/), committed "
             "before the runs.", ""] + provenance_lines(rec, meta) + [""] + \
        (["![each arm at its best and runner-up LR; validation accuracy over training](answer.png)", ""]
         if "answer.png" in figures else [])
    if aa:
        e = aa["estimate"]
        lines += ["## Calibration: the A/A control", "",
                  f"pre-LN at its best LR on seeds 0-9 against the same arm on seeds 10-19 ({aa['n'][0]} and "
                  f"{aa['n'][1]} runs): {e.fmt()}. Over 1,000 resamples of {AA_SEEDS} seeds from each set, the t test "
                  f"calls it significant {aa['fpr']['t']:.1%} of the time at alpha 0.05, the sign-flip test "
                  f"{aa['fpr']['permutation']:.1%}. Test used: **{test}**.", ""]
    else:
        lines += ["No A/A control in these records: the exact sign-flip test is used.", ""]
    sections = claim_lines(rows, test, aa is not None) + [dyt_relative_change(rec), ""] if rows else []
    sections += (comparison_lines(rec, rows, compare[1], compare[0]) if compare else []) + board_lines(rec) + \
        m1_lines(rec, list(signal)) + p2_lines(rec)
    return "\n".join(lines + sections) + "\n"
