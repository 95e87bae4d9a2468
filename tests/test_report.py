"""The study statistics (common/stats.py) against scipy and hand computations, and the report (common/
study_analysis.py, scripts/report.py) on a synthetic study whose every effect was planted (tests/study_records.py)."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import stats as sps

from common import stats, study_analysis as sa

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "tests"))

import report  # noqa: E402
import study_records  # noqa: E402


def test_paired_t_matches_scipy():
    d = [0.3, 0.1, 0.25, 0.4]
    est = stats.paired_t(d)
    ref = sps.ttest_1samp(d, 0.0, alternative="greater")
    assert est.p == pytest.approx(ref.pvalue) and est.mean == pytest.approx(np.mean(d))
    lo, hi = sps.t.interval(0.95, len(d) - 1, loc=np.mean(d), scale=sps.sem(d))
    assert (est.lo, est.hi) == (pytest.approx(lo), pytest.approx(hi))
    assert stats.paired_t(d, greater=False).p == pytest.approx(1 - ref.pvalue)


def test_paired_bootstrap_centres_on_the_planted_difference():
    rng = np.random.default_rng(0)
    a = (rng.random((3, 400)) < 0.8).astype(float)
    b = a.copy()
    assert stats.paired_bootstrap(a, b).fmt() == "+0.000 [+0.000, +0.000]"  # identical runs: no difference at all
    b[:, :40] = 1 - b[:, :40]  # flip 10% of b's answers: a - b has mean (#1->0 minus #0->1) / 400
    est = stats.paired_bootstrap(a, b)
    assert est.mean == pytest.approx((a - b).mean())
    assert est.lo < est.mean < est.hi


def test_fisher_and_holm_against_hand_numbers():
    # 6/6 failures vs 0/6: p = 1 / C(12, 6)
    assert stats.fisher_greater(6, 6, 0, 6) == pytest.approx(1 / math.comb(12, 6))
    assert stats.fisher_greater(0, 6, 0, 6) == pytest.approx(1.0)
    adjusted = stats.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": float("nan")})
    # sorted 0.01, 0.03, 0.04 -> 3*0.01, max(0.03, 2*0.03), max(0.06, 1*0.04)
    assert adjusted["a"] == pytest.approx(0.03) and adjusted["c"] == pytest.approx(0.06)
    assert adjusted["b"] == pytest.approx(0.06) and math.isnan(adjusted["d"])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("records")
    study_records.write(folder)
    return folder, sa.StudyData.load(folder)


def test_every_planted_effect_is_found(synthetic):
    _, data = synthetic
    v = {row["id"]: row for row in sa.verdicts(data)}
    assert v["P3"]["p"] == pytest.approx(1 / math.comb(12, 6)) and v["P3"]["outcome"] == "confirmed"
    assert v["P1"]["estimate"].mean == pytest.approx(math.log(2), rel=1e-3)  # pre-LN's last block has half the grad
    assert v["P2"]["estimate"].mean == pytest.approx(math.log(48 ** 0.5))
    assert v["P5"]["estimate"].mean == pytest.approx(-4 / 40)  # 30 -> 26 right out of 40
    assert sa.p5(data)["flips"] == 4 * 6  # 4 answers differ per model, 6 naive-BN models
    assert v["P6"]["estimate"].mean == pytest.approx(-2 / 40)
    assert v["P7"]["estimate"].mean == pytest.approx(math.log((8 * 3e-2 / 1e-3) / 2))
    assert {row["outcome"] for row in v.values()} == {"confirmed"}
    assert sa.aa_control(data)["floor"] == 0.0  # the A/A arm was planted identical to pre_ln


def test_lr_sensitivity_and_structural_checks(synthetic):
    _, data = synthetic
    # post-LN without warmup: ln 2 at two of three LRs (capped at the initial loss 0.7), 0.55 at the third
    assert sa.sensitivity_by_seed(data, "e2", "post_ln", "off") == {s: pytest.approx(2 * (math.log(2) - 0.55) / 3)
                                                                    for s in (0, 1, 2)}
    checks = sa.structural_checks(data)
    assert all(c["held"] for c in checks) and len(checks) == 7
    s = {row["what"]: row for row in sa.secondary(data)}
    assert s["naive BN stat drift (2nd half), random minus grouped batches"]["outcome"] == "confirmed"


def test_running_statistics_table_reads_the_planted_gaps(synthetic):
    _, data = synthetic
    rows = {(r["norm"], r["batches"]): r for r in sa.running_stats_table(data)}
    assert set(rows) == set(study_records.RUNNING_STATS)  # LN arms have no running statistics
    naive = rows[("batchnorm", "random")]
    assert naive["first_mean_gap"] == [0.6] * 3 and naive["first_log_var_ratio"] == [0.8] * 3
    assert naive["mean_gap"] == pytest.approx([0.5] * 3) and naive["log_var_ratio"] == pytest.approx([0.5] * 3)
    assert rows[("masked_batchnorm", "grouped")]["first_mean_gap"] == [0.0] * 3


def test_a_broken_structural_check_is_reported(synthetic, tmp_path):
    folder, _ = synthetic
    rows = [json.loads(x) for x in (folder / "runs.jsonl").read_text().splitlines()]
    for r in rows:
        if r["variant"] == "layernorm-random" and r["seed"] == 0:  # LN answers differently when padded more
            pred = r["scores"]["val/fixed/running"]["pred"]
            r["scores"]["val/fixed/running"]["pred"] = ("1" if pred[0] == "0" else "0") + pred[1:]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "labels.json").write_text((folder / "labels.json").read_text())
    checks = {c["check"]: c for c in sa.structural_checks(sa.StudyData.load(tmp_path))}
    assert checks["LN flips none, sorted vs fixed"] == {"check": "LN flips none, sorted vs fixed", "flips": 1,
                                                         "expected": 0, "held": False}


def test_report_regenerates_from_the_records_alone(synthetic, tmp_path):
    folder, _ = synthetic
    out = tmp_path / "docs"
    path = report.make_report(folder, out)
    text = path.read_text()
    for name in report.RECORD_FILES:
        assert (out / name).read_bytes() == (folder / name).read_bytes()  # the raw data travels with the report
    for png in ("e1_grad_norm", "e1_output_change", "e2_lr_sweep", "e3_batching", "e3_stat_drift", "e4_logit_max"):
        assert f"({png}.png)" in text
        with Image.open(out / f"{png}.png") as im:
            assert im.size[0] > 200
    assert "| P3 | E2 |" in text and "(6/6 vs 0/6)" in text and "commit `abc1234`" in text
    assert "| batchnorm | random | 0.600 (0.600, 0.600, 0.600) | 0.800 (0.800, 0.800, 0.800) |" in text
    assert report.make_report(out).read_text() == text  # the committed folder alone gives the same report


def test_report_run_reaches_wandb_offline(synthetic, tmp_path):
    """The report run, read back from its offline .wandb file: every run a table row, the verdicts, the LR sweep as
    a line series and the figures."""
    import wandb

    from common.wandb_records import offline_runs

    folder, data = synthetic
    report.make_report(folder, tmp_path, wandb_mode="offline")
    wandb.teardown()  # wandb finishes writing the .wandb file after finish() returns
    (run,) = offline_runs(tmp_path / "wandb")
    assert run.job_type == "report" and run.group == "st"
    assert len(run.table("study/runs")["data"]) == len(data.runs)
    verdicts = run.table("study/verdicts")
    assert [row[verdicts["columns"].index("id")] for row in verdicts["data"]][:7] == [f"P{i}" for i in range(1, 8)]
    assert run.charts()["study/lr_sweep/val_loss"] == "wandb/lineseries/v0"
    assert {"study/e2_lr_sweep", "study/e3_batching"} <= set(run.summary)


def test_report_cli_names_the_missing_records(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert "runs.jsonl not found: run `python scripts/score_runs.py" in capsys.readouterr().err
