"""Study v3's report: report.md and its figures, regenerated from the committed records alone (scripts/report.py
is the entry point; docs/studies.md says what the report reads and writes)."""

import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from normlab.errors import RecordsError
from normlab.files.formats import atomic_write_json, read_json, read_jsonl
from normlab.study import markdown as md
from normlab.study import outcomes as oc
from normlab.study import plots, report_v4, report_v5
from normlab.study.analysis import (
    BATCH_STAT,
    DEV,
    Records,
    by_seed,
    leaderboard,
    outcome_grid,
    outcome_of,
    paired,
    value,
)
from normlab.study.hypotheses import flip_table, verdicts
from normlab.study.records import RECORDS, keep_committed, read_records, write_records
from normlab.study.seedstats import paired_test
from normlab.study.selection_file import read_selection

COPIED = ("selection.json", "e1.jsonl", "labels.json", "signal.jsonl")  # as the study wrote them


def copy_records(study_dir: Path, out: Path) -> None:
    """The study's records, each joined with the provenance study.json keeps for its run (the experiments that
    use it, commit, machine, start time), and the LR selection and E1 rows, into `out`. Where `out` already holds
    this study's committed records (its seeds continued in a fresh folder), those are kept and the study's join them
    (records.keep_committed); so are the invocations meta.json lists."""
    if not (study_dir / "runs.jsonl").is_file():
        raise FileNotFoundError(f"{study_dir}/runs.jsonl not found: score the study first "
                                f"(python scripts/score_runs.py {study_dir})")
    study = read_json(study_dir / "study.json")
    rows = []
    for r in read_jsonl(study_dir / "runs.jsonl"):
        entry = study["runs"].get(r["name"], {})
        r.update({k: entry[k] for k in ("experiments", "commit", "machine", "started_at") if k in entry})
        for key, score in r.get("scores", {}).items():
            if key.startswith("dev/"):
                score.pop("pred", None)  # dev only chooses LRs, by its loss
        rows.append(r)
    calls = study.get("invocations", [])
    if (out / RECORDS).is_file() and study_dir.resolve() != out.resolve():
        check_same_selection(study_dir, out)
        rows = keep_committed(read_records(out / RECORDS), rows)
        earlier = (read_json(out / "meta.json", {}) or {}).get("invocations", [])
        calls = earlier + [c for c in calls if c not in earlier]
    write_records(out / RECORDS, rows)
    for name in COPIED:
        if (study_dir / name).is_file() and study_dir.resolve() != out.resolve():
            shutil.copyfile(study_dir / name, out / name)
    atomic_write_json(out / "meta.json", {"name": study.get("name"), "invocations": calls}, indent=1)


def check_same_selection(study_dir: Path, out: Path) -> None:
    """Records join committed ones only when their runs trained at the same LR choice."""
    if read_selection(study_dir / "selection.json") != read_selection(out / "selection.json"):
        raise RecordsError(f"{study_dir}/selection.json differs from {out}/selection.json: its runs were given other "
                           f"LRs than the committed records there, so they cannot join them (give another --out)")


def load(folder: Path) -> Records:
    folder = Path(folder)
    selection = read_selection(folder / "selection.json")
    return Records(read_records(folder / RECORDS), selection, read_jsonl(folder / "e1.jsonl"))


def verdict_lines(aa: dict, hyps: list) -> list[str]:
    est = aa["estimate"]
    lines = ["## Calibration: the A/A control", "",
             f"The hand-written LayerNorm against torch's, at the same LR and seeds (the same model): mean paired "
             f"accuracy difference {est.fmt()}. Resampling its {est.n} per-seed differences, the paired t test calls "
             f"it significant {aa['fpr']['t']:.1%} of the time at alpha 0.05, the sign-flip permutation test "
             f"{aa['fpr']['permutation']:.1%}. Test used below for continuous quantities: **{aa['test']}**"
             f"{'' if aa['ok'] else ' (the t test failed the calibration rule)'}.", "",
             "## Verdicts", ""]
    rows = [[h.id + ("" if h.primary else " (secondary)"), h.claim, h.estimate.fmt(), h.test,
             f"{h.p_adjusted:.3g}" if h.primary else "", f"**{h.verdict}**"] for h in hyps]
    return lines + md.table(["id", "prediction: quantity", "estimate [95% CI] (p, n)", "test", "p (Holm)", "verdict"],
                          rows)


