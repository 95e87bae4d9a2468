"""Study v5's report (docs/study-v5/predictions.md): a factorial design tested by intervention. Each cell of the
design is a variant whose level of every factor the preset's `factors` block gives; cells that committed records
already hold (`reuse`) are read from there, after the preset's `check` runs showed that this code reproduces them.
Per seed and LR rank, every main effect and interaction is a contrast over the cells; each is tested with the
exact sign-flip test, Holm over one outcome's contrasts, and a claim stands only where both LR ranks agree."""

import itertools
import math
from pathlib import Path

import numpy as np

from normlab.files.formats import read_yaml
from normlab.study import markdown as md
from normlab.study import report_v4 as v4
from normlab.study import rules
from normlab.study.analysis import Records, by_seed, value
from normlab.study.grid import REPO_ROOT, StudyError, resolve_preset
from normlab.study.records import record_digest
from normlab.study.seedstats import holm, t_interval

TEST = "permutation"  # exact sign-flip: needs no calibration, its floor is planned
CHECK = "check"
CENTER = ("C", "ln_ln_off_center", "ln_ln_off", -1)  # claim id, arm, its reference cell, predicted sign
OUTCOMES = {"exit": ("plateau exit step", -1), "accuracy": ("validation accuracy at the end", +1)}


def design_of(meta: dict) -> dict | None:
    """The preset's factorial design ({factors, reuse}) for a study named in meta.json, or None (not v5)."""
    try:
        preset = read_yaml(resolve_preset(meta.get("name") or ""))
    except (StudyError, FileNotFoundError, OSError):
        return None
    return {"factors": preset["factors"], "reuse": preset.get("reuse")} if preset.get("factors") else None


class Design:
    """The cells, their factor levels, and where each cell's runs are: this study's records, or reused ones."""

    def __init__(self, rec: Records, design: dict, load):
        self.rec, self.design = rec, design
        # YAML reads off/on as booleans: the levels are words again
        self.factors = {cell: {f: ({True: "on", False: "off"}[v] if isinstance(v, bool) else str(v))
                               for f, v in levels.items()} for cell, levels in design["factors"].items()}
        reuse = design.get("reuse") or {}
        self.reused = dict(reuse.get("cells") or {})
        self.retrained = dict(reuse.get("retrained") or {})  # cell -> this study's experiment that retrained it
        self.source = reuse.get("records")
        self.old = load(REPO_ROOT / self.source) if self.reused else None
        self.names = sorted({f for levels in self.factors.values() for f in levels})
        self.levels = {f: sorted({cell[f] for cell in self.factors.values()}, key=_level_order) for f in self.names}

    def runs(self, cell: str, rank: int) -> list[dict]:
        """A cell's (or another arm's) runs at its best (rank 0) or runner-up LR: retrained here at the reused
        study's LRs, else the reused study's own, else this study's board."""
        if cell in self.retrained:
            lr = rules.lr_of_rank(v4.choice(self.old, self.reused[cell]), rank)
            # the check's run is the retrained cell's too at its seed and LR (a shared run, trained first)
            runs = {r["name"]: r for e in (CHECK, self.retrained[cell]) for r in self.rec.arm(e, cell, "on", lr)}
            return sorted(runs.values(), key=lambda r: r["seed"])
        if cell in self.reused:
            return v4.runs_at(self.old, self.reused[cell], rank)
        return v4.runs_at(self.rec, cell, rank)

    def committed_only(self) -> "Design":
        """The same design with the reused cells read from the committed records even where retrained here."""
        reuse = {**self.design["reuse"], "retrained": {}}
        return Design(self.rec, {**self.design, "reuse": reuse}, load=lambda path: self.old)

    def per_seed(self, cell: str, rank: int, field: str) -> dict:
        return by_seed(self.runs(cell, rank), _fn(field))

    def cell(self, **levels) -> str:
        return next(c for c, lv in self.factors.items() if all(lv[f] == v for f, v in levels.items()))


def _fn(field: str):
    """A run's value of `field`: its plateau exit (or its length), else a validation score."""
    return v4.exit_or_end if field == "exit" else (lambda r: value(r, field))


def _level_order(level: str) -> tuple:
    """The reference level first: LN before masked BN, off before on."""
    return (level not in ("ln", "off"), level)


