"""The norm study's report: report.md + figures, from the compact per-run records alone (no retraining).

    python scripts/report.py studies/quick --out docs/study-v2    # a finished study (after score_runs.py)
    python scripts/report.py docs/study-v2                        # regenerate from the committed records

Reads runs.jsonl, e1.jsonl, labels.json and meta.json (commit, machine, command, wall time) from the source
folder; with --out they are copied there first, so the output folder holds everything the report needs. Every
number comes from common/study_analysis.py; the hypotheses are those of predictions.md in the same folder.
"""

import argparse
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `python scripts/report.py` puts scripts/, not the repo, on the path

from common import study_analysis as sa  # noqa: E402
from common.io import atomic_write_json, read_json  # noqa: E402
import report_plots as plots  # noqa: E402  (scripts/, beside this file)

RECORD_FILES = ("runs.jsonl", "e1.jsonl", "labels.json", "meta.json")


def _acc(values) -> str:
    v = [x for x in values if x == x]
    if not v:
        return "–"
    return f"{np.mean(v):.3f} ({', '.join(f'{x:.3f}' for x in v)})"


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _estimate(est) -> str:
    """The estimate with its interval, or the bare difference where there is none (a failure-rate difference)."""
    return est.fmt(3) if math.isfinite(est.lo) else f"{est.mean:+.3f}"


def verdict_section(data) -> list[str]:
    rows = [[v["id"], v["experiment"], v["what"], _estimate(v["estimate"]), f"{v['p']:.3g}", f"{v['p_holm']:.3g}",
             f"**{v['outcome']}**"] for v in sa.verdicts(data)]
    lines = ["## Verdicts", "", "Primary hypotheses (one family, Holm-corrected at 0.05). Estimate: mean paired "
             "difference [95% interval] in the predicted comparison's units.", ""]
    lines += _table(["", "exp.", "quantity", "estimate", "p", "p (Holm)", "outcome"], rows)
    lines += ["", "Secondary hypotheses (exploratory, uncorrected):", ""]
    lines += _table(["", "quantity", "value", "outcome"],
                    [[s["id"], s["what"], s["value"], s["outcome"]] for s in sa.secondary(data)])
    return lines + [""]


def predictions_of(data, experiment: str) -> list[str]:
    """The experiment's predictions, each with its estimate and outcome (from the verdict tables)."""
    found = {v["id"]: (_estimate(v["estimate"]), v["outcome"]) for v in sa.verdicts(data)}
    found.update({s["id"]: (s["value"], s["outcome"]) for s in sa.secondary(data)})
    lines = []
    for key, text in sa.PREDICTIONS[experiment].items():
        value, outcome = found.get(key, ("not measured", "not measured"))
        lines.append(f"- **{key}**: {text}. Measured: {value} -> **{outcome}**.")
    return lines + [""]


def e1_section(data) -> list[str]:
    depths = sorted({r["depth"] for r in data.e1})
    rows = []
    for placement in ("post", "pre", "deepnorm"):
        ratio = [np.mean([math.exp(sa.e1_grad_log_ratio(r)) for r in sa.e1_rows(data, placement, d).values()])
                 for d in depths]
        change = [np.mean([r["output_change"][-1] for r in sa.e1_rows(data, placement, d).values()])
                  for d in depths]
        rows.append([placement] + [f"{a:.3g} / {c:.3g}" for a, c in zip(ratio, change)])
    lines = ["## E1: gradients at initialization and the first Adam updates", ""] + predictions_of(data, "E1") + [
             "![per-block gradient norm at init](e1_grad_norm.png)", "", "![output change](e1_output_change.png)", "",
             "Mean over seeds of g_last / g_first (a block's gradient norm, last over first block) / relative change "
             "of the encoder output after 10 Adam steps:", ""]
    return lines + _table(["placement"] + [f"depth {d}" for d in depths], rows) + [""]


def e2_section(data) -> list[str]:
    arms = [("e2", v, w) for v in ("post_ln", "pre_ln") for w in ("off", "on")]
    arms += [("e4", "pre_ln_qknorm", "on"), ("aa", "custom_ln", "on")]
    arms = [a for a in arms if data.arm(*a)]
    rows = []
    for r in sa.accuracy_table(data, arms):
        sens = list(r["sensitivity"].values())
        rows.append([f"{r['experiment']} {r['variant']}", r["warmup"], f"{r['best_lr']:g}", _acc(r["accuracy"]),
                     f"{r['failed'][0]}/{r['failed'][1]}", r["spikes"], _acc(sens)])
    lines = ["## E2: placement x warmup x LR (with E4's qk_norm arm and the A/A arm)", ""] + predictions_of(data, "E2") + [
             "![LR sweep](e2_lr_sweep.png)", "",
             "Best LR picked on dev (the last 2,000 training rows, never trained on); accuracy on validation at that "
             "LR (mean, then per seed). Failures over all LRs. LR sensitivity of validation loss, per seed.", ""]
    return lines + _table(["arm", "warmup", "best LR (dev)", "val accuracy", "failed", "loss spikes",
                           "LR sensitivity"], rows) + [""]