def leaderboard_lines(rec: Records) -> list[str]:
    rows = [[plots.LABELS.get(r["variant"], r["variant"]), f"{r['lr']:g}" if r["lr"] else "?",
             md.mean_ci(r["accuracy"]), md.mean_ci(r["loss"]),
             " / ".join(str(r["outcomes"][o]) for o in oc.OUTCOMES),
             f"{r['median_exit']:.0f}" if r["median_exit"] else "never", "yes" if r["horizon_ok"] else "**no**"]
            for r in sorted(leaderboard(rec), key=lambda r: -np.nanmean(r["accuracy"]))]
    return ["## Which norm? Every arm at its own LR", "",
            "Each arm's LR was chosen on the dev split from the sweep (figure `sweep.png`); accuracy and loss are on "
            "validation, mean ± 95% t half-width over seeds. Outcomes: learned / never learned / diverged. Plateau "
            "exit: median step at which the 20-step mean train loss fell below ln 2 - 0.05 (`curves.png`).", ""] + \
        md.table(["norm", "LR", "val accuracy", "val loss", "outcomes", "plateau exit", "horizon ok"], rows)


def placement_lines(rec: Records) -> list[str]:
    lrs = rec.lrs("placement", "placement_more")
    rows = {}
    for exp in ("placement", "placement_more"):
        for g in outcome_grid(rec, exp):
            rows.setdefault((g["variant"], g["warmup"]), {})[g["lr"]] = f"{g[oc.LEARNED]}/{g['n']}" + \
                (f" ({g[oc.DIVERGED]} div)" if g[oc.DIVERGED] else "")
    table = [[v, w] + [cells.get(lr, "") for lr in lrs] for (v, w), cells in sorted(rows.items())]
    return ["## Placement: how large an LR still learns", "",
            "Seeds that learned / seeds run, per LR (diverged runs in brackets; the rest never left the plateau).",
            ""] + \
        md.table(["arm", "warmup"] + [f"{lr:g}" for lr in lrs], table)


def peak_logit(run: dict) -> float | None:
    """The largest attention logit any layer produced over the run's training steps."""
    seen = [x for x in run.get("curves", {}).get("attn_logit_max", []) if x is not None]
    return max(seen) if seen else None


def logit_lines(rec: Records) -> list[str]:
    """Wortsman et al. (2023)'s attention-logit growth, measured on the placement runs: not a prediction."""
    rows, lrs = [], rec.lrs("placement", "placement_more")
    for exp in ("placement", "placement_more"):
        for variant in sorted({r["variant"] for r in rec.runs if exp in r.get("experiments", [r["experiment"]])}):
            for warmup in ("off", "on"):
                cells = []
                for lr in lrs:
                    peaks = [p for p in map(peak_logit, rec.arm(exp, variant, warmup, lr)) if p is not None]
                    cells.append(f"{np.median(peaks):.0f}" if peaks else "")
                if any(cells):
                    rows.append([plots.LABELS.get(variant, variant), warmup] + cells)
    hi = [r for lr in lrs[-2:] for w in ("on", "off") for r in rec.arm("placement", "ln_pre", w, lr)]
    split = {o: [p for p in (peak_logit(r) for r in hi if outcome_of(r) == o) if p is not None]
             for o in (oc.LEARNED, oc.NEVER_LEARNED)}
    return (["## Attention logits: growth with the LR (measured, not predicted)", "",
            "Median over seeds of the largest attention logit any layer produced during training, per LR "
            "(`curves.attn_logit_max`). qk_norm bounds the logits by construction; the question S8a asks is "
            "whether that buys a larger LR (the placement table above).", ""]
            + md.table(["arm", "warmup"] + [f"{lr:g}" for lr in lrs], rows)
            + [logit_reading(split), ""])


def logit_reading(split: dict) -> str:
    failed, learned = (np.median(split[o]) if split[o] else float("nan") for o in (oc.NEVER_LEARNED, oc.LEARNED))
    if not (math.isfinite(failed) and math.isfinite(learned)):
        return "Pre-LN learned at both of its largest LRs, or at neither: no comparison of peaks."
    higher = failed > learned
    return (f"At pre-LN's two largest LRs the runs that never learned peaked {'higher' if higher else 'no higher'} "
            f"than those that learned (median {failed:.0f} over {len(split[oc.NEVER_LEARNED])} runs vs {learned:.0f} "
            f"over {len(split[oc.LEARNED])})" + ("." if higher else ": at this scale large logits come with a large "
                                                 "LR, but do not by themselves mark the runs that fail."))


