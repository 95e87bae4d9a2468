"""Any study's report: report.md and its figures from the records and the spec snapshot alone (engine.py analyses;
scripts/report.py is the entry point; docs/studies.md says what the report reads and writes). Headed with the
study's own name, steps and seeds; a table cell without data says so, never NaN; a figure without data is not
drawn."""

import shutil
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from normlab.errors import RecordsError, StudyError
from normlab.files.formats import atomic_write_json
from normlab.paths import REPO_ROOT
from normlab.study import engine, rules
from normlab.study import markdown as md
from normlab.study import outcomes as oc
from normlab.study.plan import selection_arm
from normlab.study.records import RECORDS, SCHEMA_VERSION, keep_committed, read_records, write_records
from normlab.study.study_dir import COPIED, META, StudyDir
from normlab.tracking.wandb_report import log_study, where_logged


def copy_records(study_dir: Path, out: Path) -> None:
    """The study's records, each joined with the provenance study.json keeps for its run (the experiments that
    use it, commit, machine, start time), and its spec snapshot, LR selection and tables, into `out`. Where `out`
    already holds this study's committed records (its seeds continued in a fresh folder), those are kept and the
    study's join them (records.keep_committed); so are the invocations meta.json lists."""
    study_dir, folder = StudyDir(study_dir), StudyDir(out)
    rows, study = study_dir.scored_runs()
    for r in rows:
        for key, score in r.get("scores", {}).items():
            if key.startswith("dev/"):
                score.pop("pred", None)  # dev only chooses LRs, by its loss
    calls = study.get("invocations", [])
    if (out / RECORDS).is_file() and study_dir.path.resolve() != out.resolve():
        if study_dir.selection() != folder.selection():
            raise RecordsError(f"{study_dir.selection_file} differs from {folder.selection_file}: its runs were given "
                               f"other LRs than the committed records there, so they cannot join them")
        rows = keep_committed(read_records(out / RECORDS), rows)
        earlier = folder.meta().get("invocations", [])
        calls = earlier + [c for c in calls if c not in earlier]
    write_records(out / RECORDS, [{"schema_version": SCHEMA_VERSION, **r} for r in rows])
    for name in COPIED:
        if (study_dir / name).is_file() and study_dir.path.resolve() != out.resolve():
            shutil.copyfile(study_dir / name, out / name)
    atomic_write_json(folder.meta_file, {"name": study.get("name"), "invocations": calls}, indent=1)


def regenerate_command(folder: StudyDir, commit: str, repo: Path | None = None) -> str:
    """The shell line that regenerates a frozen study's report with `commit`'s code: `python -m` from a worktree at
    that commit, so that its own code runs there and not an installed checkout's (`repo`: where git runs)."""
    path = folder.path.resolve()
    where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return (f"git {f'-C {repo} ' if repo else ''}worktree add /tmp/at-{commit} {commit} && cd /tmp/at-{commit} && "
            f"python -m normlab.cli.report {where} --out /tmp/report-{commit}")


def refuse_frozen(folder: StudyDir) -> None:
    """A finished study's report regenerates at the commit it was frozen at, never at HEAD."""
    commit = folder.frozen_at()
    if commit:
        raise StudyError(f"{folder.path} is a finished study whose report regenerates at commit {commit} (meta.json): "
                         f"{regenerate_command(folder, commit, REPO_ROOT)}")


def load(folder: Path) -> engine.Study:
    """The records of a folder with its spec snapshot, ready for the engine; a frozen study is refused."""
    folder = StudyDir(folder)
    refuse_frozen(folder)
    return engine.Study(folder.records(), folder.selection(), folder.spec(), folder.tables())


