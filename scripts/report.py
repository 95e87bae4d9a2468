"""Turn a finished (or half-finished) norm study into report.md + PNG plots, and log the same to wandb.

    python scripts/report.py studies/quick [--no-wandb] [--wandb-mode offline]

Reads, for every run of the study: STUDY_DIR/study.json (written by scripts/study.py: which variant, learning
rate, warmup setting and seed each run is, and its status), and each run directory's config.yaml,
metrics.jsonl and summary.json. Without study.json the runs under STUDY_DIR/runs/ are still read, and the
variant is named "<norm>-<placement>" from the run's config.

Everything written is computed from those files; the "Observations" section only states numbers.
"""

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the machines that run studies
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `python scripts/report.py` puts scripts/, not the repo, on the path

from common.stability import count_loss_spikes, lr_sensitivity  # noqa: E402

# The final train loss of a run is the mean of its last FINAL_LOSS_WINDOW logged train losses: a single step's
# loss on a small batch is too noisy to rank learning rates by.
FINAL_LOSS_WINDOW = 20
# Exponential smoothing of the plotted curves (display only; every number in the tables is unsmoothed).
PLOT_EMA = 0.9
FIGURES = {
    "loss_curves": "Training loss per variant, one panel per learning rate",
    "grad_norm": "Global gradient norm (before clipping) over training, one panel per variant",
    "act_rms": "Per-layer activation RMS of the residual stream at the end of training",
    "lr_sensitivity": "Final loss and validation accuracy against the learning rate, and LR sensitivity",
}
# summary.json key for the number of loss spikes the live detector counted (train.py); recomputed when absent.
SPIKE_KEYS = ("loss_spikes", "num_loss_spikes", "spike_count", "spikes")


class ReportError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------------
# Reading a study


@dataclass
class Run:
    name: str
    variant: str
    lr: float
    warmup: str  # "on" | "off"
    seed: int
    status: str  # completed | diverged | interrupted | failed | pending
    norm: str | None = None
    curves: dict = field(default_factory=dict)  # metric name -> (steps array, values array)
    summary: dict = field(default_factory=dict)

    def curve(self, key):
        return self.curves.get(key, (np.zeros(0), np.zeros(0)))

    def last(self, key):
        steps, values = self.curve(key)
        return float(values[-1]) if len(values) else float("nan")

    @property
    def series(self):
        return (self.variant, self.warmup)

    @property
    def batch_stat(self):
        return self.norm in ("batchnorm", "masked_batchnorm", "powernorm") or "eval/accuracy_batch_stats" in self.curves

    @property
    def initial_loss(self):
        steps, values = self.curve("train/loss")
        return float(values[0]) if len(values) else float("nan")

    @property
    def final_loss(self):
        """Mean of the last FINAL_LOSS_WINDOW train losses; inf for a diverged run (it made no usable progress)."""
        if self.status == "diverged":
            return math.inf
        steps, values = self.curve("train/loss")
        tail = values[-FINAL_LOSS_WINDOW:]
        return float(np.mean(tail)) if len(tail) and np.all(np.isfinite(tail)) else math.inf

    @property
    def spikes(self):
        for key in SPIKE_KEYS:
            if isinstance(self.summary.get(key), (int, float)):
                return int(self.summary[key])
        steps, values = self.curve("train/loss")
        return count_loss_spikes(values)

    @property
    def final_accuracy(self):
        return self.last("eval/accuracy") if self.status == "completed" else float("nan")

    @property
    def bn_gap(self):
        """eval/accuracy_batch_stats - eval/accuracy at the last evaluation (BN family only)."""
        if self.status != "completed":
            return float("nan")
        return self.last("eval/accuracy_batch_stats") - self.last("eval/accuracy")