def aa_section(data) -> list[str]:
    aa = sa.aa_control(data)
    rows = [[f"{r['lr']:g}", r["seeds"], r["accuracy"].fmt(4), r["loss"].fmt(4)] for r in aa["per_lr"]]
    lines = ["## A/A control: the hand-written LayerNorm against torch's (same model, same seeds)", "",
             f"Noise floor (largest |mean paired accuracy difference| over the LRs): **{aa['floor']:.4f}**.", ""]
    return lines + _table(["LR", "seeds", "accuracy custom minus torch", "val loss custom minus torch"], rows) + [""]


def e3_section(data) -> list[str]:
    rows = [[r["norm"], r["batches"], r["mode"], r["eval"], _acc(r["accuracy"]),
             "–" if None in r["flips"] else sum(r["flips"])] for r in sa.e3_table(data)]
    checks = [[c["check"], c["flips"], "yes" if c["held"] else "**NO**"] for c in sa.structural_checks(data)]
    p5 = sa.p5(data)
    lines = ["## E3: BatchNorm and padding", ""] + predictions_of(data, "E3") + [
             "![accuracy per batching](e3_batching.png)", "",
             "![stat drift](e3_stat_drift.png)", "",
             "Validation accuracy per training batches, statistics mode and eval batching (mean, then per seed); "
             "flips: predictions that differ from the *sorted* batching of the same model, summed over seeds.", ""]
    lines += _table(["norm", "trained on", "statistics", "eval batching", "val accuracy", "flips vs sorted"], rows)
    lines += ["", f"Naive BN with batch statistics, sorted vs fixed padding: {p5['flips']} flips over {p5['runs']} "
              f"models.", "", "Structural checks:", ""]
    return lines + _table(["check", "flips", "held"], checks) + [""] + running_stats_lines(data)


def running_stats_lines(data) -> list[str]:
    rows = [[r["norm"], r["batches"], _acc(r["first_mean_gap"]), _acc(r["first_log_var_ratio"]), _acc(r["mean_gap"]),
             _acc(r["log_var_ratio"])] for r in sa.running_stats_table(data)]
    if not rows:
        return []
    return ["Running statistics against the real tokens' (descriptive; measured after the predictions were "
            "written): per layer, the mean over features of |running mean - real mean| / real std and of "
            "|log(running var / real var)|, the real tokens' statistics taken over the validation split in eval "
            "(sorted batches). 0 = the running statistics are exactly the real tokens'. The first layer's input "
            "is the embeddings, untouched by batch statistics; deeper layers also inherit earlier layers' "
            "train/eval differences.", ""] + _table(
        ["norm", "trained on", "mean gap, layer 1", "log var ratio, layer 1", "mean gap, all layers",
         "log var ratio, all layers"], rows) + [""]


def e4_section(data) -> list[str]:
    rows = []
    for lr in data.lrs("e4"):
        without = [sa.final_logit_max(r) for r in data.arm("e2", "pre_ln", "on", lr)]
        with_qk = [sa.final_logit_max(r) for r in data.arm("e4", "pre_ln_qknorm", "on", lr)]
        rows.append([f"{lr:g}", _acc(without), _acc(with_qk)])
    lines = ["## E4: attention-logit growth", ""] + predictions_of(data, "E4") + [
             "![attention logit max](e4_logit_max.png)", "",
             "Largest attention logit over layers at the last step (mean, then per seed). LR sensitivity without "
             f"minus with qk_norm: {sa.e4_sensitivity(data).fmt(4)}.", ""]
    return lines + _table(["LR", "pre-LN", "pre-LN + qk_norm"], rows) + [""]


def write_markdown(data, meta: dict, predictions: str = "predictions.md") -> str:
    lines = ["# Study v2: report", "",
             "Generated by `python scripts/report.py` from the committed per-run records (runs.jsonl, e1.jsonl, "
             f"labels.json). Predictions: [predictions.md]({predictions}), committed before the runs.", "",
             f"- Code: commit `{meta.get('commit', '?')}`; machine: {meta.get('machine', '?')}",
             f"- Command: `{meta.get('command', '?')}`; wall time: {meta.get('wall_time', '?')}",
             f"- {len(data.runs)} training runs, {len(data.e1)} E1 models", ""]
    lines += verdict_section(data)
    sections = [(data.e1, e1_section), (data.arm("e2", "post_ln", "off"), e2_section),
                (data.arm("aa", "custom_ln", "on"), aa_section), (data.arm("e3", "batchnorm-random"), e3_section),
                (data.arm("e4", "pre_ln_qknorm", "on"), e4_section)]
    for present, section in sections:
        if present:
            lines += section(data)
    return "\n".join(lines + SCALE) + "\n"


