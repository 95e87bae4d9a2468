"""scripts/report.py on a hand-made study directory, and scripts/study.py's grid, narrowing, skipping and failure
recording with a fake runner (no training here: every number below is computed by hand from the synthetic
curves)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from common.stability import count_loss_spikes

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import report  # noqa: E402
import study  # noqa: E402

INITIAL = 0.7
STEPS = 60
# (variant, norm, placement) -> lr -> per-seed (final loss | "diverged", final accuracy, accuracy with batch stats)
PLAN = {
    ("pre_ln", "custom_layernorm", "pre"): {
        1e-3: [(0.4, 0.80, None), (0.5, 0.82, None)],
        1e-2: [(0.3, 0.85, None), (0.3, 0.83, None)],
    },
    ("post_ln", "custom_layernorm", "post"): {
        1e-3: [(0.5, 0.70, None), (0.5, 0.74, None)],
        1e-2: [("diverged", None, None), (0.9, 0.50, None)],
    },
    ("batchnorm", "batchnorm", "pre"): {
        1e-3: [(0.6, 0.60, 0.70), (0.4, 0.64, 0.70)],
        1e-2: [(0.2, 0.66, 0.70), (0.4, 0.70, 0.70)],
    },
}
SPIKE_RUN = "pre_ln-lr0.01-wuon-s0"  # gets one loss spike at step 30
LAYER_RMS = {"pre": [1.0, 2.0, 4.0, 8.0], "post": [1.0, 1.0, 1.0, 1.0]}


def loss_curve(final, spike=False):
    """0.7 at the first step, a straight line down (or up) to `final` at step 40, then flat: the mean of the last
    20 losses is exactly `final`, and a smooth curve has no spikes."""
    curve = [INITIAL + (final - INITIAL) * t / 40 for t in range(40)] + [final] * (STEPS - 40)
    if spike:
        curve[30] = 3.0
    return curve


def write_run(run_dir, norm, placement, lr, seed, final, acc, acc_bs):
    run_dir.mkdir(parents=True)
    cfg = {"seed": seed, "output_dir": str(run_dir), "model": {"norm": norm, "norm_placement": placement},
           "train": {"lr": lr, "warmup_steps": 10}, "wandb": {"project": "normlab-test"}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    diverged = final == "diverged"
    losses = loss_curve(0.6)[:25] + [float("nan")] if diverged else loss_curve(final, spike=run_dir.name == SPIKE_RUN)
    lines = []
    for step, loss in enumerate(losses, start=1):
        rec = {"step": step, "train/loss": loss if math.isfinite(loss) else None, "train/lr": lr,
               "train/grad_norm": 1.0 + step / 10}
        for i, rms in enumerate(LAYER_RMS[placement]):
            rec[f"layers/{i}/act_rms"] = rms * (0.5 if step < len(losses) else 1.0)
        lines.append(json.dumps(rec))
    if not diverged:
        ev = {"step": STEPS, "eval/loss": final, "eval/accuracy": acc}
        if acc_bs is not None:
            ev["eval/accuracy_batch_stats"] = acc_bs
        lines.append(json.dumps(ev))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"status": "diverged" if diverged else "completed",
                                                      "wandb_run_id": f"id-{run_dir.name}"}))


def make_synthetic_study(study_dir: Path) -> Path:
    runs = {}
    for (variant, norm, placement), by_lr in PLAN.items():
        for lr, seeds in by_lr.items():
            for seed, (final, acc, acc_bs) in enumerate(seeds):
                name = f"{variant}-lr{lr:g}-wuon-s{seed}"
                write_run(study_dir / "runs" / name, norm, placement, lr, seed, final, acc, acc_bs)
                runs[name] = {"variant": variant, "lr": lr, "warmup": "on", "seed": seed, "status": "completed"}
    # a run that crashed before train.py wrote anything: only the study knows about it
    runs["pre_ln-lr0.001-wuon-s2"] = {"variant": "pre_ln", "lr": 1e-3, "warmup": "on", "seed": 2, "status": "failed"}
    meta = {"name": "synthetic", "command": "python scripts/study.py --preset synthetic", "runs": runs,
            "comparisons": [["post_ln", "pre_ln"], ["pre_ln", "batchnorm"]]}
    (study_dir / "study.json").write_text(json.dumps(meta))
    return study_dir


@pytest.fixture(scope="module")
def reported_study(tmp_path_factory):
    """The synthetic study, reported once through the command line with wandb offline (the slow part), into a
    separate folder (--out, as for docs/). Returns that folder; the study is its sibling `synthetic`."""
    root = tmp_path_factory.mktemp("study")
    study_dir = make_synthetic_study(root / "synthetic")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "report.py"), str(study_dir), "--out",
                          str(root / "docs")], env=env, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert not (study_dir / "report.md").exists()
    return root / "docs"


def md_table(text, first_header):
    """The markdown table whose header starts with `first_header`, as a list of {column: cell} dicts."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, [c.strip() for c in line.strip("|").split("|")])))
    return rows