def make_report(source: Path, out: Path | None = None, wandb_mode: str = "disabled",
                wandb_dir: Path | None = None) -> Path:
    """report.md and its figures in `out` (default: source); with a wandb_mode, the W&B report run's files go to
    wandb_dir (default: source), never into `out` unless it is that."""
    source, out = Path(source), Path(out or source)
    if not source.is_dir():  # (before `out`, which may be it, is created)
        raise RecordsError(f"{source}: no such folder; give a scored study directory or a folder of records")
    refuse_frozen(StudyDir(source))  # before anything is copied into `out`
    out.mkdir(parents=True, exist_ok=True)
    if StudyDir(source).is_study:
        copy_records(source, out)
    elif source.resolve() != out.resolve():  # a folder of records, reported elsewhere
        for name in (RECORDS, META, *COPIED):
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    analysis = engine.analyse(load(out))
    figures = draw_figures(analysis.study, out)
    meta = StudyDir(out).meta()
    reasons = any((folder / "predictions.md").is_file() for folder in (out, out.parent))  # a study's own write-up
    (out / "report.md").write_text(write_markdown(analysis, meta, figures, reasons))
    if wandb_mode != "disabled":
        (wandb_dir := Path(wandb_dir or source)).mkdir(parents=True, exist_ok=True)
        print(where_logged(log_to_wandb(analysis, out, figures, wandb_mode, wandb_dir), "report"))
    return out / "report.md"


# ---------------------------------------------------------------------------------------------------------------
# report.md


def write_markdown(a: engine.Analysis, meta: dict, figures: list[str], reasons: bool = True) -> str:
    """report.md; `reasons`: a predictions.md beside the study gives the predictions' reasons (else only the spec's
    hypotheses state them)."""
    study, spec = a.study, a.study.spec
    where = "predictions.md beside the study" if reasons else "the spec's hypotheses (spec.yaml)"
    lines = [f"# {spec.name}: report", "", *heading(study, a.test), "",
             "Generated by `python scripts/report.py FOLDER` from the records and the study's spec (spec.yaml) alone; "
             f"the predictions and their reasons: {where}.", "",
             *provenance_lines(study, meta), "", *[f"![{f}]({f})" for f in figures], ""]
    if not any(study.arm(arm, 0) for arm in spec.arms()):  # only sweeps ran: a scorecard would read "undecided"
        return "\n".join(lines + ["No prediction is scored yet: the arms have not trained at their chosen LRs."]) + "\n"
    lines += scorecard_lines(a) + aa_lines(a) + test_lines(a) + bound_lines(a) + correlation_lines(a) + \
        arm_lines(study)
    return "\n".join(lines) + "\n"


def heading(study: engine.Study, test: str) -> list[str]:
    """What ran: arms, steps, seeds (as the records hold them, a narrowed study's too)."""
    spec = study.spec
    arms = [a for a in spec.arms() if study.arm(a, 0)]
    runs = [r for a in arms for r in study.arm(a, 0)]
    seeds = sorted({r.seed for r in runs})
    ranks = "its best and its runner-up LR on dev" if spec.ranks() == 2 else "its best LR on dev"
    if arms and all(a in spec.pin for a in arms):  # no sweep chose them: the report's "best" is the first pinned LR
        ranks = "the LRs the spec fixes (" + " and ".join(
            "/".join(sorted({f"{lr:g}" for a in arms if (lr := study.lr(a, k)) is not None}))
            for k in range(spec.ranks())) + ")"
    return [f"{len(arms)} arms, each at {ranks}; {steps_text(runs)} steps; {len(seeds)} "
            f"seed{'s' * (len(seeds) != 1)} ({', '.join(map(str, seeds))}). Test: {TESTS[test]}; "
            f"alpha {spec.alpha:g}, Holm within each family and LR rank."] if runs else \
        ["No arm has finished runs at a chosen LR yet: nothing to compare."]


TESTS = {"permutation": "exact paired sign-flip test over seeds", "t": "paired t test (the A/A control allows it)"}


def scorecard_lines(a: engine.Analysis) -> list[str]:
    rows = [[r.h.id, r.h.role, r.h.claim or f"{r.h.outcome}: {describe(r.h)}", r.h.predicted + declared(r.h),
             r.verdict + ratio_read(r), r.score] for r in a.results]
    rows += [[c["h"].id, c["h"].role, c["h"].claim, c["h"].predicted, c["verdict"], c["score"]]
             for c in a.correlations]
    if not rows:
        return ["No hypotheses in this study's spec: the arms' numbers below, nothing tested.", ""]
    return ["## Scorecard", "", f"Every prediction and its result (\"{rules.UNDECIDED}\": the exact test's "
            "smallest p at these seeds, after Holm, is not below alpha, so no result could have been significant; a "
            "predicted \"not separated\" that separated failed).", "",
            *md.table(["id", "role", "prediction", "predicted", "result", "score"], rows)]


