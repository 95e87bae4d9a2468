"""Compare training runs in one figure: loss and accuracy beside the depth metrics, one panel per metric with every
run overlaid in its own colour on shared axes, read from each run directory's metrics.jsonl.

    normlab-compare runs/pre_ln runs/post_ln --out compare.png
    python scripts/compare.py runs/a runs/b --label "pre-LN" --label "post-LN" --out compare.png
    normlab-compare runs/a runs/b --out compare.png --wandb     # + the same panels as one W&B run (offline unless
                                                                #   a wandb key is configured)

Rows: training (train loss, evaluation accuracy and loss, gradient norm), stability over steps (the last layer's
activation RMS, the largest attention logit, the mean update ratio, the BN family's statistics drift) and by layer
(each layer's mean over the second half of the logged steps). Per-step metrics are drawn as a trailing 20-step
mean (the train loss's raw values faint behind it). A run is labelled by its norm, placement and LR (config.yaml);
runs whose labels collide also get their directory's name. A panel's y axis is logarithmic when none of its values
is negative and the positive ones span a factor of 10 or more, else linear, so a metric that barely moves stays
readable. A metric some runs lack is drawn for the others and the panel names the missing ones; a metric no run has
gets no panel.
"""

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from normlab.command import command_parser, error_exit
from normlab.files.figures import lr_text, save_figure, scale_y
from normlab.files.formats import load_yaml_mapping, read_jsonl
from normlab.run_dir import RunDir
from normlab.study.outcomes import smooth
from normlab.tracking.wandb_report import line_chart, rows_table, where_logged
from normlab.tracking.wandb_run import CHART_POINTS, depth_series, resolve_mode, thin

WINDOW = 20  # steps in the trailing mean of per-step metrics; single batches are too noisy to compare


class CompareError(ValueError):
    """A run directory that cannot be compared; the message names it and what is expected."""


@dataclass
class Run:
    path: Path
    label: str
    rows: list
    depth: dict  # {quantity: {layer: (steps, values)}}, normlab.tracking.wandb_run.depth_series
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Metric:
    """One panel: `series(run)` gives its (xs, ys), or None when the run did not log it."""

    key: str  # the W&B chart's name, compare/<key>
    title: str
    series: Callable
    per_step: bool = True  # drawn as a trailing mean
    raw: bool = False  # the raw values faint behind the trailing mean
    xname: str = "step"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def scalar(key: str):
    """The rows' `key` against their step."""
    def series(run):
        points = [(r["step"], r[key]) for r in run.rows if _finite(r.get(key)) and "step" in r]
        return ([s for s, _ in points], [v for _, v in points]) if points else None
    return series


def over_layers(quantity: str, how: str):
    """A per-layer metric reduced over the layers at each step: `last` layer, `mean` or `max`."""
    def series(run):
        by_layer = run.depth.get(quantity)
        if not by_layer:
            return None
        if how == "last":
            return by_layer[max(by_layer)]
        by_step = {}
        for steps, values in by_layer.values():
            for step, value in zip(steps, values):
                by_step.setdefault(step, []).append(value)
        reduce = max if how == "max" else (lambda vs: sum(vs) / len(vs))
        steps = sorted(by_step)
        return steps, [reduce(by_step[s]) for s in steps]
    return series


