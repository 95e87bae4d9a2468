"""Study v3's analysis and report on synthetic records with planted effects: the verdicts find what was planted,
call noise noise, refuse to judge an arm whose horizon was too short, and the report regenerates from the copied
records alone."""

import gzip
import json
import math
import shutil
import time
import zlib

import numpy as np
import pytest

from normlab.paths import REPO_ROOT
from normlab.study import report
from normlab.study.analysis import Records, aa_calibration, largest_lr_by_seed
from normlab.study.hypotheses import verdicts
from normlab.study.rerun import record_digest

LN2 = math.log(2)
STEPS = 320
PLACEMENT_LRS = [3.16e-3, 5.62e-3, 1e-2, 1.78e-2, 3.16e-2]
# planted: each arm's mean accuracy; dyt's slow start (never leaves the plateau on most seeds)
ACCURACY = {"ln_pre": 0.78, "ln_post": 0.78, "custom_ln": 0.78, "custom_ln_aa": 0.78, "rmsnorm": 0.78,
            "batchnorm": 0.73, "masked_batchnorm": 0.76, "powernorm": 0.76, "no_norm": 0.70, "dyt": 0.60}
# planted: the largest LR at which each placement arm learns
LARGEST = {("ln_post", "off"): 5.62e-3, ("ln_post", "on"): 1e-2, ("ln_pre", "off"): 1.78e-2, ("ln_pre", "on"): 1.78e-2,
           ("sandwich", "off"): 1.78e-2, ("deepnorm", "off"): 1e-2, ("ln_pre_qknorm", "off"): 1.78e-2}


def record(experiment, variant, lr, warmup, seed, learns=True, accuracy=0.78, exit_step=60, experiments=None):
    rng = np.random.default_rng(zlib.crc32(f"{variant} {lr} {warmup} {seed}".encode()))
    loss = [LN2] * STEPS if not learns else [LN2] * exit_step + [0.45] * (STEPS - exit_step)
    acc = accuracy + rng.normal(0, 0.01) if learns else 0.509
    val_loss = 0.45 + (0.78 - acc) if learns else LN2
    return {"experiment": experiment, "experiments": experiments or [experiment], "variant": variant, "lr": lr,
            "warmup": warmup, "seed": seed, "name": f"{variant}-lr{lr:g}-wu{warmup}-s{seed}", "status": "completed",
            "curves": {"step": list(range(1, STEPS + 1)), "loss": loss},
            "scores": {"val/sorted/running": {"accuracy": acc, "loss": val_loss, "pred": "01"},
                       "dev/sorted/running": {"accuracy": acc, "loss": val_loss, "pred": "01"}}}


def synthetic_records() -> list[dict]:
    runs = []
    for variant, acc in ACCURACY.items():
        exp = "aa" if variant == "custom_ln_aa" else "leaderboard"
        for seed in range(10):
            slow = variant == "dyt" and seed < 6
            runs.append(record(exp, variant, 3.16e-3, "on", seed, learns=not slow, accuracy=acc))
    for (variant, warmup), largest in LARGEST.items():
        exp = "placement" if variant in ("ln_post", "ln_pre") else "placement_more"
        for lr in PLACEMENT_LRS:
            for seed in range(10 if exp == "placement" else 5):
                runs.append(record(exp, variant, lr, warmup, seed, learns=lr <= largest * 1.001))
    for norm in ("ln_pre", "batchnorm", "masked_batchnorm", "powernorm"):
        for suffix in ("grouped", "b8"):
            for seed in range(5):
                runs.append(record("batching", f"{norm}-{suffix}", 3.16e-3, "on", seed, accuracy=ACCURACY[norm]))
    return runs


SELECTION = {f"tune/{v}/wuon": {"lr": 3.16e-3, "dev_loss": {"0.001": 0.5, "0.00316": 0.45}} for v in ACCURACY}


def test_verdicts_find_the_planted_effects_and_respect_the_horizon():
    rec = Records(synthetic_records(), SELECTION)
    aa = aa_calibration(rec)
    # the test is the t test only if it held 5% on the A/A control; otherwise the exact sign-flip test
    assert aa["fpr"][aa["test"]] <= 0.05 and aa["estimate"].lo < 0 < aa["estimate"].hi
    assert largest_lr_by_seed(rec, "ln_post", "off")[0] == pytest.approx(math.log10(5.62e-3))
    _, hyps = verdicts(rec)
    v = {h.id: h.verdict for h in hyps}
    assert v["P1"] == "confirmed" and v["P2"] == "confirmed" and v["P3"] == "confirmed"
    assert v["P4"] == "confirmed" and v["P5"] == "confirmed"
    assert v["P6"] == "horizon too short" and v["S1"] == "horizon too short"  # dyt never left the plateau on 6/10
    assert v["S2"] == "matches (within ±0.02)" and v["S3"] == "confirmed" and v["S4"] == "confirmed"
    assert v["S8a"] == "not separated"  # qk_norm planted equal to pre-LN
    assert v["S8c"] == "not separated"  # DeepNorm: 1e-2 vs post-LN's 5.62e-3 on 5 seeds, all ties -> p 0.0625