def declared(h) -> str:
    """What a prediction declares beyond its sign: a ratio its arms must reach, the margin of a tie."""
    return (f"; a / b {h.ratio} (geometric mean over seeds)" if h.ratio else "") + \
        (f", interval within +-{h.within:g}" if h.within is not None else "")


def ratio_read(r: engine.Result) -> str:
    """The declared ratio as read at each LR rank."""
    if not r.ratios:
        return ""
    return "; ratio " + ", ".join(f"{rules.RANKS[k]} LRs " + ("no runs yet" if met is None else f"{geo:.3g} "
                                  f"({'met' if met else 'not met'})") for k, (geo, _, met) in r.ratios.items())


def describe(h) -> str:
    if h.contrast in ("main_effect", "interaction"):
        return " x ".join(h.factors)
    return f"{describe_side(h.a)} - {describe_side(h.b)}"


def describe_side(arms) -> str:
    """An arm, or a group of arms as {a, b}."""
    return arms if isinstance(arms, str) else "{" + ", ".join(arms) + "}"


def aa_lines(a: engine.Analysis) -> list[str]:
    if a.aa is None:
        return []
    aa = a.study.spec.aa
    if "too_few" in a.aa:
        n = a.aa["too_few"]
        return ["## The A/A control", "", f"{aa.arm} on two seed sets: {n[0]} and {n[1]} runs, under the "
                f"{aa.resample} a resample needs: {rules.UNDECIDED}; the exact sign-flip test is used.", ""]
    e, fpr = a.aa["estimate"], a.aa["fpr"]
    return ["## The A/A control", "",
            f"{aa.arm} at its best LR on the board's seeds against {aa.copy or 'itself'} on the `{aa.experiment}` "
            f"seeds ({a.aa['n'][0]} and {a.aa['n'][1]} runs), {aa.outcome}: {e.mean:+.3f} [{e.lo:+.3f}, {e.hi:+.3f}] "
            f"(p={e.p:.3g}, n={e.n}, {e.test}). Over 1,000 resamples of {aa.resample} seeds from each "
            f"set, the t test calls it significant {fpr['t']:.1%} of the time at alpha 0.05, the sign-flip test "
            f"{fpr['permutation']:.1%}. Test used: **{a.test}**.", ""]


def test_lines(a: engine.Analysis) -> list[str]:
    if not a.results:
        return []
    ranks = range(a.study.spec.ranks())
    rows = []
    for r in a.results:
        cells = [engine.fmt(r.est[k], r.p[k], r.floor[k]) + f": {r.verdicts[k]}" if k in r.est else "-"
                 for k in ranks]
        hz = {None: "n/a", True: "yes", False: f"no: {r.horizon[1]}"}[r.horizon[0]]
        rows.append([r.h.id, r.h.outcome, describe(r.h), r.h.predicted, *cells, hz, f"**{r.verdict}**"])
    header = ["id", "outcome", "contrast", "predicted"] + \
        [f"{rules.RANKS[k]} LRs: estimate [95% CI] \\| Holm p (floor), n: verdict" for k in ranks] + \
        ["horizon ok", "verdict"]
    return ["## Tests", "", "Per seed, each arm at its own LR of that rank; a verdict only where every LR rank agrees "
            "(else \"depends on the LR\"). The horizon rule (outcomes read at the end of training): every arm "
            f"compared left the plateau within the first {rules.HORIZON_FRACTION:.0%} of its steps and their ranking "
            "held over the last two evaluations.", "", *md.table(header, rows)]