def by_depth(quantity: str):
    """Each layer's mean over the second half of its logged steps (trained, and not one noisy batch), against the
    layer's index."""
    def series(run):
        by_layer = run.depth.get(quantity)
        if not by_layer:
            return None
        layers = sorted(by_layer)
        tails = [by_layer[i][1][len(by_layer[i][1]) // 2:] for i in layers]
        return layers, [sum(tail) / len(tail) for tail in tails]
    return series


# The figure's rows, in order; a metric no run has is left out of its row.
ROWS = [
    [Metric("train_loss", "train loss", scalar("train/loss"), raw=True),
     Metric("eval_accuracy", "evaluation accuracy", scalar("eval/accuracy"), per_step=False),
     Metric("eval_loss", "evaluation loss", scalar("eval/loss"), per_step=False),
     Metric("grad_norm", "gradient norm (before clipping)", scalar("train/grad_norm"))],
    [Metric("act_rms_last", "activation RMS, last layer", over_layers("act_rms", "last")),
     Metric("attn_logit_max", "attention logit max, over layers", over_layers("attn_logit_max", "max")),
     Metric("update_ratio", "update ratio ||dw||/||w||, layer mean", over_layers("update_ratio", "mean")),
     Metric("stat_drift", "BN statistics drift, layer mean", over_layers("stat_drift", "mean"))],
    [Metric(f"depth_{q}", f"by layer: {name}", by_depth(q), per_step=False,
            xname="layer (mean over the 2nd half of steps)")
     for q, name in [("grad_norm", "gradient norm"), ("act_rms", "activation RMS"),
                     ("attn_logit_max", "attention logit max"), ("update_ratio", "update ratio")]],
]


@dataclass
class Panel:
    metric: Metric
    lines: dict  # {run label: (xs, ys)}, smoothed for per-step metrics
    raw: dict  # {run label: (xs, ys)} as logged
    missing: list  # labels of the runs without this metric


def panels(runs: list[Run]) -> list[list[Panel]]:
    """The figure's rows of panels, each metric's series for every run that has it."""
    rows = []
    for metrics in ROWS:
        row = []
        for metric in metrics:
            raw = {run.label: s for run in runs if (s := metric.series(run)) is not None}
            if not raw:
                continue
            lines = {label: (xs, list(smooth(ys, WINDOW)) if metric.per_step else ys)
                     for label, (xs, ys) in raw.items()}
            row.append(Panel(metric, lines, raw, [run.label for run in runs if run.label not in raw]))
        if row:
            rows.append(row)
    return rows


def run_label(config: dict) -> str | None:
    """`masked_batchnorm pre lr 1.8e-3` from a run's config.yaml; None without a norm."""
    model, train = config.get("model") or {}, config.get("train") or {}
    if not model.get("norm"):
        return None
    lr = f"lr {lr_text(train['lr'])}" if _finite(train.get("lr")) else None
    return " ".join(p for p in (model["norm"], model.get("norm_placement"), lr) if p)


def labels_for(paths: list[Path], configs: list[dict]) -> list[str]:
    """Each run's label; a label two runs share gets each one's directory name (or path, when those collide too),
    and a directory given twice a number."""
    labels = [run_label(c) for c in configs]
    names = [p.name if [q.name for q in paths].count(p.name) == 1 else str(p) for p in paths]
    labels = [label or name for label, name in zip(labels, names)]
    labels = [f"{label} ({name})" if labels.count(label) > 1 and label != name else label
              for label, name in zip(labels, names)]
    return [f"{label} #{labels[:i].count(label) + 1}" if labels.count(label) > 1 else label
            for i, label in enumerate(labels)]


def read_run(path: Path) -> tuple[list, dict, dict]:
    """(metrics.jsonl rows, config.yaml, summary.json) of a run directory; CompareError naming what is wrong."""
    run_dir = RunDir(path)
    if not path.is_dir():
        raise CompareError(f"{path} is not a directory; give run directories that train.py wrote (output_dir)")
    if not run_dir.metrics_file.is_file():
        raise CompareError(f"{path} has no metrics.jsonl; give run directories that train.py wrote (output_dir)")
    rows = read_jsonl(run_dir.metrics_file)
    if not any("step" in r for r in rows):
        raise CompareError(f"{run_dir.metrics_file} holds no logged step yet")
    config = load_yaml_mapping(run_dir.config_file) if run_dir.config_file.is_file() else {}
    return rows, config, run_dir.read_summary() or {}


def load_runs(paths: list[Path], labels: list[str]) -> list[Run]:
    """The runs to compare; CompareError for no runs, a bad directory or a --label count that does not match."""
    if not paths:
        raise CompareError("no run directories given; give one or more RUN_DIR (train.py output directories)")
    if labels and len(labels) != len(paths):
        raise CompareError(f"{len(labels)} --label for {len(paths)} run directories; give one per run, in order, "
                           f"or none")
    if len(set(labels)) != len(labels):
        raise CompareError(f"--label values must differ; got {labels}")
    read = [read_run(p) for p in paths]
    labels = labels or labels_for(paths, [config for _, config, _ in read])
    return [Run(p, label, rows, depth_series(rows), config, summary)
            for p, label, (rows, config, summary) in zip(paths, labels, read)]


def _legend_label(run: Run) -> str:
    """The run's label, with its final accuracy and any status other than completed."""
    accuracy = (run.summary.get("final") or {}).get("eval/accuracy")
    status = run.summary.get("status")
    extra = [f"acc {accuracy:.3f}" if _finite(accuracy) else None,
             status if status not in (None, "completed") else None]
    return ", ".join([run.label] + [e for e in extra if e])


def draw_panel(ax, panel: Panel, colors: dict) -> None:
    """One metric: each run's line in its colour (the raw values faint behind a smoothed one), the y scale by
    y_scale, and which runs lack the metric."""
    for label, (xs, ys) in panel.lines.items():
        if panel.metric.raw:
            ax.plot(*panel.raw[label], color=colors[label], alpha=0.15, linewidth=0.6, label=f"_raw {label}")
        ax.plot(xs, ys, color=colors[label], linewidth=1.4, label=label,
                marker="o" if len(xs) <= 12 else None, markersize=3)
    drawn = (panel.raw, panel.lines) if panel.metric.raw else (panel.lines,)
    scale_y(ax, [v for lines in drawn for _, ys in lines.values() for v in ys])
    ax.set_title(panel.metric.title, fontsize=9)
    ax.set_xlabel(panel.metric.xname, fontsize=8)
    ax.tick_params(labelsize=7, which="both")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # x is a step or a layer's index: never 0.5
    ax.grid(alpha=0.3, which="both" if ax.get_yscale() == "log" else "major")
    if panel.missing:  # an empty legend: its title goes where the lines leave room
        ax.legend(handles=[], title="not logged by:\n" + "\n".join(panel.missing), loc="best", frameon=False,
                  title_fontsize=7)


def figure(runs: list[Run]):
    """The comparison figure: a row per group of metrics (training, stability over steps, by depth), one panel
    per metric, every run in the same colour in every panel, one legend above."""
    rows = panels(runs)
    ncols = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), ncols, figsize=(3.6 * ncols, 2.7 * len(rows) + 0.5), squeeze=False)
    colors = {run.label: plt.cm.tab10(i % 10) for i, run in enumerate(runs)}
    for ax_row, row in zip(axes, rows):
        for ax, panel in zip(ax_row, row):
            draw_panel(ax, panel, colors)
        for ax in ax_row[len(row):]:
            ax.set_axis_off()
    handles = [plt.Line2D([], [], color=colors[run.label], linewidth=2) for run in runs]
    fig.legend(handles, [_legend_label(run) for run in runs], loc="upper center", ncol=min(len(runs), 4),
               fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight() * math.ceil(len(runs) / 4)))
    return fig