def batching_lines(rec: Records) -> list[str]:
    rows = []
    for norm in ("ln_pre",) + BATCH_STAT:
        cells = [plots.LABELS.get(norm, norm), md.mean_ci([value(r) for r in rec.arm("leaderboard", norm)][:5])]
        for suffix in ("grouped", "b8"):
            cells.append(md.mean_ci([value(r) for r in rec.arm("batching", f"{norm}-{suffix}")]))
        rows.append(cells)
    flips = [[f["norm"], f["mode"], sum(f["padding"]), sum(f["composition"]), len(f["padding"])]
             for f in flip_table(rec)]
    gaps = []
    for norm in BATCH_STAT:
        found = [r["running_stats"] for r in rec.arm("leaderboard", norm) if "running_stats" in r]
        if found:
            gaps.append([norm, md.mean_ci([np.mean(s["log_var_ratio"]) for s in found]),
                         md.mean_ci([s["log_var_ratio"][0] for s in found])])
    return (["## BatchNorm, padding and batch size", "",
             "Validation accuracy (running statistics, seeds 0-4) on random batches of 32, length-grouped batches of "
             "32, and random batches of 8 (LR x 0.5 for every norm):", ""]
            + md.table(["norm", "random, 32", "grouped, 32", "random, 8"], rows)
            + ["Prediction flips on validation, summed over the 10 leaderboard seeds: *padding* = the same batches "
               "padded to their longest vs to 40 tokens; *composition* = length-sorted vs shuffled batches.", ""]
            + md.table(["norm", "statistics", "padding flips", "composition flips", "runs"], flips)
            + ["Running statistics against the real tokens' statistics at the end of training: |log variance "
               "ratio|, averaged over every norm layer and in the first layer only.", ""]
            + md.table(["norm", "all layers", "first layer"], gaps))


EXPLORATORY = (("batchnorm", "ln_post"), ("masked_batchnorm", "ln_post"), ("no_norm", "ln_post"), ("ln_post", "ln_pre"))


def exploratory_lines(rec: Records, test: str) -> list[str]:
    """Comparisons no prediction named, added after the runs to read the leaderboard: exploratory, uncorrected."""
    rows = []
    for a, b in EXPLORATORY:
        diffs = paired(by_seed(rec.arm("leaderboard", a), value), by_seed(rec.arm("leaderboard", b), value))
        rows.append([f"{plots.LABELS.get(a, a)} - {plots.LABELS.get(b, b)}", paired_test(diffs, test).fmt()])
    return ["## Exploratory: which difference is the norm's?", "",
            "Not predicted; added after the runs to read the leaderboard (uncorrected p values). Validation accuracy, "
            "paired over the 10 leaderboard seeds, each arm at its own LR:", ""] + \
        md.table(["comparison", "estimate [95% CI] (p, n, test)"], rows)


def write_markdown(rec: Records, meta: dict) -> str:
    aa, hyps = verdicts(rec)
    calls = meta.get("invocations", [])
    lines = ["# Study v3: report", "",
             "Generated by `python scripts/report.py docs/study-v3` from the committed records alone. Predictions: "
             "[predictions.md](predictions.md), committed before the runs.", "",
             f"- {len(rec.runs)} training runs; "
             f"commits {', '.join(sorted({c['commit'] or '?' for c in calls})) or '?'}; "
             f"{'; '.join(sorted({c['machine'] for c in calls})) or '?'}",
             f"- Wall time of training: {sum(c['wall_s'] for c in calls) / 60:.1f} min "
             f"({sum(c['cpu_s'] for c in calls) / 60:.1f} CPU-minutes); commands: "
             + " ; ".join(f"`{c['command']}`" for c in calls)]
    if rec.unfinished:
        missing = Counter(e for r in rec.unfinished for e in r.get("experiments", [r["experiment"]]))
        lines.append(f"- **Not trained** (the study was stopped before them, or they crashed): {len(rec.unfinished)} "
                     "runs, " + ", ".join(f"{e} {n}" for e, n in sorted(missing.items())) + "; they are left out")
    lines += ["", "![answer](answer.png)", ""]
    lines += verdict_lines(aa, hyps) + leaderboard_lines(rec) + exploratory_lines(rec, aa["test"]) \
        + placement_lines(rec) + logit_lines(rec) + batching_lines(rec)
    return "\n".join(lines + SCALE) + "\n"