def test_synthetic_curves_are_what_the_hand_numbers_assume():
    assert count_loss_spikes(loss_curve(0.3, spike=True)) == 1
    assert all(count_loss_spikes(loss_curve(f)) == 0 for f in (0.2, 0.3, 0.4, 0.5, 0.6, 0.9))
    assert np.mean(loss_curve(0.4)[-20:]) == pytest.approx(0.4)


def test_report_tables_match_hand_computation(reported_study):
    text = (reported_study / "report.md").read_text()
    summary = {row["variant"]: row for row in md_table(text, "variant")}
    # pre_ln: capped finals per LR = mean(0.4, 0.5) = 0.45 and 0.3 -> sensitivity mean(0.15, 0) = 0.075
    # post_ln: 0.5 and mean(diverged -> 0.7, 0.9 -> capped 0.7) = 0.7 -> mean(0, 0.2) = 0.1
    # batchnorm: mean(0.6, 0.4) = 0.5 and mean(0.2, 0.4) = 0.3 -> 0.1
    assert summary["pre_ln"]["LR sensitivity"] == "0.0750"
    assert summary["post_ln"]["LR sensitivity"] == "0.1000"
    assert summary["batchnorm"]["LR sensitivity"] == "0.1000"
    # accuracy at the best LR: mean ± sample std over seeds
    assert summary["pre_ln"]["best LR"] == "0.01"
    assert summary["pre_ln"]["val accuracy at best LR"] == f"0.8400 ± {np.std([0.85, 0.83], ddof=1):.4f} (n=2)"
    assert summary["post_ln"]["best LR"] == "0.001"
    assert summary["post_ln"]["val accuracy at best LR"] == f"0.7200 ± {np.std([0.70, 0.74], ddof=1):.4f} (n=2)"
    # divergences, the failed run, the one spike
    assert summary["post_ln"]["diverged"] == "1/4"
    assert summary["pre_ln"]["diverged"] == "0/5" and summary["pre_ln"]["failed"] == "1"
    assert summary["pre_ln"]["loss spikes"] == "1" and summary["post_ln"]["loss spikes"] == "0"
    # BN train/eval gap at the best LR (0.01): mean(0.70 - 0.66, 0.70 - 0.70) = +0.02; none for LayerNorm
    assert summary["batchnorm"]["best LR"] == "0.01"
    assert summary["batchnorm"]["BN train/eval gap"] == "+0.0200"
    assert summary["pre_ln"]["BN train/eval gap"] == "–"

    per_lr = {(r["variant"], r["LR"]): r for r in md_table(text.split("## Per learning rate")[1], "variant")}
    assert per_lr[("post_ln", "0.01")]["val accuracy"] == "0.5000 (n=1)"  # the diverged seed has no accuracy
    assert per_lr[("batchnorm", "0.001")]["BN train/eval gap"] == "+0.0800"
    assert per_lr[("pre_ln", "0.001")]["final train loss"] == "0.4500"
    assert per_lr[("pre_ln", "0.001")]["runs"] == "3"

    # the definition is stated, and the observations are the table's numbers
    assert "Wortsman et al. 2023" in text and "min(final_loss(lr), initial_loss)" in text
    assert "Study command: `python scripts/study.py --preset synthetic`" in text
    assert f"--out {reported_study}`" in text  # the exact report command
    assert "Lowest LR sensitivity: pre_ln (0.0750)" in text
    assert "Diverged runs: post_ln 1/4." in text
    assert "post_ln vs pre_ln (warmup on)" in text

    data = json.loads((reported_study / "report.json").read_text())
    pre = next(s for s in data["series"] if s["variant"] == "pre_ln")
    assert pre["lr_sensitivity"] == pytest.approx(0.075)
    assert pre["initial_loss"] == pytest.approx(INITIAL)
    assert pre["capped_loss_by_lr"] == {"0.001": pytest.approx(0.45), "0.01": pytest.approx(0.3)}