SCALE = ["## Scale", "",
         "The papers saw these effects far above this scale: Xiong et al. (2020) trained 6-12-layer Transformers of width "
         "512-1024 for translation and BERT pre-training over 10^5 steps; Wortsman et al. (2023) used models up to 1.2B "
         "parameters and 10^4+ steps; Wang et al. (2022) went to 1,000 layers; Shen et al. (2020) trained translation "
         "and language models. This study's models have 6 layers of width 64 (E1: up to 48) and train 160 steps. A "
         "prediction that is not separated or refuted here is a result at this scale, not evidence about theirs."]


def study_meta(source: Path) -> dict:
    """meta.json's content from a study directory's study.json: what ran, where, how long (training only)."""
    study = read_json(source / "study.json")
    calls = study.get("invocations", [])
    if not calls:
        return {}
    return {"name": study.get("name"), "project": study.get("wandb_project") or "normlab",
            "commit": ", ".join(sorted({c["commit"] or "?" for c in calls})),
            "machine": "; ".join(sorted({c["machine"] for c in calls})),
            "command": " ; ".join(c["command"] for c in calls),
            "wall_time": f"{sum(c['wall_s'] for c in calls) / 60:.1f} min of training "
                         f"({sum(c['cpu_s'] for c in calls) / 60:.1f} CPU-minutes)"}


def run_rows(data) -> list[dict]:
    """One flat row per training run (every seed, every LR) for the W&B table."""
    rows = []
    for r in data.runs:
        row = {k: r.get(k) for k in ("name", "experiment", "variant", "lr", "warmup", "seed", "status", "norm",
                                       "placement", "qk_norm", "grouped", "loss_spikes", "wandb_run_id")}
        for key in (sa.VAL, sa.DEV):
            split = key.split("/")[0]
            row[f"{split}_loss"], row[f"{split}_accuracy"] = sa.score(r, key), sa.score(r, key, "accuracy")
        rows.append(row)
    return rows


def lr_sweeps(data) -> dict:
    """Validation loss against log10(LR), one line per arm (mean over seeds), for wandb.plot.line_series."""
    arms = {f"{e} {v}, warmup {w}": (e, v, w) for e, v, w in sorted({(r["experiment"], r["variant"], r["warmup"])
                                                                     for r in data.runs if r["experiment"] != "e3"})}
    lrs = sorted({r["lr"] for r in data.runs if r["experiment"] != "e3"})
    ys = {}
    for line, arm in arms.items():
        runs = data.arm(*arm)
        ys[line] = [float(np.mean([sa.score(r) for r in runs if r["lr"] == lr])) if any(r["lr"] == lr for r in runs)
                    else None for lr in lrs]
    return {"lr_sweep/val_loss": {"xs": [math.log10(x) for x in lrs], "ys": ys, "xname": "log10(peak LR)",
                                  "title": "validation loss against the LR (mean over seeds)"}}


def log_to_wandb(data, out: Path, meta: dict, figures: list[str], mode: str) -> dict | None:
    from common.wandb_report import log_study

    verdicts = [{"id": v["id"], "experiment": v["experiment"], "quantity": v["what"], "estimate": v["estimate"].fmt(4),
                 "p": v["p"], "p_holm": v["p_holm"], "outcome": v["outcome"]} for v in sa.verdicts(data)]
    verdicts += [{"id": s["id"], "quantity": s["what"], "estimate": s["value"], "outcome": s["outcome"]}
                 for s in sa.secondary(data)]
    images = {name.removesuffix(".png"): out / name for name in figures}
    return log_study(out, meta.get("name", out.name), run_rows(data), lr_sweeps(data) if data.runs else {},
                     verdicts, images, mode, project=meta.get("project", "normlab"))


def make_report(source: Path, out: Path | None = None, wandb_mode: str | None = "disabled") -> Path:
    source, out = Path(source), Path(out or source)
    out.mkdir(parents=True, exist_ok=True)
    if (source / "study.json").is_file() and study_meta(source):
        atomic_write_json(source / "meta.json", study_meta(source), indent=1)
    if out.resolve() != source.resolve():
        for name in RECORD_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    data = sa.StudyData.load(out)
    meta = read_json(out / "meta.json", {})
    figures = plots.all_figures(data, out)
    report = out / "report.md"
    # a rerun's folder sits inside the study's: link the one set of predictions both test
    predictions = "predictions.md" if (out / "predictions.md").is_file() or not (out.parent / "predictions.md").is_file() \
        else "../predictions.md"
    report.write_text(write_markdown(data, meta, predictions))
    if wandb_mode != "disabled":
        log_to_wandb(data, out, meta, figures, wandb_mode or os.environ.get("WANDB_MODE") or "offline")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a scored study directory, or a folder of committed records")
    parser.add_argument("--out", type=Path, default=None, help="write the report (and copy the records) here")
    parser.add_argument("--no-wandb", action="store_true", help="write report.md and the figures only")
    parser.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default=None,
                        help="the report run's mode (default: $WANDB_MODE, else offline; OUT/wandb holds it)")
    args = parser.parse_args(argv)
    try:
        report = make_report(args.source, args.out, "disabled" if args.no_wandb else args.wandb_mode)
    except FileNotFoundError as err:
        print(f"report.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {report} and its figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
