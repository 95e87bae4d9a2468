"""Study v5's factorial report on synthetic records with planted effects (normlab/study/report_v5.py)."""

import itertools

import pytest

from normlab.study import report_v5, rules
from normlab.study.analysis import Records
from test_study_v4 import synthetic_run

BEST, RUNNER = 0.00178, 0.001
FACTORS = {f"{b}_{f}_{e}": {"block": b, "final": f, "emb": e}
           for b, f, e in itertools.product(("ln", "mbn"), ("ln", "mbn"), ("off", "on"))}
DESIGN = {"factors": FACTORS, "reuse": None}


def planted_exit(levels: dict, seed: int) -> int:
    """100 steps, -50 for a masked-BN final norm in an LN block but only -20 in a masked-BN one (an interaction
    of +30), -10 for an embedding norm, plus a seed's own shift that every cell shares."""
    final = {"ln": -50, "mbn": -20}[levels["block"]] if levels["final"] == "mbn" else 0
    return 100 + final - (10 if levels["emb"] == "on" else 0) + 3 * seed


def planted_records(seeds=range(10), centre_exit=60) -> Records:
    runs = []
    for seed in seeds:
        for cell, levels in FACTORS.items():
            for lr in (BEST, RUNNER):
                acc = 0.75 + (0.01 if levels["final"] == "mbn" else 0) + 0.001 * seed
                runs.append(synthetic_run(cell, lr, seed, planted_exit(levels, seed), acc))
        for lr in (BEST, RUNNER):
            runs.append(synthetic_run("ln_ln_off_center", lr, seed, centre_exit + 3 * seed, 0.76))
    arms = [*FACTORS, "ln_ln_off_center"]
    selection = {f"tune/{a}/wuon": {"lr": BEST, "runner_up": RUNNER} for a in arms}
    return Records(runs, selection)


def design(rec):
    return report_v5.Design(rec, DESIGN, load=None)


def test_each_contrast_recovers_the_planted_effect():
    d = design(planted_records())
    table = {cell: float(planted_exit(levels, 0)) for cell, levels in FACTORS.items()}
    got = {" x ".join(c): report_v5.contrast(d, table, c) for c in report_v5.contrasts(d)}
    assert got == pytest.approx({"block": 15.0, "emb": -10.0, "final": -35.0, "block x emb": 0.0,
                                 "block x final": 30.0, "emb x final": 0.0, "block x emb x final": 0.0})


def test_the_report_confirms_the_planted_effects_at_both_ranks_and_leaves_the_rest_not_separated(tmp_path):
    d = design(planted_records())
    rows = {r["contrast"]: r for r in report_v5.contrast_rows(d, "exit")}
    assert report_v5.verdict(rows["final"], -1, 7) == "confirmed"
    assert report_v5.verdict(rows["block x final"], None, 7) == "separated (+)"
    # every seed's contrast is exactly 0 here: no pair differs, so the test could not decide anything
    assert report_v5.verdict(rows["emb x final"], None, 7).startswith(rules.UNDECIDED)
    centre = report_v5.center_row(d, "exit")
    assert centre["by_rank"][0][0].mean == pytest.approx(-40.0)
    assert report_v5.verdict(centre, -1, 1) == "confirmed"


def test_too_few_seeds_could_not_decide_and_the_horizon_rule_holds_back_accuracy(tmp_path):
    few = design(planted_records(seeds=range(4)))
    rows = {r["contrast"]: r for r in report_v5.contrast_rows(few, "exit")}
    assert report_v5.verdict(rows["final"], -1, 7) == f"{rules.UNDECIDED} (p >= 0.875)"  # 7 x 2^-3
    late = design(planted_records(centre_exit=300))
    assert report_v5.horizon_ok(late) == {0: True, 1: True}  # the centring arm is not a cell of the design
    text = report_v5.write_report(late.rec, {"name": "synthetic", "invocations": []}, DESIGN, None, [], tmp_path)
    assert "### plateau exit step" in text and "| final | < 0 |" in text and "**confirmed**" in text
    assert "| `ln_mbn_on` | block ln, final mbn, emb on | best |" in text
    assert (tmp_path / "answer.png").is_file()


def test_the_manipulation_check_averages_the_spread_over_seeds():
    rows = [{"variant": "a", "cosine": [1.0, 0.2]}, {"variant": "a", "cosine": [1.0, 0.4]},
            {"variant": "b", "cosine": [1.0, 1.0]}]
    assert report_v5.spread_by_arm(rows) == pytest.approx({"a": 0.7, "b": 0.0})


def test_a_reused_cell_is_checked_against_its_committed_runs_and_a_retrained_one_replaces_them():
    old = Records([synthetic_run("ln_pre", lr, seed, 120, 0.75) for lr in (BEST, RUNNER) for seed in range(3)],
                  {"tune/ln_pre/wuon": {"lr": BEST, "runner_up": RUNNER}})
    here = [synthetic_run("ln_ln_off", lr, seed, 110 if seed else 120, 0.76 if seed else 0.75,
                          experiment="ln_ln_off_here")
            for lr in (BEST, RUNNER) for seed in range(3)]
    here[0]["experiments"] = ["check"]  # seed 0 at the best LR: the check's run, trained before the retraining
    reuse = {"records": "elsewhere", "cells": {"ln_ln_off": "ln_pre"}}
    d = report_v5.Design(Records(here, {}), {"factors": FACTORS, "reuse": reuse}, load=lambda path: old)
    assert d.runs("ln_ln_off", 1) == old.arm("board", "ln_pre", lr=RUNNER)  # not retrained: the committed runs
    assert "reproduced exactly" in report_v5.check_lines(d)[0]  # seed 0 trained the same
    here[0]["curves"]["loss"][-1] += 1e-5
    retrained = report_v5.Design(Records(here, {}), {"factors": FACTORS, "reuse": {
        **reuse, "retrained": {"ln_ln_off": "ln_ln_off_here"}}}, load=lambda path: old)
    line = report_v5.check_lines(retrained)[0]
    assert "differs from the committed record" in line and "retrained here (`ln_ln_off_here`)" in line
    assert [r["seed"] for r in retrained.runs("ln_ln_off", 0)] == [0, 1, 2]
    assert all(r["experiment"] == "ln_ln_off_here" for r in retrained.runs("ln_ln_off", 1))
    assert retrained.committed_only().runs("ln_ln_off", 0) == old.arm("board", "ln_pre", lr=BEST)