def test_report_figures_are_valid_pngs_and_linked(reported_study):
    text = (reported_study / "report.md").read_text()
    for name in ("loss_curves", "grad_norm", "act_rms", "lr_sensitivity"):
        path = reported_study / f"{name}.png"
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 200
        assert f"]({name}.png)" in text


def test_final_act_rms_is_the_last_logged_profile(tmp_path):
    _, runs = report.load_study(make_synthetic_study(tmp_path / "s"))
    pre = next(r for r in runs if r.variant == "pre_ln" and r.status == "completed")
    np.testing.assert_allclose(report.final_act_rms(pre), LAYER_RMS["pre"])


def test_report_without_study_json_names_variants_from_configs(tmp_path):
    study_dir = make_synthetic_study(tmp_path / "s")
    (study_dir / "study.json").unlink()
    _, runs = report.load_study(study_dir)
    _, series_rows = report.compute_tables(runs)
    variants = {row["variant"]: row for row in series_rows}
    assert set(variants) == {"custom_layernorm-pre", "custom_layernorm-post", "batchnorm-pre"}
    assert variants["custom_layernorm-pre"]["lr_sensitivity"] == pytest.approx(0.075)
    assert variants["custom_layernorm-pre"]["runs"] == 4  # the failed run was only known to study.json


def test_report_logged_to_wandb_offline_in_the_study_group(reported_study):
    from common.wandb_records import offline_runs

    offline = offline_runs(reported_study.parent / "synthetic" / "wandb")  # in the study dir
    assert len(offline) == 1
    run = offline[0]
    info = json.loads((reported_study / "report.json").read_text())["wandb"]
    assert info["group"] == "synthetic" and info["mode"] == "offline" and info["project"] == "normlab-test"
    assert (run.id, run.group, run.job_type, run.project) == (info["id"], "synthetic", "report", "normlab-test")
    # the verdict table: the summary rows
    table = run.table("study/verdicts")
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}
    assert rows["pre_ln"]["lr_sensitivity"] == pytest.approx(0.075) and rows["post_ln"]["diverged"] == 1
    # every run, every seed and LR (the failed one too), linked by its wandb id
    table = run.table("study/runs")
    runs = {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}
    assert len(runs) == 13 and runs["pre_ln-lr0.001-wuon-s2"]["status"] == "failed"
    assert runs["post_ln-lr0.001-wuon-s1"]["val_accuracy"] == pytest.approx(0.74)
    assert runs["post_ln-lr0.01-wuon-s0"]["final_train_loss"] is None  # diverged: no final loss
    assert runs["batchnorm-lr0.001-wuon-s0"]["bn_train_eval_gap"] == pytest.approx(0.10)
    assert sorted(run.config["runs"]) == sorted(f"id-{n}" for n in runs if not n.endswith("s2"))
    # the LR sweeps: interactive line series, one line per variant, x = log10(LR)
    charts = run.charts()
    assert charts["study/lr_sweep/val_accuracy"] == "wandb/lineseries/v0"
    sweep = run.table("study/lr_sweep/val_accuracy")
    points = {(line, round(x, 6)): y for x, line, y in sweep["data"]}
    assert points[("post_ln", -2.0)] == pytest.approx(0.50)  # the diverged seed has no accuracy
    assert points[("pre_ln", -3.0)] == pytest.approx(0.81)
    assert len(run.table("study/lr_sweep/capped_final_loss")["data"]) == 6  # 3 variants x 2 LRs
    assert len(list(run.directory.glob("files/media/images/**/*.png"))) == 4


