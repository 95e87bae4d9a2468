"""Look at training runs' W&B depth charts side by side without uploading anything, drawn locally from what each
run logged offline (RUN_DIR/wandb): one row per run, one panel per `depth/*` chart, one line per layer, in one PNG.

    python scripts/wandb_charts.py runs/post_ln runs/pre_ln          # writes depth-charts.png
    python scripts/wandb_charts.py runs/default --out default.png --linear
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from normlab.command import command_parser, error_exit
from normlab.files.figures import lr_text, save_figure, scale_y
from normlab.run_dir import RunDir
from normlab.tracking.wandb_records import RecordsError, offline_runs
from normlab.tracking.wandb_run import DEPTH_CHARTS


def training_run(run_dir: Path):
    """The newest offline training run under RUN_DIR/wandb that drew depth charts."""
    wandb_dir = RunDir(run_dir).wandb_dir
    runs = [r for r in offline_runs(wandb_dir) if r.job_type == "train" and r.charts()]
    if not runs:
        raise RecordsError(f"no offline wandb training run with depth charts under {wandb_dir}")
    return runs[-1]


def row_label(run) -> str:
    """The run in three short lines (norm; placement and LR; status and accuracy): a row's label must fit beside
    its panels, whose height is all it has."""
    c, s = run.config, run.summary
    lr = c.get("train.lr")
    accuracy = s.get("final/eval/accuracy")
    return (f"{c.get('model.norm')}\n{c.get('model.norm_placement')}-norm, lr "
            f"{lr_text(lr) if isinstance(lr, (int, float)) else lr}\n{s.get('status')}"
            + (f", val acc {accuracy:.3f}" if isinstance(accuracy, float) else ""))


def figure(runs, log_y: bool = True):
    """The figure: a row per run, a column per depth chart any run drew, each column titled on its first drawn
    panel (the BN drift chart's first may be in a later row)."""
    quantities = [q for q in DEPTH_CHARTS if any(f"depth/{q}" in r.charts() for r in runs)]
    fig, axes = plt.subplots(len(runs), len(quantities), figsize=(3.4 * len(quantities), 2.6 * len(runs)),
                             squeeze=False, sharex=True)
    titled = set()
    for row, run in enumerate(runs):
        for col, quantity in enumerate(quantities):
            ax = axes[row][col]
            if f"depth/{quantity}" not in run.charts():
                ax.set_axis_off()
                continue
            lines = {}  # {line: [(step, value), ...]}
            for step, line, value in run.table(f"depth/{quantity}")["data"]:
                lines.setdefault(line, []).append((step, value))
            colors = plt.cm.viridis([i / max(len(lines) - 1, 1) for i in range(len(lines))])
            for (line, points), color in zip(lines.items(), colors):
                ax.plot(*zip(*points), color=color, linewidth=1, label=line)
            if log_y:  # log where the values span LOG_RATIO, plain numbers (as normlab-compare's panels)
                scale_y(ax, [v for points in lines.values() for _, v in points])
            ax.grid(alpha=0.3)
            if quantity not in titled:
                ax.set_title(f"depth/{quantity}\n{DEPTH_CHARTS[quantity]}", fontsize=8)
                titled.add(quantity)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # steps: never 1.25; labels apart
            if row == len(runs) - 1:
                ax.set_xlabel("step")
            if col == 0:
                ax.set_ylabel(row_label(run), fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="train.py output directories (with wandb/)")
    parser.add_argument("--out", type=Path, default=Path("depth-charts.png"),
                        help="the PNG to write (default: depth-charts.png)")
    parser.add_argument("--linear", action="store_true",
                        help="linear y axes (default: log where the values are positive and span 10x or more)")
    args = parser.parse_args(argv)
    try:
        runs = [training_run(d) for d in args.run_dirs]
    except RecordsError as err:
        return error_exit("wandb_charts.py", err)
    save_figure(figure(runs, log_y=not args.linear), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
