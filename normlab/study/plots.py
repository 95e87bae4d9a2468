"""The studies' figures, from the records alone: v3's (`all_figures`) and v4's board (`v4_figures`). Each
study's `answer.png` is the one the README opens with."""

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from normlab.study import outcomes as oc
from normlab.study.analysis import Records, leaderboard, outcome_grid, value
from normlab.study.seedstats import t_interval

LABELS = {"ln_pre": "LayerNorm (pre-LN)", "ln_post": "LayerNorm post-LN", "custom_ln": "hand-written LN",
          "rmsnorm": "RMSNorm", "dyt": "DyT", "batchnorm": "BatchNorm (naive)",
          "masked_batchnorm": "BatchNorm (masked)", "powernorm": "PowerNorm", "no_norm": "no norm"}


def plot_answer(rec: Records):
    """Left: each norm at its own tuned LR, one dot per seed, mean and 95% t interval. Right: the share of seeds
    that learn at each LR, post-LN vs pre-LN, with and without warmup."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    rows = sorted(leaderboard(rec), key=lambda r: np.nanmean(r["accuracy"]))
    for i, row in enumerate(rows):
        acc = row["accuracy"][np.isfinite(row["accuracy"])]
        left.scatter(acc, np.full(len(acc), i) + np.linspace(-0.15, 0.15, len(acc)), s=10, alpha=0.6)
        if len(acc) > 1:
            lo, hi = t_interval(acc)
            left.errorbar(acc.mean(), i, xerr=(hi - lo) / 2, fmt="ko", ms=4, capsize=3)
    left.set_yticks(range(len(rows)), [f"{LABELS.get(r['variant'], r['variant'])} (LR {r['lr']:g})" for r in rows])
    left.axvline(0.509, color="grey", ls=":", lw=1)
    left.set_xlabel("SST-2 validation accuracy (each norm at its own LR, chosen on dev)")
    grid = outcome_grid(rec, "placement")
    for variant, warmup, style in (("ln_post", "off", "r-o"), ("ln_post", "on", "r--o"),
                                   ("ln_pre", "off", "b-s"), ("ln_pre", "on", "b--s")):
        pts = [(g["lr"], g[oc.LEARNED] / g["n"]) for g in grid if g["variant"] == variant and g["warmup"] == warmup]
        if pts:
            right.plot(*zip(*pts), style, label=f"{'post' if variant == 'ln_post' else 'pre'}-LN, warmup {warmup}")
    right.set_xscale("log")
    lrs = sorted({g["lr"] for g in grid})
    right.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
    right.minorticks_off()
    right.set_xlabel("peak learning rate")
    right.set_ylabel("share of seeds that learn")
    right.legend(fontsize=8)
    fig.suptitle("Which norm, and where? (6-layer width-64 encoder, 320 steps on SST-2, 10 seeds)")
    return fig


def plot_curves(rec: Records):
    """Train loss (20-step moving mean, mean over seeds) of every leaderboard arm: when each leaves ln 2."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row in leaderboard(rec):
        runs = [r for r in rec.arm("leaderboard", row["variant"]) if r.get("curves", {}).get("loss")]
        n = min(len(r["curves"]["loss"]) for r in runs) if runs else 0
        if n:
            mean = np.nanmean([oc.smooth(r["curves"]["loss"][:n]) for r in runs], axis=0)
            ax.plot(runs[0]["curves"]["step"][:n], mean, label=LABELS.get(row["variant"], row["variant"]))
    ax.axhline(oc.PLATEAU - oc.MARGIN, color="grey", ls=":", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (moving mean)")
    ax.set_ylim(0.2, 0.8)
    ax.legend(fontsize=7, ncol=2)
    return fig


def plot_sweep(rec: Records):
    """Mean dev loss against the LR in the tuning sweep, per arm: where each arm's LR was chosen."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, chosen in sorted(rec.selection.items()):
        xs = [row["lr"] for row in chosen["by_lr"]]
        ys = [min(row["dev_loss"], 1.0) for row in chosen["by_lr"]]
        variant = key.split("/")[1]
        line, = ax.plot(xs, ys, "-o", ms=3, label=LABELS.get(variant, variant))
        best = next(y for x, y in zip(xs, ys) if math.isclose(x, chosen["lr"]))
        ax.plot([chosen["lr"]], [best], "*", ms=12, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("mean dev loss (capped at 1; a diverged run is off the chart)")
    ax.legend(fontsize=7, ncol=2)
    return fig


def all_figures(rec: Records, out: Path) -> list[str]:
    figures = {"answer.png": plot_answer, "curves.png": plot_curves, "sweep.png": plot_sweep}
    for name, plot in figures.items():
        fig = plot(rec)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    return list(figures)


def _eval_curve(runs: list[dict], field: str = "accuracy"):
    """(steps, mean over runs) of the validation evaluations every run logged at the same steps."""
    tables = [{e["step"]: e[field] for e in r.get("curves", {}).get("eval", []) if e.get(field) is not None}
              for r in runs]
    steps = sorted(set.intersection(*(set(t) for t in tables))) if tables else []
    return steps, [float(np.mean([t[s] for t in tables])) for s in steps]


def plot_board(rec: Records, board: dict, title: str):
    """v4's answer. Left: each arm's final validation accuracy at its best LR (filled) and its runner-up LR
    (hollow), one dot per seed, mean and 95% t interval. Right: mean validation accuracy over training at the
    best LR, every evaluation. `board`: {arm: (runs at the best LR, runs at the runner-up LR)}."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.2, 1]})
    order = sorted(board, key=lambda a: np.nanmean([value(r) for r in board[a][0]]))
    for i, arm in enumerate(order):
        for offset, runs, face in ((0.12, board[arm][0], None), (-0.12, board[arm][1], "none")):
            acc = np.array([value(r) for r in runs], dtype=float)
            acc = acc[np.isfinite(acc)]
            if not len(acc):
                continue
            left.scatter(acc, np.full(len(acc), i + offset), s=12, alpha=0.6, color=f"C{i % 10}",
                         facecolors=face)
            if len(acc) > 1:
                lo, hi = t_interval(acc)
                left.errorbar(acc.mean(), i + offset, xerr=(hi - lo) / 2, fmt="ko", ms=4, capsize=3,
                              mfc="k" if face is None else "white")
        steps, mean = _eval_curve(board[arm][0])
        right.plot(steps, mean, color=f"C{i % 10}", label=LABELS.get(arm, arm))
    left.set_yticks(range(len(order)), [LABELS.get(a, a) for a in order])
    left.set_xlabel("validation accuracy: best LR (filled, upper) and runner-up LR (hollow, lower)")
    right.set_xlabel("optimizer step")
    right.set_ylabel("validation accuracy (mean over seeds, best LR)")
    right.axhline(0.509, color="grey", ls=":", lw=1)
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    return fig


def v4_figures(rec: Records, out: Path, board: dict, title: str) -> list[str]:
    """answer.png of a v4 study with a classification board; nothing for an MLM or placement-only study."""
    if not board:
        return []
    fig = plot_board(rec, board, title)
    fig.tight_layout()
    fig.savefig(out / "answer.png", dpi=110)
    plt.close(fig)
    return ["answer.png"]


def plot_factorial(cells: list[dict], title: str):
    """Study v5: left, each cell's plateau exit, one dot per seed (filled at its best LR, hollow at its
    runner-up), coloured by the norm right before the classifier; right, the cell's 16-step spread of the
    classifier's inputs (1 - cosine, log scale: it spans six orders of magnitude). `cells`: {name, final, exits:
    {0: [...], 1: [...]}, spread}."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(cells) + 1.6), sharey=True,
                                      gridspec_kw={"width_ratios": [1.6, 1]})
    colour = {"ln": "tab:blue", "mbn": "tab:orange", "centred": "tab:green"}
    for i, c in enumerate(cells):
        col = colour[c["final"]]
        for rank, offset in ((0, -0.12), (1, 0.12)):
            x = np.asarray(c["exits"].get(rank, []), dtype=float)
            left.scatter(x, np.full(len(x), i + offset), s=16, color=col, alpha=0.75,
                         facecolors=col if rank == 0 else "none")
        if math.isfinite(c["spread"]):
            right.barh(i, max(c["spread"], 1e-7), color=col, alpha=0.8)
    left.set_yticks(range(len(cells)), [c["name"] for c in cells])
    left.set_xlabel("plateau exit step (filled: best LR, hollow: runner-up)")
    left.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("1 - cosine of classifier inputs after 16 steps")
    handles = [plt.Line2D([], [], marker="o", ls="", color=v, label=k) for k, v in
               (("final norm LN", colour["ln"]), ("final norm masked BN", colour["mbn"]),
                ("LN + batch centring", colour["centred"]))]
    left.legend(handles=handles, loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