def read_metrics(path: Path) -> dict:
    """metrics.jsonl -> {metric: (steps, values)}; lines without "step" and non-numeric values are skipped."""
    points = defaultdict(list)
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        step = record.get("step")
        if not isinstance(step, (int, float)):
            continue
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                points[key].append((step, float(value)))
    return {k: (np.array([s for s, _ in v]), np.array([x for _, x in v])) for k, v in points.items()}


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def load_study(study_dir: Path) -> tuple[dict, list[Run]]:
    """(study metadata, runs). Runs listed in study.json come first; run dirs it does not know are added."""
    if not study_dir.is_dir():
        raise ReportError(f"study directory not found: {study_dir}")
    meta = _read_json(study_dir / "study.json")
    entries = dict(meta.get("runs", {}))
    runs_dir = study_dir / "runs"
    for run_dir in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        if run_dir.is_dir() and run_dir.name not in entries and (run_dir / "config.yaml").exists():
            entries[run_dir.name] = {}
    runs = []
    for name, entry in entries.items():
        run_dir = runs_dir / name
        cfg = _read_yaml(run_dir / "config.yaml")
        summary = _read_json(run_dir / "summary.json")
        model_cfg, train_cfg = cfg.get("model", {}), cfg.get("train", {})
        variant = entry.get("variant") or f"{model_cfg.get('norm', '?')}-{model_cfg.get('norm_placement', '?')}"
        lr = entry.get("lr", train_cfg.get("lr"))
        warmup = entry.get("warmup") or ("on" if (train_cfg.get("warmup_steps") or 0) > 0 else "off")
        seed = entry.get("seed", cfg.get("seed", 0))
        # summary.json is the truth once it exists; the study's record covers runs that crashed before writing it.
        status = summary.get("status") or entry.get("status") or "pending"
        if lr is None:
            continue
        runs.append(Run(name=name, variant=variant, lr=float(lr), warmup=str(warmup), seed=int(seed),
                        status=status, norm=model_cfg.get("norm") or entry.get("norm"),
                        curves=read_metrics(run_dir / "metrics.jsonl"), summary=summary))
    if not runs:
        raise ReportError(f"no runs found in {study_dir} (expected {study_dir}/study.json or {runs_dir}/*/config.yaml)")
    return meta, runs


# ----------------------------------------------------------------------------------------------------------------
# Numbers


def mean_std(values):
    """(mean, sample std with ddof=1 or nan for one value, count) over the finite values."""
    v = np.array([x for x in values if math.isfinite(x)], dtype=float)
    if len(v) == 0:
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else float("nan"), len(v)


def series_label(series):
    variant, warmup = series
    return variant if warmup == "on" else f"{variant} (no warmup)"


def compute_tables(runs: list[Run]) -> tuple[list[dict], list[dict]]:
    """(one row per variant x warmup x lr, one row per variant x warmup). Failed/pending runs have no loss."""
    cells = defaultdict(list)
    for run in runs:
        cells[(run.variant, run.warmup, run.lr)].append(run)
    lr_rows = []
    for (variant, warmup, lr), group in sorted(cells.items()):
        trained = [r for r in group if r.status in ("completed", "diverged")]
        acc_mean, acc_std, acc_n = mean_std([r.final_accuracy for r in trained])
        gap_mean, gap_std, _ = mean_std([r.bn_gap for r in trained if r.batch_stat])
        lr_rows.append(dict(
            variant=variant, warmup=warmup, lr=lr, runs=len(group), trained=len(trained),
            diverged=sum(r.status == "diverged" for r in group),
            failed=sum(r.status not in ("completed", "diverged") for r in group),
            spikes=sum(r.spikes for r in trained),
            acc_mean=acc_mean, acc_std=acc_std, acc_n=acc_n,
            final_loss=mean_std([r.final_loss for r in trained if r.status == "completed"])[0],
            bn_gap=gap_mean if any(r.batch_stat for r in group) else None,
        ))
    by_series = defaultdict(list)
    for run in runs:
        by_series[run.series].append(run)
    series_rows = []
    for series, group in sorted(by_series.items()):
        rows = [r for r in lr_rows if (r["variant"], r["warmup"]) == series]
        trained = [r for r in group if r.status in ("completed", "diverged")]
        sens = sensitivity_of(trained)
        with_acc = [r for r in rows if r["acc_n"] > 0]
        best = max(with_acc, key=lambda r: r["acc_mean"]) if with_acc else None
        series_rows.append(dict(
            variant=series[0], warmup=series[1], runs=len(group), trained=len(trained),
            diverged=sum(r.status == "diverged" for r in group),
            failed=sum(r.status not in ("completed", "diverged") for r in group),
            spikes=sum(r.spikes for r in trained),
            lr_sensitivity=sens["sensitivity"], initial_loss=sens["initial_loss"],
            capped_loss_by_lr=sens["capped_by_lr"],
            best_lr=best["lr"] if best else None,
            acc_mean=best["acc_mean"] if best else float("nan"),
            acc_std=best["acc_std"] if best else float("nan"),
            acc_n=best["acc_n"] if best else 0,
            bn_gap=best["bn_gap"] if best else None,
        ))
    return lr_rows, series_rows


