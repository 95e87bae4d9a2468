"""normlab-compare (normlab/cli/compare.py): the figure's panels on synthetic run directories (one line per run that
logged the metric, the y scale by the ratio rule, runs that lack a metric named, no panel for a metric no run has),
the labels, bad input as one error line with exit code 2, the W&B comparison run read back from its offline files,
and a real tiny training run."""

import json
import math

import pytest
import yaml

from normlab.cli import compare
from normlab.files import figures


def write_run(path, norm="layernorm", placement="pre", lr=1.78e-3, steps=40, layers=2, evals=True, grad_span=100.0):
    """A run directory as train.py writes it: config.yaml, summary.json and metrics.jsonl rows with its metric names
    (per-step rows; evaluation rows every 10 steps; `bn/{i}/stat_drift` for the BN family). The gradient norm falls
    by `grad_span` over the run; the loss stays within a factor of 2."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"norm": norm, "norm_placement": placement}, "train": {"lr": lr}, "wandb": {"group": "g"}}))
    (path / "summary.json").write_text(json.dumps({"status": "completed", "final": {"eval/accuracy": 0.75}}))
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "epoch": 0, "train/loss": 0.7 - 0.3 * step / steps, "train/lr": lr,
               "train/grad_norm": grad_span ** (1 - step / steps)}
        for i in range(layers):
            row |= {f"layers/{i}/grad_norm": 0.1 / (i + 1), f"layers/{i}/act_rms": 1.0 + i * step / steps,
                    f"layers/{i}/attn_logit_max": 2.0 + i, f"layers/{i}/update_ratio": 1e-3 * (i + 1)}
            if "batchnorm" in norm:
                row[f"bn/{i}/stat_drift"] = 0.5 / step
        rows.append(row)
        if evals and step % 10 == 0:
            rows.append({"step": step, "epoch": 0, "eval/loss": 0.6, "eval/accuracy": 0.5 + step / 200})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def drawn(fig) -> dict:
    """{title: axes} of the panels drawn."""
    return {ax.get_title(): ax for ax in fig.axes if ax.axison}


def run_lines(ax) -> list:
    """The runs' lines of a panel (not the faint raw values behind the train loss)."""
    return [line for line in ax.get_lines() if not line.get_label().startswith("_")]


@pytest.fixture
def three_runs(tmp_path):
    return [write_run(tmp_path / "ln_pre"), write_run(tmp_path / "ln_post", placement="post"),
            write_run(tmp_path / "bn", norm="masked_batchnorm")]


def test_every_run_is_overlaid_in_its_own_colour_on_each_metric(three_runs):
    fig = compare.figure(compare.load_runs(three_runs, []))
    panels = drawn(fig)
    assert len(panels) == 12 and "train loss" in panels and "by layer: activation RMS" in panels
    labels = ["layernorm pre lr 1.8e-3", "layernorm post lr 1.8e-3", "masked_batchnorm pre lr 1.8e-3"]
    for title, ax in panels.items():
        expected = labels[2:] if title.startswith("BN statistics drift") else labels
        assert [line.get_label() for line in run_lines(ax)] == expected, title
        assert [line.get_color() for line in run_lines(ax)] == [run_lines(panels["train loss"])[i].get_color()
                                                               for i in range(3) if labels[i] in expected]
    assert len(panels["train loss"].get_lines()) == 6  # each run's raw values too, faint
    drift = panels["BN statistics drift, layer mean"].get_legend().get_title().get_text()
    assert drift == "not logged by:\nlayernorm pre lr 1.8e-3\nlayernorm post lr 1.8e-3"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"{label}, acc 0.750" for label in labels]
    assert len(panels["by layer: gradient norm"].get_lines()[0].get_xdata()) == 2  # one point per layer
    by_layer = panels["by layer: gradient norm"]  # a 2-layer model has layers 0 and 1, nothing between
    lo, hi = by_layer.get_xlim()
    assert [t for t in by_layer.get_xticks() if lo <= t <= hi] == [0, 1]


def test_y_axis_is_linear_where_a_metric_barely_moves(three_runs):
    panels = drawn(compare.figure(compare.load_runs(three_runs, [])))
    scales = {title: ax.get_yscale() for title, ax in panels.items()}
    assert scales["train loss"] == scales["evaluation accuracy"] == scales["evaluation loss"] == "linear"
    assert scales["gradient norm (before clipping)"] == "log"  # falls 100x over the run
    assert scales["by layer: gradient norm"] == "linear"  # 0.1 and 0.05
    assert figures.y_scale([0.5, 0.9, 4.9]) == "linear" and figures.y_scale([0.5, 5.0]) == "log"
    assert figures.y_scale([0.0, 1e-3, 1e-2]) == "log"  # a zero (the first step's update) falls off the axis
    assert figures.y_scale([-1.0, 100.0]) == figures.y_scale([0.0, 0.0]) == "linear"


def test_a_metric_no_run_has_gets_no_panel(tmp_path):
    runs = [write_run(tmp_path / "a", evals=False), write_run(tmp_path / "b", evals=False, placement="post")]
    fig = compare.figure(compare.load_runs(runs, []))
    titles = set(drawn(fig))
    assert not {t for t in titles if t.startswith(("evaluation", "BN"))}
    assert {"train loss", "gradient norm (before clipping)", "update ratio ||dw||/||w||, layer mean"} <= titles
    assert len(titles) == 2 + 3 + 4  # training, stability over steps, by layer
    assert sum(not ax.axison for ax in fig.axes) == 2 + 1  # the rows' empty places


