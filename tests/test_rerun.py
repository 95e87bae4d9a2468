"""A retrained study compared run by run with the committed records it retrains (normlab/study/rerun.py, and
`scripts/report.py STUDY --rerun-of FOLDER`)."""

import gzip
import json
from pathlib import Path

import pytest

from normlab.cli.report import main as report_main
from normlab.study.report import RECORDS
from normlab.study.rerun import RERUN, record_digest, rerun_matches

REPO = Path(__file__).resolve().parents[1]


def record(name, acc):
    return {"name": name, "status": "completed", "curves": {"eval": [{"step": 32, "accuracy": acc}]},
            "scores": {"eval/acc": {"acc": acc, "pred": [1, 0]}, "dev/acc": {"loss": 0.5, "pred": [0, 1]}},
            "running_stats": None}


@pytest.fixture
def committed(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    with gzip.open(folder / RECORDS, "wt") as f:
        for r in (record("a-s0", 0.75), record("a-s1", 0.80)):
            f.write(json.dumps(r) + "\n")
    return folder


def retrained(tmp_path, records):
    study = tmp_path / "study"
    study.mkdir(exist_ok=True)
    (study / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = {r["name"]: {"experiments": ["board"], "commit": "abc1234", "machine": "test box",
                        "started_at": "2026-12-02T01:00:00+0000", "duration_s": 12.5, "log": "x"} for r in records}
    invocations = [{"command": "python scripts/study.py --preset p", "commit": "abc1234", "wall_s": 60.0}]
    (study / "study.json").write_text(json.dumps({"name": "p", "runs": runs, "invocations": invocations}))
    return study


def test_an_exact_retrain_matches_every_run_and_keeps_its_provenance(tmp_path, committed, capsys):
    before = (committed / RECORDS).read_bytes()
    study = retrained(tmp_path, [record("a-s0", 0.75), record("a-s1", 0.80)])
    assert report_main([str(study), "--rerun-of", str(committed)]) == 0
    assert "2 of 2 retrained runs reproduced their committed record exactly" in capsys.readouterr().out
    assert rerun_matches(committed) == (2, 2)
    with gzip.open(committed / RERUN / RECORDS, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert rows[0] == {"name": "a-s0", "experiments": ["board"], "commit": "abc1234", "machine": "test box",
                       "started_at": "2026-12-02T01:00:00+0000", "duration_s": 12.5, "status": "completed",
                       "record_sha256": record_digest(record("a-s0", 0.75))}
    assert json.loads((committed / RERUN / "meta.json").read_text())["invocations"][0]["wall_s"] == 60.0
    assert (committed / RECORDS).read_bytes() == before  # the committed records are never rewritten


def test_a_changed_measurement_is_named_and_fails(tmp_path, committed, capsys):
    changed = record("a-s1", 0.80)
    changed["curves"]["eval"][0]["accuracy"] = 0.8000001  # one value, in the last digits
    study = retrained(tmp_path, [record("a-s0", 0.75), changed, record("b-s0", 0.7)])
    assert report_main([str(study), "--rerun-of", str(committed)]) == 1
    out = capsys.readouterr().out
    assert "1 of 3 retrained runs reproduced" in out and "differ or not committed: a-s1, b-s0" in out


def test_a_run_that_differs_with_another_thread_count_says_so(tmp_path, committed, capsys):
    """Retrained with 2 CPU threads where the committed run had 1 (another --parallel), a run matches in its final
    scores but not in the last digits of its curves: the comparison names the thread count as the likely cause."""
    (committed / RECORDS).unlink()
    with gzip.open(committed / RECORDS, "wt") as f:
        f.writelines(json.dumps({**record(n, 0.75), "cpu_threads": 1}) + "\n" for n in ("a-s0", "a-s1"))
    two = {**record("a-s1", 0.75), "cpu_threads": 2}
    two["curves"]["eval"][0]["accuracy"] = 0.7500001
    assert report_main([str(retrained(tmp_path, [{**record("a-s0", 0.75), "cpu_threads": 1}, two])),
                        "--rerun-of", str(committed)]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 retrained runs reproduced" in out and "1 of the runs that differ trained with another CPU thread " \
        "count than their committed record" in out and "differ or not committed: a-s1" in out
    with gzip.open(committed / RERUN / RECORDS, "rt") as f:
        assert [json.loads(line)["cpu_threads"] for line in f] == [1, 2]


def test_a_rerun_that_evaluates_less_often_is_compared_at_its_evaluations(tmp_path, committed, capsys):
    # a preset changed to evaluate a run only at its end: the committed record at that evaluation must come back
    twice = record("a-s0", 0.75)
    twice["curves"]["eval"].append({"step": 64, "accuracy": 0.77})
    (committed / RECORDS).unlink()
    with gzip.open(committed / RECORDS, "wt") as f:
        f.write(json.dumps(twice) + "\n")
    once = record("a-s0", 0.75)
    once["curves"]["eval"] = [{"step": 64, "accuracy": 0.77}]
    assert report_main([str(retrained(tmp_path, [once])), "--rerun-of", str(committed)]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 retrained runs reproduced" in out and "1 of them evaluated at other steps" in out
    assert rerun_matches(committed) == (1, 1)
    once["curves"]["eval"][0]["accuracy"] = 0.7700001
    assert report_main([str(retrained(tmp_path, [once])), "--rerun-of", str(committed)]) == 1
    assert "differ or not committed: a-s0" in capsys.readouterr().out
    assert rerun_matches(committed) == (0, 1)


def test_an_unscored_study_is_one_line(tmp_path, committed, capsys):
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty"), "--rerun-of", str(committed)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs.jsonl not found" in err[0] and "score_runs.py" in err[0]


def test_study_v3s_committed_rerun_reproduced_every_record():
    # docs/study-v3/rerun.md's claim, read back from the committed records
    assert rerun_matches(REPO / "docs" / "study-v3") == (457, 457)