def sensitivity_of(trained: list[Run]) -> dict:
    """Wortsman et al. 2023 LR sensitivity of one series (variant x warmup) over its LR grid.

    initial_loss = mean over the series' runs of the first logged train loss (the loss at initialization);
    per run, capped = min(final_loss, initial_loss), a diverged run counting as initial_loss; per LR, the mean of
    capped over seeds; then common.stability.lr_sensitivity = mean over LRs of (capped(lr) - min over LRs).
    """
    initial = mean_std([r.initial_loss for r in trained])[0]
    if not trained or not math.isfinite(initial):
        return {"sensitivity": float("nan"), "initial_loss": float("nan"), "capped_by_lr": {}}
    per_lr = defaultdict(list)
    for run in trained:
        per_lr[run.lr].append(min(run.final_loss, initial))  # inf (diverged) -> initial
    capped_by_lr = {lr: float(np.mean(v)) for lr, v in sorted(per_lr.items())}
    return {"sensitivity": lr_sensitivity(capped_by_lr, initial), "initial_loss": initial,
            "capped_by_lr": capped_by_lr}


# ----------------------------------------------------------------------------------------------------------------
# Figures


def _style(series, variants):
    color = plt.get_cmap("tab10")(variants.index(series[0]) % 10)
    return dict(color=color, linestyle="-" if series[1] == "on" else "--")


def _ema(values, beta=PLOT_EMA):
    out, acc = np.empty_like(values), None
    for i, v in enumerate(values):
        acc = v if acc is None or not math.isfinite(acc) else beta * acc + (1 - beta) * v
        out[i] = acc
    return out


def _mean_curve(group: list[Run], key: str):
    """Mean over the runs (seeds) of a metric, step by step, over the steps each run logged."""
    at_step = defaultdict(list)
    for run in group:
        for s, v in zip(*run.curve(key)):
            if math.isfinite(v):
                at_step[s].append(v)
    steps = np.array(sorted(at_step))
    return steps, np.array([np.mean(at_step[s]) for s in steps])