def test_report_cli_errors_on_missing_study(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope"), "--no-wandb"]) == 2
    assert "study directory not found" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# study.py: the grid, narrowing, skipping finished runs, recording failures (a fake runner instead of train.py)

GRID = """
name: tiny
overrides: {train.max_steps: 5, data.max_train_samples: 64}
variants:
  post_ln: {config: post_ln}
  masked_batchnorm: {config: masked_batchnorm, warmup: [on], overrides: {model.bn_momentum: 0.2}}
lr: {min: 1.0e-4, max: 1.0e-2, num: 3}
warmup: {on: 10, off: 0}
seeds: [0, 1]
comparisons: [[post_ln, masked_batchnorm]]
"""


@pytest.fixture()
def grid(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(GRID)
    return path, study.load_grid(path)


def test_lr_grid_is_log_spaced_and_lists_pass_through():
    assert study.lr_grid({"min": 1e-4, "max": 1e-2, "num": 3}) == [1e-4, 1e-3, 1e-2]
    assert study.lr_grid({"min": 1e-3, "max": 1e-2, "num": 3}) == [1e-3, 0.00316, 1e-2]
    assert study.lr_grid([3e-4, 1e-3]) == [3e-4, 1e-3]
    with pytest.raises(study.StudyError):
        study.lr_grid({"min": 1e-2, "max": 1e-4, "num": 3})


def test_grid_expansion_respects_per_variant_warmup(grid):
    _, g = grid
    runs = study.expand(g)
    # post_ln: 3 lr x 2 warmup x 2 seeds; masked_batchnorm: 3 lr x warmup on only x 2 seeds
    assert len(runs) == 12 + 6
    assert len({r["name"] for r in runs}) == len(runs)
    assert {r["warmup"] for r in runs if r["variant"] == "masked_batchnorm"} == {"on"}
    assert "post_ln-lr0.001-wuoff-s1" in {r["name"] for r in runs}


def test_narrowing_from_the_command_line(grid):
    _, g = grid
    runs = study.expand(g)
    only = study.parse_only(["variant=post_ln,seed=0", "lr=1e-3,0.01"])
    assert only == {"variant": {"post_ln"}, "seed": {"0"}, "lr": {"1e-3", "0.01"}}
    picked = study.narrow(runs, only)
    assert sorted(r["name"] for r in picked) == sorted(
        f"post_ln-lr{lr}-wu{w}-s0" for lr in ("0.001", "0.01") for w in ("on", "off"))
    assert {r["name"] for r in study.narrow(runs, study.parse_only(["warmup=off"]))} == {
        r["name"] for r in runs if r["variant"] == "post_ln" and r["warmup"] == "off"}
    with pytest.raises(study.StudyError, match="lr=0.005: not in the grid; choose from 0.0001, 0.001, 0.01"):
        study.narrow(runs, study.parse_only(["lr=0.005"]))
    with pytest.raises(study.StudyError, match="unknown key 'norm'"):
        study.parse_only(["norm=rmsnorm"])


def test_train_command_carries_the_run_and_the_study(grid, tmp_path):
    _, g = grid
    run = next(r for r in study.expand(g) if r["name"] == "masked_batchnorm-lr0.01-wuon-s1")
    cmd = study.train_command(g, run, tmp_path / "st", ["train.batch_size=8"], ["python"])
    assert cmd[:4] == ["python", str(study.REPO_ROOT / "train.py"), "--config", "configs/masked_batchnorm.yaml"]
    for item in ("train.max_steps=5", "model.bn_momentum=0.2", "train.lr=0.01", "seed=1", "train.warmup_steps=10",
                 f"output_dir={tmp_path / 'st' / 'runs' / run['name']}", "wandb.group=tiny", "train.resume=auto"):
        assert item in cmd
    assert cmd[-1] == "train.batch_size=8"  # command-line overrides come last and win


class FakeRunner:
    """Stands in for train.py: writes what train.py would, by the run's name."""

    def __init__(self, outcome):
        self.outcome, self.calls = outcome, []

    def __call__(self, cmd, log_path, env):
        out_dir = Path(next(c for c in cmd if c.startswith("output_dir=")).split("=", 1)[1])
        self.calls.append(out_dir.name)
        outcome = self.outcome(out_dir.name)
        if outcome == "raise":
            raise OSError("cannot start")
        if outcome == "crash":
            log_path.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
            return 1
        out_dir.mkdir(parents=True)
        (out_dir / "summary.json").write_text(json.dumps({"status": outcome}))
        return 0 if outcome == "completed" else 3


def test_failed_runs_are_recorded_and_reruns_skip_finished_ones(grid, tmp_path):
    grid_file, g = grid
    runs = study.narrow(study.expand(g), study.parse_only(["variant=post_ln,warmup=on,seed=0"]))
    assert [r["name"] for r in runs] == [f"post_ln-lr{lr}-wuon-s0" for lr in ("0.0001", "0.001", "0.01")]
    study_dir = tmp_path / "st"

    def first_outcome(name):
        return {"0.0001": "completed", "0.001": "crash", "0.01": "diverged"}[name.split("-lr")[1].split("-")[0]]

    runner = FakeRunner(first_outcome)
    statuses = study.run_study(g, grid_file, study_dir, runs, runner=runner, print_fn=lambda *a: None)
    assert runner.calls == [r["name"] for r in runs]  # the crash did not stop the study
    assert statuses == {"post_ln-lr0.0001-wuon-s0": "completed", "post_ln-lr0.001-wuon-s0": "failed",
                        "post_ln-lr0.01-wuon-s0": "diverged"}
    record = json.loads((study_dir / "study.json").read_text())
    failed = record["runs"]["post_ln-lr0.001-wuon-s0"]
    assert failed["status"] == "failed" and failed["returncode"] == 1 and "RuntimeError: boom" in failed["error"]
    assert record["runs"]["post_ln-lr0.01-wuon-s0"]["status"] == "diverged"
    assert record["name"] == "tiny" and record["comparisons"] == [["post_ln", "masked_batchnorm"]]

    # the same command again: only the failed run is trained; this time it cannot even start
    runner = FakeRunner(lambda name: "raise")
    statuses = study.run_study(g, grid_file, study_dir, runs, runner=runner, print_fn=lambda *a: None)
    assert runner.calls == ["post_ln-lr0.001-wuon-s0"]
    record = json.loads((study_dir / "study.json").read_text())
    assert record["runs"]["post_ln-lr0.001-wuon-s0"]["error"] == "OSError: cannot start"
    assert statuses["post_ln-lr0.0001-wuon-s0"] == "completed"

    # and once it succeeds, nothing is left to do
    study.run_study(g, grid_file, study_dir, runs, runner=FakeRunner(lambda name: "completed"), print_fn=lambda *a: None)
    runner = FakeRunner(lambda name: "completed")
    study.run_study(g, grid_file, study_dir, runs, runner=runner, print_fn=lambda *a: None)
    assert runner.calls == []
    record = json.loads((study_dir / "study.json").read_text())
    assert {r["status"] for r in record["runs"].values()} == {"completed", "diverged"}
    assert "error" not in record["runs"]["post_ln-lr0.001-wuon-s0"]  # the earlier failure is not carried over


def test_several_gpus_run_one_run_per_gpu_at_a_time(grid, tmp_path, monkeypatch):
    import threading
    import time

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    grid_file, g = grid
    runs = study.expand(g)[:6]
    busy, seen, lock = set(), [], threading.Lock()

    def runner(cmd, log_path, env):
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            assert gpu not in busy  # never two runs on one GPU
            busy.add(gpu)
            seen.append(gpu)
        time.sleep(0.05)
        with lock:
            busy.discard(gpu)
        out_dir = Path(next(c for c in cmd if c.startswith("output_dir=")).split("=", 1)[1])
        out_dir.mkdir(parents=True)
        (out_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
        return 0

    statuses = study.run_study(g, grid_file, tmp_path / "st", runs, runner=runner, parallel=2, gpus=2,
                               print_fn=lambda *a: None)
    assert set(statuses.values()) == {"completed"} and len(statuses) == 6
    assert sorted(set(seen)) == ["0", "1"] and len(seen) == 6


def test_parallel_cpu_runs_split_the_cores(grid, tmp_path, monkeypatch):
    """Two CPU runs at once get half the cores each, as train.cpu_threads (unambiguous under accelerate launch)
    and as OMP_NUM_THREADS for everything else."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(study.os, "cpu_count", lambda: 8)
    grid_file, g = grid
    seen = []

    def runner(cmd, log_path, env):
        seen.append(([c for c in cmd if c.startswith("train.cpu_threads=")], env["OMP_NUM_THREADS"]))
        out_dir = Path(next(c for c in cmd if c.startswith("output_dir=")).split("=", 1)[1])
        out_dir.mkdir(parents=True)
        (out_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
        return 0

    study.run_study(g, grid_file, tmp_path / "st", study.expand(g)[:2], runner=runner, parallel=2, gpus=0,
                    print_fn=lambda *a: None)
    assert seen == [(["train.cpu_threads=4"], "4")] * 2


def test_cli_dry_run_lists_runs_and_rejects_bad_input(grid, tmp_path, capsys):
    grid_file, _ = grid
    argv = ["--preset", str(grid_file), "--study-dir", str(tmp_path / "st"), "--dry-run"]
    assert study.main(argv + ["--only", "variant=masked_batchnorm,seed=0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("3 runs (3 to train)")
    assert all(line.startswith("train") and "wandb.group=tiny" in line for line in lines[:3])
    assert not (tmp_path / "st").exists()  # a dry run writes nothing
    assert study.main(argv + ["model.nrom=rmsnorm"]) == 2
    assert "unknown config key 'model.nrom'" in capsys.readouterr().err
    assert study.main(["--preset", "nope", "--dry-run"]) == 2
    assert "--preset 'nope' not found; choose one of full, quick" in capsys.readouterr().err


def test_presets_load():
    quick = study.load_grid(study.resolve_preset("quick"))
    full = study.load_grid(study.resolve_preset("full"))
    assert {"post_ln", "pre_ln", "custom_ln", "batchnorm", "masked_batchnorm"} <= set(quick["variants"])
    assert len(quick["lr"]) >= 3 and len(quick["seeds"]) >= 2
    assert {"on", "off"} <= set(quick["variants"]["post_ln"]["warmup"])
    assert {"post_ln", "pre_ln", "custom_ln", "layernorm", "batchnorm", "masked_batchnorm", "powernorm", "rmsnorm",
            "dyt", "sandwich", "deepnorm"} <= set(full["variants"])