SCALE = ["## Scale", "",
         "A 6-layer, width-64 encoder trained for 320 steps on 10,240 SST-2 sentences on a CPU. The papers: Xiong et "
         "al. (2020) 6-24-layer Transformers (translation, BERT); Shen et al. (2020) translation Transformers; "
         "Wortsman et al. (2023) up to 1.2B parameters; arXiv 2604.23434 GPT-2 64M on 1M tokens. What is not "
         "separated here is a result at this scale, not evidence about theirs."]


def log_to_wandb(rec: Records, out: Path, meta: dict, figures: list[str], mode: str, wandb_dir: Path) -> dict | None:
    """The report as a W&B run in the study's group (its files in wandb_dir/wandb): every run a row, the verdicts
    a table, the figures images."""
    from normlab.tracking.wandb_report import log_study

    fields = ("name", "experiment", "variant", "lr", "warmup", "seed", "status", "norm", "placement", "commit")
    rows = [{**{k: r.get(k) for k in fields}, "outcome": outcome_of(r), "val_accuracy": value(r),
             "val_loss": value(r, "loss"), "dev_loss": value(r, "loss", DEV)} for r in rec.runs]
    _, hyps = verdicts(rec)
    table = [{"id": h.id, "claim": h.claim, "estimate": h.estimate.fmt(4), "test": h.test, "p_holm": h.p_adjusted,
              "verdict": h.verdict} for h in hyps]
    images = {name.removesuffix(".png"): out / name for name in figures}
    return log_study(wandb_dir, meta.get("name") or out.name, rows, {}, table, images, mode)


def make_report(source: Path, out: Path | None = None, wandb_mode: str = "disabled",
                wandb_dir: Path | None = None, compare: Path | None = None) -> Path:
    """report.md and its figures in `out` (default: source); with a wandb_mode, the W&B report run's files go to
    wandb_dir (default: source), never into `out` unless it is that. `compare`: a folder of another v4 study's
    records (the study whose LRs this one took): the report says where their answers differ."""
    source, out = Path(source), Path(out or source)
    out.mkdir(parents=True, exist_ok=True)
    if (source / "study.json").is_file():
        copy_records(source, out)
    elif (source / RECORDS).is_file() and source.resolve() != out.resolve():  # committed records, regenerated elsewhere
        for name in (RECORDS, "meta.json", *COPIED):
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    if not (out / RECORDS).is_file():
        raise FileNotFoundError(f"{out / RECORDS} not found: give a scored study directory (after "
                                f"scripts/score_runs.py) or a folder of committed records")
    rec = load(out)
    meta = read_json(out / "meta.json", {}) or {}
    if (design := report_v5.design_of(meta)) is not None:  # a factorial study (v5): its own contrasts and figure
        text = report_v5.write_report(rec, meta, design, load, read_jsonl(out / "signal.jsonl"), out)
        (out / "report.md").write_text(text)
        return out / "report.md"
    if report_v4.is_v4(rec):  # study v4's presets: its own rules, report and figure (no W&B run yet)
        board = report_v4.board_runs(rec)
        figures = plots.v4_figures(rec, out, board, report_v4.figure_title(board, meta.get("name") or out.name))
        other = None
        if compare is not None:
            if not (Path(compare) / RECORDS).is_file():
                raise FileNotFoundError(f"--compare {compare}: no {RECORDS} there; give a folder of a study's records")
            other = (Path(compare).name, load(Path(compare)))
        (out / "report.md").write_text(report_v4.write_markdown(rec, meta, read_jsonl(out / "signal.jsonl"), figures,
                                                                compare=other))
        return out / "report.md"
    figures = plots.all_figures(rec, out)
    (out / "report.md").write_text(write_markdown(rec, meta))
    if wandb_mode != "disabled":
        (wandb_dir := Path(wandb_dir or source)).mkdir(parents=True, exist_ok=True)
        log_to_wandb(rec, out, meta, figures, wandb_mode, wandb_dir)
    return out / "report.md"