def _shared(runs: list[Run], section: str, key: str, default: str) -> str:
    values = {(run.config.get(section) or {}).get(key) for run in runs}
    return values.pop() if len(values) == 1 and None not in values else default


def log_to_wandb(runs: list[Run], out: Path, wandb_dir: Path, mode: str) -> dict:
    """The figure's panels as one W&B run (job_type "compare", docs/wandb.md, "Comparing runs"), in the runs' W&B
    group and project when they share one: each metric a line series with one line per run on shared axes, a table
    of the runs (a `wandb_run_id` links the comparison to that run) and the figure itself. Its files go to
    WANDB_DIR/wandb (offline unless `mode` is online); returns {"project", "group", "id", "mode", "dir"}."""
    import wandb

    table = [{"run": run.label, "dir": str(run.path), "norm": (run.config.get("model") or {}).get("norm"),
              "norm_placement": (run.config.get("model") or {}).get("norm_placement"),
              "lr": (run.config.get("train") or {}).get("lr"), "status": run.summary.get("status"),
              "final_accuracy": (run.summary.get("final") or {}).get("eval/accuracy"),
              "wandb_run_id": run.summary.get("wandb_run_id")} for run in runs]
    project, group = _shared(runs, "wandb", "project", "normlab"), _shared(runs, "wandb", "group", "compare")
    run = wandb.init(project=project, group=group, job_type="compare", name=out.stem, mode=mode, dir=str(wandb_dir),
                     reinit="finish_previous", settings=wandb.Settings(silent=True),
                     config={"runs": [r["run"] for r in table],
                             "wandb_runs": [r["wandb_run_id"] for r in table if r.get("wandb_run_id")]})
    logged = {"compare/runs": rows_table(table), "compare/figure": wandb.Image(str(out))}
    for panel in (panel for row in panels(runs) for panel in row):
        title = panel.metric.title + (f" ({WINDOW}-step mean)" if panel.metric.per_step else "")
        lines = {label: thin(list(xs), list(ys), CHART_POINTS) for label, (xs, ys) in panel.lines.items()}
        logged[f"compare/{panel.metric.key}"] = line_chart(lines, title, panel.metric.xname)
    run.log(logged)
    info = {"project": project, "group": group, "id": run.id, "mode": mode, "dir": str(Path(run.dir).parent)}
    run.finish()
    return info


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("run_dirs", nargs="*", type=Path, help="train.py output directories (with metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("compare.png"), help="the figure (default: compare.png)")
    parser.add_argument("--label", action="append", default=[],
                        help="a run's name in the legend, once per run in order (default: norm, placement, LR)")
    parser.add_argument("--wandb", action="store_true", help="also log the panels, a runs table and the figure as "
                        "a W&B run (job_type compare) in the runs' group")
    parser.add_argument("--wandb-mode", choices=("auto", "online", "offline"), default="auto",
                        help="auto (default): $WANDB_MODE, else online when a wandb key is configured, else offline")
    parser.add_argument("--wandb-dir", type=Path, default=None,
                        help="where the W&B run's files go (DIR/wandb/; default: the folder of --out)")
    args = parser.parse_args(argv)
    try:
        mode = resolve_mode(args.wandb_mode) if args.wandb else "disabled"
        runs = load_runs(args.run_dirs, args.label)
    except ValueError as err:  # CompareError, a damaged metrics.jsonl or config.yaml, online W&B without a key
        return error_exit(parser.prog, err)
    try:  # in the format the suffix names (save_figure: a PNG gets a 256-colour palette)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_figure(figure(runs), args.out)
    except OSError as err:
        return error_exit(parser.prog, f"could not write {args.out}: {err.strerror or err}")
    except ValueError as err:  # a suffix matplotlib cannot write; its message lists the formats it can
        return error_exit(parser.prog, f"--out {args.out}: {err}")
    print(f"wrote {args.out}")
    if mode != "disabled":
        info = log_to_wandb(runs, args.out, args.wandb_dir or args.out.parent, mode)
        print(where_logged(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
