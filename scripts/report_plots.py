"""The study report's figures, from the records alone (common/study_analysis.StudyData). Every seed is drawn:
thin lines or dots per seed, a thick line for the mean."""

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the machines that run studies
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from common import study_analysis as sa  # noqa: E402

COLORS = {"post": "tab:red", "pre": "tab:blue", "deepnorm": "tab:green"}


def _panels(n, width=3.6, height=3.0, **kw):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, **kw)
    return fig, axes[0]


def _save(fig, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_e1_grad_norm(data, path: Path) -> None:
    depths = sorted({r["depth"] for r in data.e1})
    fig, axes = _panels(len(depths))
    for ax, depth in zip(axes, depths):
        for placement, color in COLORS.items():
            rows = list(sa.e1_rows(data, placement, depth).values())
            for r in rows:
                ax.plot(range(depth), r["grad_norm"], color=color, alpha=0.3, lw=0.8)
            ax.plot(range(depth), np.mean([r["grad_norm"] for r in rows], 0), color=color, lw=2, label=placement)
        ax.set(yscale="log", xlabel="block", title=f"depth {depth}")
    axes[0].set_ylabel("gradient norm at init")
    axes[0].legend()
    _save(fig, "E1: per-block gradient norm at initialization (thin: seeds)", path)


def plot_e1_output_change(data, path: Path) -> None:
    fig, axes = _panels(2)
    depths = sorted({r["depth"] for r in data.e1})
    for placement, color in COLORS.items():
        rows = [r for r in data.e1 if r["placement"] == placement]
        axes[0].scatter([r["depth"] for r in rows], [r["output_change"][-1] for r in rows], color=color, s=10)
        means = [np.mean([r["output_change"][-1] for r in rows if r["depth"] == d]) for d in depths]
        axes[0].plot(depths, means, color=color, label=placement)
        deepest = [r for r in rows if r["depth"] == depths[-1]]
        for r in deepest:
            axes[1].plot(range(1, len(r["output_change"]) + 1), r["output_change"], color=color, alpha=0.6)
    axes[0].set(xscale="log", yscale="log", xlabel="depth", ylabel="relative output change after 10 steps")
    axes[1].set(yscale="log", xlabel="Adam step", ylabel=f"relative output change, depth {depths[-1]}")
    axes[0].legend()
    _save(fig, "E1: the first Adam updates (dots and thin lines: seeds)", path)


SWEEP_PANELS = {
    "E2: placement x warmup": [("e2", "post_ln", "off", "tab:red", "--"), ("e2", "post_ln", "on", "tab:red", "-"),
                               ("e2", "pre_ln", "off", "tab:blue", "--"), ("e2", "pre_ln", "on", "tab:blue", "-")],
    "A/A (custom vs torch LN), E4 (qk_norm)": [("e2", "pre_ln", "on", "tab:blue", "-"),
                                              ("aa", "custom_ln", "on", "tab:gray", ":"),
                                              ("e4", "pre_ln_qknorm", "on", "tab:purple", "-")],
}


def plot_lr_sweep(data, path: Path) -> None:
    fig, axes = _panels(2, width=5, sharey=True)
    for ax, (title, arms) in zip(axes, SWEEP_PANELS.items()):
        for i, (exp, variant, warmup, color, style) in enumerate(arms):
            runs = data.arm(exp, variant, warmup)
            if not runs:
                continue
            l0 = sa.initial_loss(runs)
            loss = [sa.score(r) if r["status"] == "completed" else l0 for r in runs]
            lrs = sorted({r["lr"] for r in runs})
            jitter = 1 + 0.05 * (i - 1.5)  # side by side, so every seed's dot stays visible
            ax.scatter([r["lr"] * jitter for r in runs], loss, color=color, s=12)
            means = [np.mean([x for r, x in zip(runs, loss) if r["lr"] == lr]) for lr in lrs]
            ax.plot(lrs, means, color=color, ls=style, label=f"{exp} {variant}, warmup {warmup}")
        ax.axhline(math.log(2), color="k", lw=0.5)
        ax.set(xscale="log", xlabel="peak LR", title=title)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("validation loss (failed run: initial loss)")
    _save(fig, "Validation loss against the LR (dots: seeds; line: mean)", path)


def plot_e3_batching(data, path: Path) -> None:
    rows = sa.e3_table(data)
    groups = [(n, b) for n in sa.E3_NORMS for b in ("random", "grouped")]
    fig, axes = _panels(len(groups), width=2.6, height=3.2, sharey=True)
    for ax, (norm, batches) in zip(axes, groups):
        mine = [r for r in rows if r["norm"] == norm and r["batches"] == batches]
        for j, r in enumerate(mine):
            color = "tab:orange" if r["mode"] == "batch" else "tab:blue"
            ax.bar(j, np.mean(r["accuracy"]), color=color, alpha=0.5)
            ax.scatter([j] * len(r["accuracy"]), r["accuracy"], color="k", s=6)
        ax.set_xticks(range(len(mine)), [f"{r['eval'][:4]}/{r['mode'][:3]}" for r in mine], rotation=90, fontsize=7)
        ax.set_title(f"{norm}\ntrained {batches}", fontsize=8)
        ax.set_ylim(0.45, 0.85)
    axes[0].set_ylabel("validation accuracy")
    _save(fig, "E3: accuracy per eval batching (blue: running stats, orange: batch stats; dots: seeds)", path)


def plot_stat_drift(data, path: Path) -> None:
    fig, axes = _panels(len(sa.E3_BN_NORMS), width=4.5)
    for ax, norm in zip(axes, sa.E3_BN_NORMS):
        for batches, color in (("random", "tab:red"), ("grouped", "tab:blue")):
            for k, r in enumerate(data.arm("e3", f"{norm}-{batches}")):
                c = r.get("curves", {})
                if "stat_drift" in c:
                    ax.plot(c["step"], c["stat_drift"], color=color, alpha=0.6, lw=0.8,
                            label=f"{batches} batches" if k == 0 else None)
        ax.set(yscale="log", xlabel="step", ylabel="mean BN stat drift", title=norm)
        ax.legend(fontsize=7)
    _save(fig, "E3: BN batch vs running statistics over training (lines: seeds)", path)


def plot_logit_max(data, path: Path) -> None:
    lrs = data.lrs("e4")
    fig, axes = _panels(len(lrs), sharey=True)
    for ax, lr in zip(axes, lrs):
        for exp, variant, color in (("e2", "pre_ln", "tab:blue"), ("e4", "pre_ln_qknorm", "tab:purple")):
            for k, r in enumerate(data.arm(exp, variant, "on", lr)):
                c = r.get("curves", {})
                if "attn_logit_max" in c:
                    ax.plot(c["step"], c["attn_logit_max"], color=color, alpha=0.7, lw=0.8,
                            label=variant if k == 0 else None)
        ax.set(xlabel="step", title=f"LR {lr:g}", yscale="log")
    axes[0].set_ylabel("max attention logit over layers")
    axes[0].legend(fontsize=7)
    _save(fig, "E4: attention-logit growth, pre-LN with and without qk_norm (lines: seeds)", path)


def all_figures(data, out: Path) -> list[str]:
    made = []
    jobs = [(data.e1, plot_e1_grad_norm, "e1_grad_norm.png"), (data.e1, plot_e1_output_change, "e1_output_change.png"),
            (data.arm("e2", "post_ln", "off"), plot_lr_sweep, "e2_lr_sweep.png"),
            (data.arm("e3", "batchnorm-random"), plot_e3_batching, "e3_batching.png"),
            (data.arm("e3", "batchnorm-random"), plot_stat_drift, "e3_stat_drift.png"),
            (data.arm("e4", "pre_ln_qknorm", "on"), plot_logit_max, "e4_logit_max.png")]
    for present, fn, name in jobs:
        if present:
            fn(data, out / name)
            made.append(name)
    return made
