"""A study's standard figures, from its records alone (report.py draws them): each arm at its chosen LRs, and the
LR sweep its choice read. `answer.png` is the one a README opens with."""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullLocator
from matplotlib.transforms import offset_copy

from normlab.files.figures import lr_text
from normlab.study.plan import selection_arm, selection_warmup
from normlab.study.rules import eval_means, examples_per_step
from normlab.study.seedstats import t_interval


def arm_colours(arms: list[str]) -> dict:
    """{arm: colour}, one per arm in the study's order, so that every figure of a study draws an arm alike."""
    palette = plt.cm.tab10 if len(arms) <= 10 else plt.cm.tab20
    return {arm: palette(i % palette.N) for i, arm in enumerate(dict.fromkeys(arms))}


def plot_sweep(selection: dict, title: str, colours: dict):
    """Mean dev loss against the LR in the tuning sweep, per arm: where each arm's LR was chosen (a star; the stars
    of arms that chose the same LR side by side, so that none hides another). An arm swept without warmup too is
    drawn in its colour, dashed, and labelled so."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    keys = sorted(selection)
    sharing = {k: [x for x in keys if math.isclose(selection[x]["lr"], selection[k]["lr"])] for k in keys}
    for key in keys:
        chosen, arm = selection[key], selection_arm(key)
        xs = [row["lr"] for row in chosen["by_lr"]]
        ys = [min(row["dev_loss"], 1.0) for row in chosen["by_lr"]]
        colour, no_warmup = colours[arm], selection_warmup(key) == "off"
        ax.plot(xs, ys, "--o" if no_warmup else "-o", ms=3, color=colour,
                label=f"{arm} (no warmup)" if no_warmup else arm)
        best = next(y for x, y in zip(xs, ys) if math.isclose(x, chosen["lr"]))
        shift = (sharing[key].index(key) - (len(sharing[key]) - 1) / 2) * 11  # points: a star's width
        ax.plot([chosen["lr"]], [best], "*", ms=11, color=colour, mec="black", mew=0.5, zorder=3,
                transform=offset_copy(ax.transData, fig=fig, x=shift, units="points"))
    ax.set_xscale("log")
    lrs = sorted({row["lr"] for chosen in selection.values() for row in chosen["by_lr"]})
    ax.set_xticks(lrs, [lr_text(lr) for lr in lrs], fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("mean dev loss (capped at 1)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    return fig


def plot_board(board: dict, title: str, colours: dict, majority: float | None = None):
    """Left: each arm's final validation accuracy at its best LR (filled) and its runner-up LR (hollow), one dot per
    seed, mean and 95% t interval. Right: mean validation accuracy over training at the best LR, every
    evaluation, against `majority`, the accuracy of always answering the most common class, where it is known.
    Where the arms train at different batch sizes the curves are drawn against the examples seen, so that an arm
    at batch 8 (4x the steps) ends where one at batch 32 does. `board`: {arm: (runs at the best LR[, runs at the
    runner-up LR])}."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.2, 1]})
    order = sorted(board, key=lambda a: np.nanmean([r.score() for r in board[a][0]]))
    per_step = {arm: examples_per_step(board[arm][0]) for arm in board}
    in_examples = len(set(per_step.values())) > 1
    for i, arm in enumerate(order):
        for offset, runs, face in zip((0.12, -0.12), board[arm], (None, "none")):
            acc = np.array([r.score() for r in runs], dtype=float)
            acc = acc[np.isfinite(acc)]
            if not len(acc):
                continue
            left.scatter(acc, np.full(len(acc), i + offset), s=12, alpha=0.6, color=colours[arm],
                         facecolors=face)
            if len(acc) > 1:
                lo, hi = t_interval(acc)
                left.errorbar(acc.mean(), i + offset, xerr=(hi - lo) / 2, fmt="ko", ms=4, capsize=3,
                              mfc="k" if face is None else "white")
        curve = eval_means(board[arm][0])
        scale = per_step[arm] if in_examples else 1
        right.plot([s * scale for s in curve], list(curve.values()), color=colours[arm], label=arm)
    left.set_yticks(range(len(order)), order)
    left.set_xlabel("validation accuracy: best LR (filled, upper) and runner-up LR (hollow, lower)")
    right.set_xlabel("training examples seen" if in_examples else "optimizer step")
    right.set_ylabel("validation accuracy (mean over seeds, best LR)")
    if majority is not None:
        right.axhline(majority, color="grey", ls=":", lw=1, label="always the majority class")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    return fig
