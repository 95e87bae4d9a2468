"""A study's standard figures, from its records alone (report.py draws them): each arm at its chosen LRs, and the
LR sweep its choice read. `answer.png` is the one a README opens with."""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from normlab.study.grid import selection_arm
from normlab.study.rules import eval_means
from normlab.study.seedstats import t_interval


def plot_sweep(selection: dict, title: str):
    """Mean dev loss against the LR in the tuning sweep, per arm: where each arm's LR was chosen."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, chosen in sorted(selection.items()):
        xs = [row["lr"] for row in chosen["by_lr"]]
        ys = [min(row["dev_loss"], 1.0) for row in chosen["by_lr"]]
        variant = selection_arm(key)
        line, = ax.plot(xs, ys, "-o", ms=3, label=variant)
        best = next(y for x, y in zip(xs, ys) if math.isclose(x, chosen["lr"]))
        ax.plot([chosen["lr"]], [best], "*", ms=12, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("mean dev loss (capped at 1)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    return fig


def plot_board(board: dict, title: str, majority: float | None = None):
    """Left: each arm's final validation accuracy at its best LR (filled) and its runner-up LR (hollow), one dot per
    seed, mean and 95% t interval. Right: mean validation accuracy over training at the best LR, every
    evaluation, against `majority`, the accuracy of always answering the most common class, where it is known.
    `board`: {arm: (runs at the best LR[, runs at the runner-up LR])}."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.2, 1]})
    order = sorted(board, key=lambda a: np.nanmean([r.score() for r in board[a][0]]))
    for i, arm in enumerate(order):
        for offset, runs, face in zip((0.12, -0.12), board[arm], (None, "none")):
            acc = np.array([r.score() for r in runs], dtype=float)
            acc = acc[np.isfinite(acc)]
            if not len(acc):
                continue
            left.scatter(acc, np.full(len(acc), i + offset), s=12, alpha=0.6, color=f"C{i % 10}",
                         facecolors=face)
            if len(acc) > 1:
                lo, hi = t_interval(acc)
                left.errorbar(acc.mean(), i + offset, xerr=(hi - lo) / 2, fmt="ko", ms=4, capsize=3,
                              mfc="k" if face is None else "white")
        curve = eval_means(board[arm][0])
        right.plot(list(curve), list(curve.values()), color=f"C{i % 10}", label=arm)
    left.set_yticks(range(len(order)), order)
    left.set_xlabel("validation accuracy: best LR (filled, upper) and runner-up LR (hollow, lower)")
    right.set_xlabel("optimizer step")
    right.set_ylabel("validation accuracy (mean over seeds, best LR)")
    if majority is not None:
        right.axhline(majority, color="grey", ls=":", lw=1, label="always the majority class")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    return fig