def test_labels_name_norm_placement_and_lr_or_the_directory(tmp_path):
    a = write_run(tmp_path / "x" / "seed0")
    b = write_run(tmp_path / "x" / "seed1")
    c = write_run(tmp_path / "plain", norm="rmsnorm", lr=1e-3)
    (c / "config.yaml").unlink()
    assert [r.label for r in compare.load_runs([a, b, c], [])] == [
        "layernorm pre lr 1.8e-3 (seed0)", "layernorm pre lr 1.8e-3 (seed1)", "plain"]
    assert [r.label for r in compare.load_runs([a, b], ["one", "two"])] == ["one", "two"]
    twice = [r.label for r in compare.load_runs([a, a], [])]  # a directory given twice: still two lines
    assert twice == [f"layernorm pre lr 1.8e-3 ({a}) #1", f"layernorm pre lr 1.8e-3 ({a}) #2"]
    assert compare.run_label({"model": {"norm": "dyt", "norm_placement": "post"}, "train": {"lr": 1e-2}}) == (
        "dyt post lr 1e-2")


def test_main_writes_the_figure(three_runs, tmp_path, capsys):
    from PIL import Image

    out = tmp_path / "figs" / "cmp.png"
    assert compare.main([*map(str, three_runs), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    width, height = Image.open(out).size
    assert width > height > 0


@pytest.mark.parametrize("case, words", [
    ("none", "no run directories given"),
    ("no_metrics", "has no metrics.jsonl"),
    ("missing_dir", "is not a directory"),
    ("damaged", "line 1 is not valid JSON"),
    ("labels", "1 --label for 2 run directories"),
    ("same_labels", "--label values must differ"),
    ("format", "Format 'xyz' is not supported"),
])
def test_bad_input_is_one_error_line_and_exit_2(three_runs, tmp_path, capsys, case, words):
    (tmp_path / "empty").mkdir()
    damaged = write_run(tmp_path / "damaged")
    (damaged / "metrics.jsonl").write_text("{oops\n" + (damaged / "metrics.jsonl").read_text())
    good = [str(p) for p in three_runs[:2]]
    argv = {"none": [], "no_metrics": [good[0], str(tmp_path / "empty")], "missing_dir": [str(tmp_path / "gone")],
            "damaged": [str(damaged)], "labels": [*good, "--label", "a"],
            "same_labels": [*good, "--label", "a", "--label", "a"],
            "format": [*good, "--out", str(tmp_path / "fig.xyz")]}[case]
    assert compare.main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert ": error: " in line and words in line and captured.out == ""


def test_wandb_run_holds_every_panel_as_a_line_series(three_runs, tmp_path, monkeypatch, capsys):
    import wandb

    from normlab.tracking.wandb_records import offline_runs

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "cmp.png"
    assert compare.main([*map(str, three_runs), "--out", str(out), "--wandb", "--wandb-mode", "offline"]) == 0
    assert "upload: wandb sync" in capsys.readouterr().out
    wandb.teardown()  # wandb's core process writes a run's last records on shutdown
    (run,) = offline_runs(tmp_path / "wandb")  # next to the figure
    assert run.exited and (run.group, run.job_type, run.name) == ("g", "compare", "cmp")
    charts = run.charts()
    assert len(charts) == 12 and set(charts.values()) == {"wandb/lineseries/v0"}
    labels = [r[0] for r in run.table("compare/runs")["data"]]
    assert labels == run.config["runs"] and len(labels) == 3
    for key in charts:
        lines = {line for _, line, _ in run.table(key)["data"]}
        assert lines == (set(labels[2:]) if key == "compare/stat_drift" else set(labels)), key
    steps = [x for x, line, _ in run.table("compare/train_loss")["data"] if line == labels[0]]
    assert steps == list(range(1, 41))
    assert run.summary["compare/figure"]["_type"] == "image-file"


def test_a_real_run_has_every_panel(tmp_path, capsys):
    """A tiny batchnorm run of train.py: the metric names compare reads are the ones it logs."""
    from train_utils import run_here

    out = tmp_path / "run"
    assert run_here(out, "--config", "batchnorm", "train.max_steps=4", "train.eval_steps=2") == 0
    panels = drawn(compare.figure(compare.load_runs([out], [])))
    assert len(panels) == 12 and all(len(run_lines(ax)) == 1 for ax in panels.values())
    assert run_lines(panels["train loss"])[0].get_label() == "batchnorm pre lr 2e-3"
    assert not any(math.isnan(y) for ax in panels.values() for y in run_lines(ax)[0].get_ydata())


@pytest.mark.parametrize("low, high, labelled", [(1.5e-4, 4e-3, {"0.0002", "0.0003", "0.0005", "0.001", "0.002",
                                                                  "0.003"}),
                                                 (0.3, 2.5, {"0.3", "0.5", "1", "2"}),
                                                 (1.2e-5, 2e-3, {"0.0001", "0.001"})])
def test_a_log_axis_with_fewer_than_two_powers_of_ten_also_labels_its_2s_3s_and_5s(low, high, labelled):
    """The update-ratio panel spanned 1.5e-4 to 4e-3: one power of ten in view, so one label on the axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    figures.plain_log_ticks(ax.yaxis, low, high)
    fig.canvas.draw()
    shown = {t.get_text() for t in ax.yaxis.get_majorticklabels() + ax.yaxis.get_minorticklabels()
             if t.get_text() and low <= t.get_position()[1] <= high}
    plt.close(fig)
    assert shown == labelled