def contrast(d: Design, table: dict, factors: tuple) -> float:
    """One seed's contrast over the cells (`table`: cell -> value): for one factor its main effect (level 2 -
    level 1, averaged over the other factors' level pairs); for several, the interaction: the difference of the
    lower-order contrast between the last factor's two levels, averaged over the factors not named."""
    rest = [f for f in d.names if f not in factors]
    total = []
    for fixed in itertools.product(*(d.levels[f] for f in rest)):
        base = dict(zip(rest, fixed))
        signs = itertools.product(*((-1, 1) for _ in factors))
        total.append(sum(math.prod(s) * table[d.cell(**base, **{f: d.levels[f][(x + 1) // 2]
                                                             for f, x in zip(factors, s)})]
                         for s in signs))
    return float(np.mean(total))


def contrasts(d: Design) -> list[tuple]:
    return [c for k in range(1, len(d.names) + 1) for c in itertools.combinations(d.names, k)]


def contrast_rows(d: Design, field: str) -> list[dict]:
    """Every contrast of `field` at both LR ranks: per-seed values, estimate, Holm p over the family, verdict."""
    rows = {c: {"contrast": " x ".join(c), "by_rank": {}, "nonzero": {}} for c in contrasts(d)}
    for rank in (0, 1):
        tables = {cell: d.per_seed(cell, rank, field) for cell in d.factors}
        seeds = sorted(set.intersection(*(set(t) for t in tables.values())))
        values = {c: [contrast(d, {k: t[s] for k, t in tables.items()}, c) for s in seeds] for c in rows}
        ests = {c: rules.estimate(v, TEST) for c, v in values.items()}
        adjusted = holm({c: e.p for c, e in ests.items()})
        for c, e in ests.items():
            rows[c]["by_rank"][rank] = (e, adjusted[c])
            rows[c]["nonzero"][rank] = int(np.count_nonzero(np.abs(values[c]) > 1e-12))
    return list(rows.values())


def center_row(d: Design, field: str) -> dict:
    """The centring arm against its reference cell, per seed, at both ranks (a family of one)."""
    claim, arm, ref, sign = CENTER
    by_rank, nonzero = {}, {}
    for rank in (0, 1):
        a, b = d.per_seed(arm, rank, field), d.per_seed(ref, rank, field)
        e = rules.estimate([a[s] - b[s] for s in sorted(set(a) & set(b))], TEST)
        by_rank[rank] = (e, e.p)
        nonzero[rank] = sum(1 for s in set(a) & set(b) if a[s] != b[s])
    return {"contrast": f"{arm} - {ref}", "by_rank": by_rank, "nonzero": nonzero, "sign": sign, "id": claim}




def check_lines(d: Design) -> list[str]:
    """Each reused cell's seed-0 run retrained here (`check`) against its committed record."""
    lines = []
    for cell, old_name in d.reused.items():
        new = [r for r in d.rec.runs if CHECK in r.get("experiments", [r["experiment"]]) and r["variant"] == cell]
        old = [r for r in v4.runs_at(d.old, old_name, 0) if new and r["seed"] == new[0]["seed"]]
        same = bool(new and old) and record_digest(new[0]) == record_digest(old[0])
        what = "no check run" if not new else ("reproduced exactly (same digest of every measurement)" if same
                                               else "differs from the committed record")
        machines = f" (here: {new[0].get('machine')}; committed: {old[0].get('machine')})" if new and old else ""
        used = (f"; the design uses the cell retrained here (`{d.retrained[cell]}`)" if cell in d.retrained
                else "; the design uses the committed runs")
        lines.append(f"- `{cell}` = {d.source}'s `{old_name}`, seed {new[0]['seed'] if new else '-'}: {what}"
                     f"{machines}{used}")
    return lines


def committed_lines(d: Design) -> list[str]:
    """Where cells were retrained: each one here against its committed runs, and the exit contrasts with the
    committed runs in their place (the same seeds and LRs, another machine)."""
    if not d.retrained:
        return []
    old = d.committed_only()
    rows = []
    for cell in d.retrained:
        for rank in (0, 1):
            here, there = d.runs(cell, rank), old.runs(cell, rank)
            rows.append([f"`{cell}`", rules.RANKS[rank], f"{np.median([v4.exit_or_end(r) for r in here]):.0f}",
                         f"{np.median([v4.exit_or_end(r) for r in there]):.0f}",
                         md.mean_ci([value(r, 'accuracy') for r in here]),
                         md.mean_ci([value(r, 'accuracy') for r in there])])
    lines = md.table(["cell", "LR rank", "median exit here", "committed", "accuracy here", "committed"], rows)
    effects = []
    for row, c in zip(contrast_rows(old, "exit"), contrasts(old)):
        effects.append([row["contrast"], _fmt(row, 0, len(contrasts(old))), _fmt(row, 1, len(contrasts(old)))])
    return [*lines, "The exit contrasts with the committed runs of those cells in place of the retrained ones:", "",
            *md.table(["contrast", "best LRs", "runner-up LRs"], effects)]


# predicted signs (docs/study-v5/predictions.md); a contrast without one is reported as separated or not
PREDICTED = {("exit", ("final",)): -1, ("exit", ("emb",)): -1, ("accuracy", ("final",)): +1}


def verdict(row: dict, sign: int | None, family: int, alpha: float = rules.ALPHA) -> str:
    """The robustness rule over both ranks; without a predicted sign, 'separated (+/-)' or 'not separated'. A
    test whose floor (at the pairs that differed, after Holm) is not below alpha could not decide anything."""
    floor = max(rules.test_floor(n, family) for n in row["nonzero"].values())
    if not floor < alpha:
        return f"{rules.UNDECIDED} (p >= {floor:.3g})"
    if sign is not None:
        return rules.robust_verdict(row["by_rank"], sign, alpha)
    each = {("not separated" if not p < alpha else f"separated ({'+' if e.mean > 0 else '-'})")
            for e, p in row["by_rank"].values()}
    return each.pop() if len(each) == 1 else rules.DEPENDS


def horizon_ok(d: Design) -> dict:
    """{rank: every cell's median exit within the first third and the cells' ranking settled}."""
    out = {}
    for rank in (0, 1):
        arms = {cell: d.runs(cell, rank) for cell in d.factors}
        steps = max(v4.steps_of(r) for r in arms.values())
        out[rank] = all(h["ok"] for h in rules.horizon(arms, steps).values())
    return out


def spread_by_arm(signal: list[dict]) -> dict:
    """{arm: mean over seeds of 1 - pooled cosine after the signal block's last step} (the manipulation check)."""
    arms = {}
    for row in signal:
        arms.setdefault(row["variant"], []).append(1 - row["cosine"][-1])
    return {a: float(np.mean(v)) for a, v in arms.items()}


def _fmt(row: dict, rank: int, family: int) -> str:
    """estimate [interval] | Holm p (the floor at the pairs that differed, after Holm)."""
    e, p_adj = row["by_rank"][rank]
    floor = rules.test_floor(row["nonzero"][rank], family)
    return f"{e.mean:+.3g} [{e.lo:+.3g}, {e.hi:+.3g}] \\| {p_adj:.3g} (floor {floor:.3g})"


def effect_lines(d: Design, field: str, horizon: dict | None = None) -> list[str]:
    title, _ = OUTCOMES[field]
    rows = contrast_rows(d, field)
    family = len(rows)
    out = []
    for row, c in zip(rows, contrasts(d)):
        sign = PREDICTED.get((field, c))
        v = verdict(row, sign, family)
        if horizon is not None and not all(horizon.values()) and v != "not separated":
            v = f"{v}; {rules.HORIZON_TOO_SHORT}"
        best, runner = (_fmt(row, r, family) for r in (0, 1))
        predicted = {None: "-", -1: "< 0", 1: "> 0"}[sign]
        out.append([row["contrast"], predicted, best, runner, f"**{v}**"])
    header = ["contrast", "predicted", "best LRs: estimate [95% CI] \\| Holm p (floor)", "runner-up LRs", "verdict"]
    return [f"### {title}", "", *md.table(header, out), ""]


def cell_lines(d: Design, spread: dict) -> list[str]:
    """Per cell (and the centring arm) at each rank: its LR, exits, final accuracy, the 16-step spread."""
    rows = []
    for cell in [*d.factors, CENTER[1]]:
        for rank in (0, 1):
            runs = d.runs(cell, rank)
            if not runs:
                continue
            exits = [v4.exit_or_end(r) for r in runs]
            levels = d.factors.get(cell, {"block": "ln", "final": "ln", "emb": "off", "centred": "yes"})
            rows.append([f"`{cell}`", ", ".join(f"{f} {v}" for f, v in levels.items()), rules.RANKS[rank],
                         f"{runs[0]['lr']:.3g}", f"{np.median(exits):.0f}", _mean_ci_steps(exits),
                         md.mean_ci([value(r, 'accuracy') for r in runs]), f"{spread.get(cell, math.nan):.3g}",
                         "reused" if cell in d.reused and cell not in d.retrained else "here", len(runs)])
    header = ["cell", "levels", "LR rank", "LR", "median exit", "mean exit", "final accuracy", "16-step spread",
              "runs", "seeds"]
    return md.table(header, rows)


def _mean_ci_steps(exits) -> str:
    lo, hi = t_interval(np.asarray(exits, dtype=float))
    return f"{np.mean(exits):.0f} ± {(hi - lo) / 2:.0f}"


def manipulation_lines(d: Design, signal: list[dict], high: float = 0.5, low: float = 0.05) -> list[str]:
    """Prediction M: the 16-step spread is above `high` where a batch statistic comes last (a masked-BN final
    norm, the centring) and below `low` where LN does; the cells that break it."""
    spread = spread_by_arm(signal)
    expect = {cell: ("high" if lv["final"] == "mbn" else "low") for cell, lv in d.factors.items()}
    expect[CENTER[1]] = "high"
    broken = [f"`{c}` ({spread[c]:.3g}, predicted {e})" for c, e in expect.items() if c in spread
              and not (spread[c] > high if e == "high" else spread[c] < low)]
    verdict = "holds" if not broken else f"fails in {len(broken)} of {len(expect)} arms: " + ", ".join(broken)
    return [f"Predicted: 1 - cosine after 16 steps > {high} where masked BN is the final norm or the pooled vector "
            f"is centred, < {low} where LN is the final norm (means over {len({r['seed'] for r in signal})} seeds, "
            f"LR {signal[0]['lr'] if signal else '-'}). "
            f"It {verdict}.", ""]


def center_lines(d: Design) -> list[str]:
    rows = []
    for field, (title, _) in OUTCOMES.items():
        row = center_row(d, field)
        sign = row["sign"] if field == "exit" else None
        rows.append([row["contrast"], title, _fmt(row, 0, 1), _fmt(row, 1, 1), f"**{verdict(row, sign, 1)}**"])
    return md.table(["comparison", "outcome", "best LRs: estimate [95% CI] \\| p (floor)", "runner-up LRs",
                     "verdict"], rows)


def aa_lines(d: Design) -> list[str]:
    """The sign-flip test on a real A/A pair (the reused records' pre-LN on two disjoint seed sets), for exits."""
    if d.old is None:
        return ["No A/A runs in the reused records."]
    a = list(by_seed(v4.runs_at(d.old, "ln_pre", 0), v4.exit_or_end).values())
    b = list(by_seed(v4.runs_at(d.old, "ln_pre", 0, experiment="aa"), v4.exit_or_end).values())
    if len(a) < v4.AA_SEEDS or len(b) < v4.AA_SEEDS:
        return ["Too few A/A seeds in the reused records."]
    rates = rules.aa_false_positive_rates(a, b, v4.AA_SEEDS, tests=(TEST,))
    return [f"A/A control on the plateau exit ({d.source}'s pre-LN at its best LR, seeds 0-9 against 10-19; "
            f"{v4.AA_SEEDS} seeds per resample): the sign-flip test called {rates[TEST]:.1%} of 1,000 resamples "
            f"significant at alpha 0.05 (it must be at most 5%)."]


def write_report(rec: Records, meta: dict, design: dict, load, signal: list[dict], out: Path) -> str:
    """report.md's text and answer.png in `out`; `load` reads a folder of committed records (report.load)."""
    d = Design(rec, design, load)
    spread = spread_by_arm(signal)
    hz = horizon_ok(d)
    figures = figure(d, spread, out, f"{meta.get('name') or out.name}: plateau exit by cell, and the spread")
    lines = ["# Study v5: what makes pre-LN leave the plateau late, by intervention", "",
             "Predictions, tests and floors: [predictions.md](../predictions.md), written before the board runs. "
             "Every contrast is per seed, each cell at its own best (then runner-up) LR; exact sign-flip test, Holm "
             "over one outcome's seven contrasts; a verdict only where both LR ranks agree.", "",
             *[f"![{f}]({f})" for f in figures], "", "## Reused cells", "", *check_lines(d), "",
             *committed_lines(d),
             "## Cells", "", *cell_lines(d, spread),
             f"Horizon rule for accuracy (every cell's median exit in the first third, ranking settled over the last "
             f"two evaluations): best LRs {'met' if hz[0] else 'not met'}, runner-up LRs "
             f"{'met' if hz[1] else 'not met'}.", "", "## Manipulation check: the 16-step spread", "",
             *manipulation_lines(d, signal), "## Effects", "",
             *effect_lines(d, "exit"), *effect_lines(d, "accuracy", hz),
             "## The centring arm", "", *center_lines(d), "## Calibration", "", *aa_lines(d), "",
             "## Provenance", "", *v4.provenance_lines(rec, meta)]
    return "\n".join(lines) + "\n"


def figure(d: Design, spread: dict, out: Path, title: str) -> list[str]:
    """answer.png: each cell's exits and 16-step spread (plots.plot_factorial)."""
    from normlab.study import plots

    cells = [{"name": cell, "final": d.factors[cell]["final"], "spread": spread.get(cell, math.nan),
              "exits": {r: [v4.exit_or_end(x) for x in d.runs(cell, r)] for r in (0, 1)}} for cell in d.factors]
    arm = CENTER[1]
    cells.append({"name": arm, "final": "centred", "spread": spread.get(arm, math.nan),
                  "exits": {r: [v4.exit_or_end(x) for x in d.runs(arm, r)] for r in (0, 1)}})
    fig = plots.plot_factorial(cells, title)
    fig.savefig(out / "answer.png", dpi=110)
    plots.plt.close(fig)
    return ["answer.png"]