def bound_lines(a: engine.Analysis) -> list[str]:
    """The declared bounds on every run (`every_run`), each side's lowest and highest value against its bound."""
    rows = [[r.h.id, r.h.outcome, rules.RANKS[k], describe_side(getattr(r.h, side)), bound,
             f"{lo:.3g} .. {hi:.3g}" if n else "-", n, {True: "met", False: "**not met**", None: "no runs yet"}[met]]
            for r in a.results for k, found in r.bounds.items() for side, bound, lo, hi, n, met in found]
    if not rows:
        return []
    return ["## Declared bounds on every run", "", "A bound the spec declares for every run of one side of a "
            "contrast (`every_run`), at each LR rank; the prediction fails where a run is outside it.", "",
            *md.table(["id", "outcome", "LRs", "arms", "bound", "lowest .. highest", "runs", "result"], rows)]


def correlation_lines(a: engine.Analysis) -> list[str]:
    if not a.correlations:
        return []
    rows = [[c["h"].id, f"{c['h'].outcome} vs {c['h'].against}", ", ".join(c["h"].arms),
             f"{c['rho']:+.2f}" if np.isfinite(c["rho"]) else "-", f"{c['p']:.3g}" if np.isfinite(c["p"]) else "-",
             f"**{c['verdict']}**"] for c in a.correlations]
    return ["## Rank correlations over arms", "", "Spearman's rho between the arms' medians over seeds (best LR); "
            "exact one-sided p over every ordering.", "",
            *md.table(["id", "outcomes", "arms", "rho", "p", "verdict"], rows)]


def arm_lines(study: engine.Study) -> list[str]:
    rows = []
    for k in range(study.spec.ranks()):
        arms = {a: study.arm(a, k) for a in study.spec.arms()}
        arms = {a: v for a, v in arms.items() if v}
        hz = rules.horizon(arms) if arms else {}
        for arm, runs in arms.items():
            outs = [oc.run_outcome(r) for r in runs]
            exit_ = hz[arm]["median_exit"]
            rows.append([arm, rules.RANKS[k], f"{study.lr(arm, k):g}", len(runs),
                         md.mean_ci([r.score() for r in runs]), md.mean_ci([r.score("loss") for r in runs]),
                         "never" if not np.isfinite(exit_) else f"{exit_:.0f}",
                         " / ".join(str(outs.count(o)) for o in oc.RUN_OUTCOMES),
                         "yes" if hz[arm]["settled"] else "no", "yes" if hz[arm]["ok"] else "**no**"])
    if not rows:
        return []
    return ["## Arms", "", "Validation, mean ± 95% t half-width over seeds (one seed: its value). Outcomes: learned "
            f"/ never learned / diverged. Plateau exit: the median step the train loss, as a moving mean over "
            f"{window_words(study.runs)}, fell below ln 2 - 0.05. Rank settled: the arm's place among all "
            "the arms at its LR rank is the same at the last two evaluations; horizon: that, and the median exit "
            "within the first third. A hypothesis's horizon reads only the arms it compares, so it can hold where "
            "this table says no.", "",
            *md.table(["arm", "LR rank", "LR", "seeds", "final accuracy", "final loss", "median exit", "outcomes",
                       "rank settled", "horizon"], rows)]


def window_words(runs) -> str:
    """The outcome rules' moving mean as these runs had it: `640 examples (40 steps of 16)`."""
    sizes = sorted({(oc.run_window(r), r.examples_per_step) for r in runs}, key=lambda w: (w[0], w[1] or 0))
    steps = [f"{w} steps of {n}" if n else f"{w} steps, in records that do not say their batch size" for w, n in sizes]
    return f"{oc.WINDOW_EXAMPLES} examples ({'; '.join(steps)})"


