"""Study v4's machinery: arms trained at their best and runner-up LRs (a coin-flip tuning trains both and is
flagged), the v4 presets' designs checked against the rules, and provenance on every record."""

import json
from pathlib import Path

import pytest

from normlab_study import grid as grid_mod
from normlab_study import rules
from normlab_study import runner as study

TWO_LRS = """
name: two
share_runs: true
overrides: {train.max_steps: 5}
experiments:
  tune:
    variants: {a: {config: pre_ln}, b: {config: post_ln}}
    lr: [1.0e-3, 3.16e-3, 1.0e-2]
    warmup: {on: 2}
    seeds: [100, 101, 102, 103]
  board:
    variants: {a: {config: pre_ln}, b: {config: post_ln}}
    lr: {best_of: tune, ranks: 2}
    warmup: {on: 2}
    seeds: [0, 1]
score: {dev_rows: 10}
"""

# a coin flip for a: its two inner LRs differ by far less than its seeds do; b's choice is clear
DEV = {"a-lr0.001": [0.462, 0.468, 0.459, 0.470], "a-lr0.00316": [0.438, 0.483, 0.445, 0.475],
       "a-lr0.01": [0.55, 0.56, 0.54, 0.57], "b-lr0.001": [0.40, 0.41, 0.40, 0.41],
       "b-lr0.00316": [0.47, 0.48, 0.47, 0.48], "b-lr0.01": [0.69, 0.69, 0.69, 0.69]}


def fake_runner(cmd, log, env):
    out = Path(next(c.split("=", 1)[1] for c in cmd if c.startswith("output_dir=")))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"status": "completed"}))
    return 0


def test_a_coin_flip_tuning_trains_both_lrs_and_is_flagged(tmp_path, monkeypatch):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_LRS)
    g = study.load_grid(path)

    def dev_loss(run_dir, dev, bs):
        arm, seed = run_dir.name.rsplit("-wuon-s", 1)
        return DEV[arm][int(seed) - 100]

    monkeypatch.setattr("normlab_study.selection.dev_loss", dev_loss)
    monkeypatch.setattr("normlab_study.selection.score_sets", lambda cfg, rows: {"dev": ([], [])})
    monkeypatch.setattr("normlab_study.selection.read_yaml", lambda p: {})
    study.run_stages(g, path, tmp_path / "st", {}, [], "cmd", study.LocalEngine(runner=fake_runner))
    sel = json.loads((tmp_path / "st" / "selection.json").read_text())
    a, b = sel["tune/a/wuon"], sel["tune/b/wuon"]
    assert (a["lr"], a["runner_up"], a["near_tie"]) == (0.00316, 0.001, True)
    assert (b["lr"], b["runner_up"], b["near_tie"]) == (0.001, 0.00316, False)
    assert a["dev_loss_by_seed"]["0.001"] == DEV["a-lr0.001"]
    trained = json.loads((tmp_path / "st" / "study.json").read_text())["runs"]
    board = {n for n, r in trained.items() if "board" in r["experiments"]}
    assert board == {f"{arm}-lr{lr}-wuon-s{s}" for arm, lrs in (("a", ("0.00316", "0.001")), ("b", ("0.001", "0.00316")))
                     for lr in lrs for s in (0, 1)}
    # b's runner-up 3.16e-3 and best 1e-3 appear as the same names a's do: runs are shared by configuration only
    assert all(r["status"] == "completed" and r["commit"] and r["machine"] and r["started_at"]
               for r in trained.values())


def test_ranks_need_a_runner_up_and_are_checked(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_LRS)
    g = study.load_grid(path)
    assert g["experiments"]["board"]["ranks"] == 2
    old = {"tune/a/wuon": {"lr": 0.001}, "tune/b/wuon": {"lr": 0.001}}  # v3's selection.json: no runner-up
    with pytest.raises(grid_mod.StudyError, match="runner-up"):
        study.expand(g, old)
    path.write_text(TWO_LRS.replace("ranks: 2", "ranks: 3"))
    with pytest.raises(grid_mod.StudyError, match="ranks"):
        study.load_grid(path)