def _grid(n, width=4.2, height=3.2):
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    # at least 9 inches wide: the suptitle must fit even over a single panel
    fig, axes = plt.subplots(rows, cols, figsize=(max(width * cols, 9), height * rows + 0.4), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _label_axis(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save_figure(fig, title: str, path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_curves(runs, variants, lrs, path):
    fig, axes = _grid(len(lrs))
    by = defaultdict(list)
    for run in runs:
        by[(run.series, run.lr)].append(run)
    for ax, lr in zip(axes, lrs):
        for series in sorted({s for s, l in by if l == lr}):
            group = by[(series, lr)]
            steps, values = _mean_curve(group, "train/loss")
            if len(steps) == 0:
                continue
            n_div = sum(r.status == "diverged" for r in group)
            label = series_label(series) + (f" [{n_div}/{len(group)} diverged]" if n_div else "")
            ax.plot(steps, _ema(values), label=label, linewidth=1.2, **_style(series, variants))
            for run in group:  # mark where diverged runs stopped, at their last finite loss
                run_steps, run_values = run.curve("train/loss")
                finite = np.isfinite(run_values)
                if run.status == "diverged" and finite.any():
                    ax.plot(run_steps[finite][-1], run_values[finite][-1], "x",
                            color=_style(series, variants)["color"], markersize=8)
        ax.set_title(f"lr = {lr:g}")
        _label_axis(ax, "step", "train loss (EMA)")
    _save_figure(fig, "Training loss (mean over seeds, EMA-smoothed; x = a diverged run stopped)", path)


def plot_grad_norm(runs, variants, lrs, path):
    series_list = sorted({r.series for r in runs})
    fig, axes = _grid(len(series_list))
    cmap = plt.get_cmap("viridis")
    for ax, series in zip(axes, series_list):
        for i, lr in enumerate(lrs):
            group = [r for r in runs if r.series == series and r.lr == lr]
            steps, values = _mean_curve(group, "train/grad_norm")
            if len(steps):
                ax.plot(steps, _ema(values), color=cmap(i / max(len(lrs) - 1, 1)), label=f"lr {lr:g}", linewidth=1.2)
        ax.set_yscale("log")
        ax.set_title(series_label(series))
        _label_axis(ax, "step", "grad norm (pre-clip)")
    _save_figure(fig, "Global gradient norm before clipping (mean over seeds, EMA-smoothed)", path)


def final_act_rms(run: Run) -> np.ndarray:
    """Last logged layers/{i}/act_rms for i = 0.. (nan where a layer was not logged)."""
    layers = sorted(int(k.split("/")[1]) for k in run.curves if k.startswith("layers/") and k.endswith("/act_rms"))
    return np.array([run.last(f"layers/{i}/act_rms") for i in range(layers[-1] + 1)]) if layers else np.zeros(0)


def plot_act_rms(runs, variants, lrs, path):
    fig, axes = _grid(len(lrs))
    for ax, lr in zip(axes, lrs):
        for series in sorted({r.series for r in runs if r.lr == lr}):
            profiles = [final_act_rms(r) for r in runs if r.series == series and r.lr == lr and r.status == "completed"]
            profiles = [p for p in profiles if len(p)]
            if not profiles:
                continue
            depth = min(len(p) for p in profiles)
            mean = np.nanmean(np.stack([p[:depth] for p in profiles]), axis=0)
            ax.plot(np.arange(depth), mean, marker="o", label=series_label(series), **_style(series, variants))
        ax.set_yscale("log")
        ax.set_title(f"lr = {lr:g}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _label_axis(ax, "layer", "activation RMS at the end")
    _save_figure(fig, "Residual-stream activation RMS per layer at the last step (completed runs, mean over seeds)", path)


def plot_lr_sensitivity(lr_rows, series_rows, variants, path):
    fig, (ax_loss, ax_acc, ax_bar) = plt.subplots(1, 3, figsize=(15, 4))
    for row in series_rows:
        series = (row["variant"], row["warmup"])
        capped = row["capped_loss_by_lr"]
        if capped:
            ax_loss.plot(list(capped), list(capped.values()), marker="o", label=series_label(series),
                         **_style(series, variants))
        rows = [r for r in lr_rows if (r["variant"], r["warmup"]) == series and r["acc_n"] > 0]
        if rows:
            ax_acc.errorbar([r["lr"] for r in rows], [r["acc_mean"] for r in rows],
                            yerr=[0 if math.isnan(r["acc_std"]) else r["acc_std"] for r in rows], marker="o",
                            capsize=3, label=series_label(series), **_style(series, variants))
    for ax, ylabel in ((ax_loss, "min(final loss, initial loss)"), (ax_acc, "final val accuracy")):
        ax.set_xscale("log")
        _label_axis(ax, "learning rate", ylabel)
    ax_loss.set_title("Final train loss (mean over seeds; diverged = initial)")
    ax_acc.set_title("Validation accuracy (mean ± std over seeds)")
    labels = [series_label((r["variant"], r["warmup"])) for r in series_rows]
    values = [r["lr_sensitivity"] for r in series_rows]
    colors = [_style((r["variant"], r["warmup"]), variants)["color"] for r in series_rows]
    bars = ax_bar.bar(range(len(values)), [0 if math.isnan(v) else v for v in values], color=colors)
    for bar, row in zip(bars, series_rows):
        if row["warmup"] == "off":
            bar.set_hatch("//")
    ax_bar.set_xticks(range(len(values)), labels, rotation=35, ha="right", fontsize=8)
    ax_bar.set_ylabel("LR sensitivity (lower = more robust)")
    ax_bar.set_title("LR sensitivity (Wortsman et al. 2023)")
    ax_bar.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Markdown


def _f(x, fmt="{:.4f}"):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _acc(mean, std, n):
    if n == 0:
        return "–"
    return f"{mean:.4f} ± {std:.4f} (n={n})" if n > 1 else f"{mean:.4f} (n=1)"


SUMMARY_COLUMNS = ["variant", "warmup", "runs", "best LR", "val accuracy at best LR", "diverged", "failed",
                   "loss spikes", "LR sensitivity", "BN train/eval gap"]


def summary_table_rows(series_rows):
    return [[r["variant"], r["warmup"], r["runs"], _f(r["best_lr"], "{:g}"), _acc(r["acc_mean"], r["acc_std"], r["acc_n"]),
             f"{r['diverged']}/{r['runs']}", r["failed"], r["spikes"], _f(r["lr_sensitivity"]),
             _f(r["bn_gap"], "{:+.4f}")] for r in series_rows]


def _md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def observations(series_rows, comparisons) -> list[str]:
    """Sentences made only of numbers from the tables (no verdicts that the numbers do not carry)."""
    lines = []
    def names(rows):
        return ", ".join(series_label((r["variant"], r["warmup"])) for r in rows)

    def extremes(rows, key):  # (rows at the minimum, rows at the maximum), ties kept, at the printed precision
        values = [round(r[key], 4) for r in rows]
        lo, hi = min(values), max(values)
        return [r for r, v in zip(rows, values) if v == lo], [r for r, v in zip(rows, values) if v == hi], lo, hi

    ranked = [r for r in series_rows if not math.isnan(r["lr_sensitivity"])]
    if len(ranked) > 1:
        low, high, lo, hi = extremes(ranked, "lr_sensitivity")
        if lo == hi:
            lines.append(f"LR sensitivity is {lo:.4f} for every variant.")
        else:
            lines.append(f"Lowest LR sensitivity: {names(low)} ({lo:.4f}); highest: {names(high)} ({hi:.4f}).")
    with_acc = [r for r in series_rows if r["acc_n"] > 0]
    if len(with_acc) > 1:
        _, high, lo, hi = extremes(with_acc, "acc_mean")
        if lo == hi:
            lines.append(f"Every variant reaches the same validation accuracy at its best LR ({hi:.4f}).")
        else:
            lines.append(f"Highest validation accuracy (at its best LR): {names(high)} ({hi:.4f}); lowest: "
                         f"{names(extremes(with_acc, 'acc_mean')[0])} ({lo:.4f}).")
    diverging = [r for r in series_rows if r["diverged"]]
    if diverging:
        lines.append("Diverged runs: " + ", ".join(
            f"{series_label((r['variant'], r['warmup']))} {r['diverged']}/{r['runs']}" for r in diverging) + ".")
    else:
        lines.append("No run diverged.")
    index = {(r["variant"], r["warmup"]): r for r in series_rows}
    for names in comparisons or []:
        for warmup in ("on", "off"):
            present = [index[(n, warmup)] for n in names if (n, warmup) in index]
            if len(present) < 2:
                continue
            parts = [f"{r['variant']}: accuracy {_acc(r['acc_mean'], r['acc_std'], r['acc_n'])}, "
                     f"LR sensitivity {_f(r['lr_sensitivity'])}, diverged {r['diverged']}/{r['runs']}, "
                     f"spikes {r['spikes']}" + (f", BN gap {_f(r['bn_gap'], '{:+.4f}')}" if r["bn_gap"] is not None else "")
                     for r in present]
            lines.append(f"{' vs '.join(n for n in names)} (warmup {warmup}): " + "; ".join(parts) + ".")
    return lines


def _shown(path: Path):
    path = Path(path).resolve()
    return os.path.relpath(path, REPO_ROOT) if path.is_relative_to(REPO_ROOT) else str(path)


def write_markdown(study_dir, meta, runs, lr_rows, series_rows, figures, out_dir=None) -> str:
    name = meta.get("name") or study_dir.name
    lrs = sorted({r.lr for r in runs})
    seeds = sorted({r.seed for r in runs})
    status_counts = defaultdict(int)
    for run in runs:
        status_counts[run.status] += 1
    out = [f"# Norm study report: {name}", ""]
    commands = meta.get("commands") or ([meta["command"]] if meta.get("command") else [])
    if len(commands) == 1:
        out += ["Study command: `" + commands[0] + "`", ""]
    elif commands:
        out += ["Study commands (in order):", ""] + [f"- `{c}`" for c in commands] + [""]
    out_flag = f" --out {_shown(out_dir)}" if out_dir is not None and Path(out_dir).resolve() != study_dir.resolve() else ""
    out += [f"Report command: `python scripts/report.py {_shown(study_dir)}{out_flag}`", "",
            f"{len(runs)} runs ({', '.join(f'{k}: {v}' for k, v in sorted(status_counts.items()))}); "
            f"variants: {', '.join(sorted({r.variant for r in runs}))}; learning rates: "
            f"{', '.join(f'{lr:g}' for lr in lrs)}; seeds: {', '.join(map(str, seeds))}."]
    durations = [e.get("duration_s") for e in meta.get("runs", {}).values() if isinstance(e.get("duration_s"), (int, float))]
    if durations:
        out += ["", f"Training time: {sum(durations) / 60:.1f} minutes over {len(durations)} runs "
                    f"(median {float(np.median(durations)):.0f} s per run, from study.json)."]
    if meta.get("common_overrides"):
        out += ["", "Settings shared by every run: `" + " ".join(meta["common_overrides"]) + "`"]
    out += ["", "## Summary (per variant and warmup setting)", "", _md_table(SUMMARY_COLUMNS, summary_table_rows(series_rows)),
            "", "## Observations (computed from the table)", ""]
    out += [f"- {line}" for line in observations(series_rows, meta.get("comparisons"))]
    out += ["", "## Per learning rate", "", _md_table(
        ["variant", "warmup", "LR", "runs", "val accuracy", "final train loss", "diverged", "failed", "loss spikes",
         "BN train/eval gap"],
        [[r["variant"], r["warmup"], f"{r['lr']:g}", r["runs"], _acc(r["acc_mean"], r["acc_std"], r["acc_n"]),
          _f(r["final_loss"]), f"{r['diverged']}/{r['runs']}", r["failed"], r["spikes"], _f(r["bn_gap"], "{:+.4f}")]
         for r in lr_rows])]
    out += ["", "## Definitions", "",
            f"- **Final train loss** of a run: the mean of its last {FINAL_LOSS_WINDOW} logged `train/loss` values. "
            "**Initial loss** of a variant: the mean over its runs of the first logged `train/loss` (the loss at "
            "initialization).",
            "- **LR sensitivity** (Wortsman et al. 2023, \"Small-scale proxies for large-scale Transformer training "
            "instabilities\"): the mean over the LR grid of `min(final_loss(lr), initial_loss) - min_lr "
            "min(final_loss(lr), initial_loss)`, where `final_loss(lr)` is the mean over seeds of each run's capped "
            "final train loss and a diverged run counts as `initial_loss` (no progress). Lower is more robust to "
            "the choice of learning rate. Failed runs (crashed, no result) are left out.",
            "- **Val accuracy**: `eval/accuracy` at the last evaluation of completed runs, mean ± sample standard "
            "deviation (ddof=1) over seeds; the summary row shows the LR with the highest mean.",
            "- **Diverged**: the run stopped on a non-finite loss or gradient (`summary.json` status `diverged`). "
            "**Failed**: the run crashed or has not finished (no `completed`/`diverged` summary).",
            "- **Loss spikes**: counted by `common.stability` (loss above its exponential moving average by more "
            "than 6 moving standard deviations and 20% of the average; `summary.json`'s count when train.py "
            "wrote one), summed over the runs.",
            "- **BN train/eval gap**: `eval/accuracy_batch_stats - eval/accuracy` at the last evaluation: accuracy "
            "when normalizing with the evaluation batch's own statistics minus accuracy with the running "
            "statistics (BN-family norms only), mean over seeds."]
    out += ["", "## Figures", ""]
    for key, file in figures.items():
        out += [f"### {FIGURES[key]}", "", f"![{key}]({file})", ""]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# wandb


def log_to_wandb(study_dir, out_dir, meta, runs, lr_rows, series_rows, figures, mode):
    """The study's report run (common.wandb_report.log_study): every run, the LR sweeps, the summary table as the
    verdicts, the figures."""
    from common.wandb_report import log_study

    first = next((r for r in runs), None)
    project = meta.get("wandb_project") or "normlab"
    if first is not None:
        cfg = _read_yaml(study_dir / "runs" / first.name / "config.yaml")
        project = cfg.get("wandb", {}).get("project") or project
    name = meta.get("name") or study_dir.name
    run_rows = [{"run": r.name, "variant": r.variant, "warmup": r.warmup, "lr": r.lr, "seed": r.seed, "norm": r.norm,
                 "status": r.status, "val_accuracy": r.final_accuracy, "final_train_loss": r.final_loss,
                 "loss_spikes": r.spikes, "bn_train_eval_gap": r.bn_gap if r.batch_stat else None,
                 "wandb_run_id": r.summary.get("wandb_run_id")} for r in runs]
    lrs = sorted({r["lr"] for r in lr_rows})
    acc = {(r["variant"], r["warmup"], r["lr"]): r["acc_mean"] for r in lr_rows}
    sweep = {"xs": [math.log10(lr) for lr in lrs], "xname": "log10(learning rate)"}
    sweeps = {
        "lr_sweep/val_accuracy": {**sweep, "title": "Validation accuracy against the LR (mean over seeds)", "ys": {
            series_label((r["variant"], r["warmup"])): [acc.get((r["variant"], r["warmup"], lr)) for lr in lrs]
            for r in series_rows}},
        "lr_sweep/capped_final_loss": {**sweep, "title": "min(final train loss, initial loss) against the LR", "ys": {
            series_label((r["variant"], r["warmup"])): [r["capped_loss_by_lr"].get(lr) for lr in lrs]
            for r in series_rows}},
    }
    keys = ["variant", "warmup", "runs", "best_lr", "acc_mean", "acc_std", "acc_n", "diverged", "failed", "spikes",
            "lr_sensitivity", "bn_gap"]
    columns = ["variant", "warmup", "runs", "best_lr", "val_accuracy_mean", "val_accuracy_std", "val_accuracy_n",
               "diverged", "failed", "loss_spikes", "lr_sensitivity", "bn_train_eval_gap"]
    verdicts = [dict(zip(columns, (r[k] for k in keys))) for r in series_rows]
    images = {k: (out_dir / f, FIGURES[k]) for k, f in figures.items()}
    return log_study(study_dir, name, run_rows, sweeps, verdicts, images, mode, project)


def _json_number(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


# ----------------------------------------------------------------------------------------------------------------


def make_report(study_dir: Path, use_wandb: bool = True, wandb_mode: str | None = None, out_dir: Path | None = None) -> Path:
    """report.md, report.json and the PNGs in out_dir (default: the study directory); returns report.md's path."""
    study_dir = Path(study_dir)
    meta, runs = load_study(study_dir)
    out_dir = Path(out_dir) if out_dir is not None else study_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    lr_rows, series_rows = compute_tables(runs)
    variants = sorted({r.variant for r in runs})
    lrs = sorted({r.lr for r in runs})
    figures = {key: f"{key}.png" for key in FIGURES}
    plot_loss_curves(runs, variants, lrs, out_dir / figures["loss_curves"])
    plot_grad_norm(runs, variants, lrs, out_dir / figures["grad_norm"])
    plot_act_rms(runs, variants, lrs, out_dir / figures["act_rms"])
    plot_lr_sensitivity(lr_rows, series_rows, variants, out_dir / figures["lr_sensitivity"])
    report = out_dir / "report.md"
    report.write_text(write_markdown(study_dir, meta, runs, lr_rows, series_rows, figures, out_dir))
    wandb_info = None
    if use_wandb:
        mode = wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        wandb_info = log_to_wandb(study_dir, out_dir, meta, runs, lr_rows, series_rows, figures, mode)
    # the same numbers, machine-readable (NaN -> null)
    series_json = [{k: _json_number(v) for k, v in r.items() if k != "capped_loss_by_lr"}
                   | {"capped_loss_by_lr": {f"{lr:g}": x for lr, x in r["capped_loss_by_lr"].items()}}
                   for r in series_rows]
    (out_dir / "report.json").write_text(json.dumps(
        {"series": series_json, "per_lr": [{k: _json_number(v) for k, v in r.items()} for r in lr_rows],
         "wandb": wandb_info}, indent=1))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study_dir", type=Path, help="the study directory (scripts/study.py --study-dir)")
    parser.add_argument("--no-wandb", action="store_true", help="write report.md and PNGs only")
    parser.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default=None,
                        help="default: $WANDB_MODE, else offline")
    parser.add_argument("--out", type=Path, default=None,
                        help="write report.md, report.json and the PNGs here (default: STUDY_DIR), e.g. docs/study")
    args = parser.parse_args(argv)
    try:
        report = make_report(args.study_dir, use_wandb=not args.no_wandb, wandb_mode=args.wandb_mode,
                             out_dir=args.out)
    except ReportError as err:
        print(f"report.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {report} and its figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
