"""selection.json's one reader: the text-keyed tables of the older files (docs/study-v3's, docs/study-v4's) and
the present `by_lr` rows read back to the same choice, with every LR a float, and the committed files are read,
never rewritten."""

import json

from normlab.paths import REPO_ROOT
from normlab.study.selection_file import read_selection

RUNS = {lr: [f"a-lr{lr}-wuon-s{s}" for s in (100, 101)] for lr in ("0.000562", "0.001")}
OLD = {"tune/a/wuon": {"lr": 0.001, "runner_up": 0.000562, "near_tie": False, "gap": 0.01, "seed_sd": None,
                       "dev_loss": {"0.001": 0.45, "0.000562": 0.46},  # in the order v3 happened to write them
                       "dev_loss_by_seed": {"0.001": [0.44, 0.46], "0.000562": [0.46, None]},
                       "runs": RUNS},
       "tune/b/wuon": {"lr": 0.001}}  # a choice without tables (a hand-written selection_from source)
NEW = {"tune/a/wuon": {"lr": 0.001, "runner_up": 0.000562, "near_tie": False, "gap": 0.01, "seed_sd": None,
                       "by_lr": [{"lr": 0.000562, "dev_loss": 0.46, "dev_loss_by_seed": [0.46, None],
                                  "runs": RUNS["0.000562"]},
                                 {"lr": 0.001, "dev_loss": 0.45, "dev_loss_by_seed": [0.44, 0.46],
                                  "runs": RUNS["0.001"]}]},
       "tune/b/wuon": {"lr": 0.001}}


def test_old_and_new_files_read_back_to_the_same_choice_with_float_lrs(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps(OLD))
    (tmp_path / "new.json").write_text(json.dumps(NEW))
    old, new = read_selection(tmp_path / "old.json"), read_selection(tmp_path / "new.json")
    assert old == new == NEW
    rows = old["tune/a/wuon"]["by_lr"]
    assert [r["lr"] for r in rows] == [5.62e-4, 1e-3] and all(type(r["lr"]) is float for r in rows)
    assert read_selection(tmp_path / "missing.json") == {}


def test_every_committed_selection_reads_as_rows_and_stays_as_committed():
    files = sorted((REPO_ROOT / "docs").rglob("selection.json"))
    assert len(files) >= 3  # docs/study-v3, docs/study-v4/quick, docs/study-v4/mlm (and long: the present format)
    for path in files:
        text = path.read_text()
        raw, read = json.loads(text), read_selection(path)
        assert set(read) == set(raw)
        for key, choice in read.items():
            if "by_lr" in raw[key]:  # written in the present format: read as written
                assert choice == raw[key] and [r["lr"] for r in choice["by_lr"]] == sorted(
                    float(r["lr"]) for r in choice["by_lr"])
                continue
            rows, table = choice["by_lr"], raw[key]["dev_loss"]
            assert [f"{r['lr']:g}" for r in rows] == sorted(table, key=float)  # every LR, sorted, as a float
            assert all(r["dev_loss"] == table[f"{r['lr']:g}"] and r["runs"] == raw[key]["runs"][f"{r['lr']:g}"]
                       for r in rows)
            assert choice["lr"] in [r["lr"] for r in rows] and "dev_loss" not in choice
        assert path.read_text() == text