def test_refuted_is_a_result():
    runs = [r for r in synthetic_records() if r["variant"] != "batchnorm"]
    runs += [record("leaderboard", "batchnorm", 3.16e-3, "on", s, accuracy=0.83) for s in range(10)]
    v = {h.id: h.verdict for h in verdicts(Records(runs, SELECTION))[1]}
    assert v["P4"] == "refuted" and v["P5"] == "refuted"


def write_study(study, runs, commit="abc1234", selection=SELECTION):
    """A scored study directory as study.py leaves it: runs.jsonl, selection.json and study.json's provenance."""
    study.mkdir()
    (study / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    (study / "selection.json").write_text(json.dumps(selection))
    entries = {r["name"]: {"experiments": r["experiments"], "commit": commit, "machine": "test box",
                           "started_at": "2026-12-01T02:00:00"} for r in runs}
    calls = [{"command": "python scripts/study.py --preset quick", "commit": commit, "machine": "test box",
              "wall_s": 60.0, "cpu_s": 100.0}]
    (study / "study.json").write_text(json.dumps({"name": "quick", "runs": entries, "invocations": calls}))


def test_report_regenerates_from_the_copied_records_alone(tmp_path):
    study = tmp_path / "study"
    write_study(study, synthetic_records())
    out = tmp_path / "docs"
    first = report.make_report(study, out).read_text()
    assert {p.name for p in out.iterdir()} >= {"runs.jsonl.gz", "selection.json", "meta.json", "report.md",
                                               "answer.png", "curves.png", "sweep.png"}
    assert "| P4 |" in first and "**confirmed**" in first and "abc1234" in first and "horizon too short" in first
    loaded = report.load(out)
    assert all(r["commit"] == "abc1234" and "pred" not in r["scores"]["dev/sorted/running"] for r in loaded.runs)
    assert report.make_report(out).read_text() == first  # from the committed records alone, the same report
    assert report.make_report(study).read_text() == first  # in place, as study.py writes it


def test_a_study_continued_in_a_fresh_folder_joins_its_committed_records_without_overwriting_them(tmp_path, capsys):
    """Seeds 0-4 committed from one machine, seeds 5-9 trained later in a fresh study folder: reporting the fresh
    folder into the committed one keeps every committed record as it was and adds the new ones. A run finished in
    both with other measurements, or runs given other LRs, are refused in one line, and nothing is written."""
    from normlab.cli import report as report_cli

    runs = synthetic_records()

    def pending(r):
        return dict(r, status="pending", curves={}, scores={})

    write_study(tmp_path / "first", [r if r["seed"] < 5 else pending(r) for r in runs])
    out = tmp_path / "docs"
    report.make_report(tmp_path / "first", out)
    committed = report.read_records(out / report.RECORDS)
    write_study(tmp_path / "fresh", [r if r["seed"] >= 5 else pending(r) for r in runs], commit="def5678")
    report.make_report(tmp_path / "fresh", out)
    joined = report.read_records(out / report.RECORDS)
    assert [r["name"] for r in joined] == [r["name"] for r in runs] and all(r["status"] == "completed" for r in joined)
    assert all(r == c for r, c in zip(joined, committed) if r["seed"] < 5)  # as committed, provenance included
    assert {r["commit"] for r in joined if r["seed"] >= 5} == {"def5678"}
    assert [c["commit"] for c in json.loads((out / "meta.json").read_text())["invocations"]] == ["abc1234", "def5678"]
    before = (out / report.RECORDS).read_bytes()
    time.sleep(1.1)  # gzip would stamp another second into its header
    report.make_report(tmp_path / "fresh", out)
    assert (out / report.RECORDS).read_bytes() == before  # the same records, the same bytes: no diff to commit
    other = [dict(r, scores={"val/sorted/running": {"accuracy": 0.5, "loss": 0.7}}) if r["seed"] == 0 else pending(r)
             for r in runs]
    write_study(tmp_path / "other", other)
    assert report_cli.main([str(tmp_path / "other"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"run {other[0]['name']} is finished both" in err
    write_study(tmp_path / "relr", [pending(r) for r in runs], selection={**SELECTION, "x": {"lr": 1.0}})
    assert report_cli.main([str(tmp_path / "relr"), "--out", str(out)]) == 2
    assert "other LRs" in capsys.readouterr().err and (out / report.RECORDS).read_bytes() == before


def test_runs_that_never_ended_are_left_out_and_counted():
    runs = synthetic_records()
    stopped = [dict(r, status="interrupted", curves={}) for r in runs if r["experiment"] == "placement_more"]
    rec = Records([r for r in runs if r["experiment"] != "placement_more"] + stopped, SELECTION)
    assert len(rec.unfinished) == len(stopped) == 75 and not rec.arm("placement_more", "sandwich", "off")
    v = {h.id: h.verdict for h in verdicts(rec)[1]}
    assert v["S8a"] == "no data" and v["P1"] == "confirmed"
    assert "**Not trained** (the study was stopped before them, or they crashed): 75 runs, placement_more 75" \
        in report.write_markdown(rec, {})


def test_attention_logit_peaks_are_read_from_the_curves_and_the_reading_follows_the_numbers():
    assert report.peak_logit({"curves": {"attn_logit_max": [None, 3.0, 40.0, 7.5]}}) == 40.0
    assert report.peak_logit({"curves": {}}) is None
    calm = report.logit_reading({"learned": [500.0, 600.0], "never learned": [200.0, 300.0]})
    assert "no higher" in calm and "median 250 over 2 runs vs 550 over 2" in calm
    assert "peaked higher" in report.logit_reading({"learned": [10.0], "never learned": [900.0]})
    assert "no comparison" in report.logit_reading({"learned": [10.0], "never learned": []})


def test_a_record_digest_sees_every_measurement_but_not_the_dropped_dev_predictions():
    run = record("tune", "ln_pre", 1e-3, "on", 100)
    run["scores"]["dev/sorted/running"] = {"loss": 0.5, "accuracy": 0.8, "pred": "0101"}
    kept = json.loads(json.dumps(run))
    kept["scores"]["dev/sorted/running"].pop("pred")  # what the committed records keep of dev
    assert record_digest(run) == record_digest(kept)
    kept["curves"]["loss"][-1] += 1e-5
    assert record_digest(run) != record_digest(kept)


def test_report_py_writes_only_the_report_unless_asked_for_a_wandb_run(tmp_path, monkeypatch):
    """scripts/report.py on a folder of records (as docs/study-v3) adds nothing but report.md and its figures; with
    --wandb the offline report run goes to --wandb-dir, not into that folder."""
    from normlab.cli import report as report_py
    out = tmp_path / "docs"
    out.mkdir()
    with gzip.open(out / report.RECORDS, "wt") as f:  # committed records, as docs/study-v3 holds them
        f.write("".join(json.dumps(r) + "\n" for r in synthetic_records()))
    (out / "selection.json").write_text(json.dumps(SELECTION))
    before = {p.name for p in out.iterdir()}
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    assert report_py.main([str(out)]) == 0
    added = {p.name for p in out.iterdir()} - before
    assert added == {"report.md", "answer.png", "curves.png", "sweep.png"} and not (tmp_path / "wandb").exists()
    assert report_py.main([str(out), "--wandb", "--wandb-dir", str(tmp_path / "elsewhere")]) == 0
    assert {p.name for p in out.iterdir()} - before == added  # still nothing else in the report's folder
    assert list((tmp_path / "elsewhere" / "wandb").glob("offline-run-*"))


def test_the_committed_v3_report_regenerates_byte_identical_from_its_records(tmp_path):
    """docs/study-v3 keeps an older selection.json (per-LR tables keyed by the LR as text): read through
    read_selection, the report and the sweep figure drawn from those tables come out as committed."""
    committed = REPO_ROOT / "docs" / "study-v3"
    out = tmp_path / "v3"
    shutil.copytree(committed, out, ignore=shutil.ignore_patterns("report.md", "*.png"))
    report.make_report(out)
    for name in ("report.md", "sweep.png"):
        assert (out / name).read_bytes() == (committed / name).read_bytes(), name


def test_committed_v4_records_regenerate_their_report_in_another_folder(tmp_path):
    """report.py FOLDER --out ELSEWHERE on a folder of committed records (no study.json): the records are copied
    there and the report comes out as committed, the folder itself untouched."""
    committed = REPO_ROOT / "docs" / "study-v4" / "quick"
    before = {p.name: p.stat().st_mtime_ns for p in committed.iterdir()}
    report.make_report(committed, tmp_path / "out")
    for name in ("report.md", "answer.png", "meta.json", "selection.json"):
        assert (tmp_path / "out" / name).read_bytes() == (committed / name).read_bytes(), name
    assert {p.name: p.stat().st_mtime_ns for p in committed.iterdir()} == before


def test_the_reports_batch_statistics_arms_are_the_models_batch_statistics_norms():
    """The report names its BN-family arms without importing torch; they must be the norms the model says use
    batch statistics, run under the same names."""
    from model.norms import BATCH_STAT_NORMS
    from normlab.study.analysis import BATCH_STAT, BOARD

    assert set(BATCH_STAT) == set(BATCH_STAT_NORMS) and set(BATCH_STAT) <= set(BOARD)