def provenance_lines(study: engine.Study, meta: dict) -> list[str]:
    runs = study.runs
    commits = Counter(r.commit or "none recorded" for r in runs)
    machines = Counter(r.machine or "none recorded" for r in runs)
    calls = meta.get("invocations", [])
    lines = [f"- {len(runs)} training runs; their commits: " + ", ".join(f"{c} ({n})" for c, n in commits.most_common())
             + "; machines: " + "; ".join(f"{m} ({n})" for m, n in machines.most_common()),
             f"- Invocations ({len(calls)}): " + " ; ".join(
                 f"`{c['command']}` at {c['commit']} ({c['wall_s'] / 60:.1f} min)" for c in calls)
             if calls else "- Invocations: none recorded"]
    if calls and (outside := started_outside(runs, calls)):
        lines.append(f"- **{outside} of {len(runs)} runs started outside every invocation listed**: meta.json "
                     f"lacks the invocations that trained them")
    if study.unfinished:
        seeds = Counter(r.seed for r in study.unfinished)
        lines.append(f"- **Not trained** (the study was stopped before them, or they crashed; left out): "
                     f"{len(study.unfinished)} of {len(runs) + len(study.unfinished)} runs, by seed: "
                     + ", ".join(f"{seed} ({n})" for seed, n in sorted(seeds.items())))
    return lines


def moment(text: str) -> datetime:
    """A time as study.json and the records write it; one without an offset is taken as UTC."""
    t = datetime.fromisoformat(text.replace(" ", "T"))
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def started_outside(runs: list, calls: list[dict]) -> int:
    """How many runs started in none of the invocations (each from its start for its wall time)."""
    spans = [(moment(c["started"]), moment(c["started"]) + timedelta(seconds=c["wall_s"])) for c in calls
             if c.get("started")]
    return sum(1 for r in runs if r.started_at and not any(a <= moment(r.started_at) <= b for a, b in spans))


# ---------------------------------------------------------------------------------------------------------------
# figures and the W&B run


def steps_text(runs: list) -> str:
    """The runs' length in steps, "832-3328" where arms of several batch sizes step differently over the same
    data (the longest run of each batch size)."""
    longest = {}
    for r in runs:
        longest[r.examples_per_step] = max(longest.get(r.examples_per_step, 0), r.steps)
    lengths = sorted(set(longest.values())) or [0]
    return "-".join(map(str, dict.fromkeys([lengths[0], lengths[-1]])))


def draw_figures(study: engine.Study, out: Path) -> list[str]:
    """answer.png (each arm's final accuracy at each rank, and its accuracy over training) and sweep.png (the dev
    loss by LR each arm's choice read), where the records have what they show; stale ones are removed."""
    from normlab.files.figures import save_figure
    from normlab.study import plots

    board = {a: tuple(study.arm(a, k) for k in range(study.spec.ranks())) for a in study.spec.arms()}
    board = {a: runs for a, runs in board.items() if runs[0]}
    colours = plots.arm_colours(study.spec.arms() + [selection_arm(k) for k in sorted(study.selection)])
    drawn = {"answer.png": plots.plot_board(board, f"{study.spec.name}: each arm at its chosen LRs "
                                                   f"({steps_text([r for v in board.values() for r in v[0]])} steps)",
                                            colours, StudyDir(out).majority_share())
             if board else None,
             "sweep.png": plots.plot_sweep(study.selection, f"{study.spec.name}: mean dev loss over the sweep's seeds; "
                                                            f"a star at each arm's best LR", colours)
             if any(c.get("by_lr") for c in study.selection.values())
             else None}
    for name, fig in drawn.items():
        if fig is None:
            (out / name).unlink(missing_ok=True)
        else:
            fig.tight_layout()
            save_figure(fig, out / name, dpi=110)
    return [name for name, fig in drawn.items() if fig is not None]


def log_to_wandb(a: engine.Analysis, out: Path, figures: list[str], mode: str, wandb_dir: Path) -> dict | None:
    """The report as a W&B run in the study's group (its files in wandb_dir/wandb): every run a row, the scorecard
    a table, the figures images."""
    fields = ("name", "experiment", "variant", "lr", "warmup", "seed", "status", "norm", "placement", "commit")
    rows = [{**{k: r.to_dict().get(k) for k in fields}, "val_accuracy": r.score(), "val_loss": r.score("loss")}
            for r in a.study.runs]
    table = [{"id": r.h.id, "claim": r.h.claim, "predicted": r.h.predicted, "verdict": r.verdict, "score": r.score}
             for r in a.results]
    images = {name.removesuffix(".png"): out / name for name in figures}
    return log_study(wandb_dir, a.study.spec.name, rows, {}, table, images, mode)
