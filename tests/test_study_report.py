"""The report pipeline around the engine: a scored study's records copied with their provenance and spec snapshot,
regenerated from the copy alone; a study continued in a fresh folder joins its committed records without
overwriting them; only the report's files are written; and HEAD still reads every committed records folder, the
finished studies' included (their reports regenerate at the commit their meta.json names)."""

import gzip
import json
import time

import pytest

from normlab.paths import REPO_ROOT
from normlab.study import report
from normlab.study.records import RunRecord, read_records, record_digest
from normlab.study.selection_file import read_selection
from normlab.study.study_dir import StudyDir
from test_study_engine import SELECTION, SPEC, synthetic_run, synthetic_runs


def record(experiment, variant, lr, warmup, seed):
    return {**synthetic_run(variant, lr, seed, 60, 0.78, experiment), "warmup": warmup}


def synthetic_records() -> list[dict]:
    return synthetic_runs()


def write_study(study, runs, commit="abc1234", selection=SELECTION):
    """A scored study directory as study.py leaves it: runs.jsonl, selection.json and study.json's provenance."""
    study.mkdir()
    (study / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    (study / "selection.json").write_text(json.dumps(selection))
    entries = {r["name"]: {"experiments": r["experiments"], "commit": commit, "machine": "test box",
                           "started_at": "2026-12-01T02:00:00"} for r in runs}
    calls = [{"command": "python scripts/study.py --preset quick", "commit": commit, "machine": "test box",
              "wall_s": 60.0, "cpu_s": 100.0}]
    (study / "study.json").write_text(json.dumps({"name": "synthetic", "runs": entries, "invocations": calls}))
    (study / "spec.yaml").write_text(SPEC)  # the snapshot study.py keeps


def test_report_regenerates_from_the_copied_records_alone(tmp_path):
    study = tmp_path / "study"
    write_study(study, synthetic_records())
    out = tmp_path / "docs"
    first = report.make_report(study, out).read_text()
    assert {p.name for p in out.iterdir()} == {"runs.jsonl.gz", "selection.json", "meta.json", "spec.yaml",
                                               "report.md", "answer.png"}
    assert first.startswith("# synthetic: report") and "| H4 | claim |" in first and "abc1234 (" in first
    loaded = report.load(out)
    assert all(r.commit == "abc1234" for r in loaded.runs)
    assert report.make_report(out).read_text() == first  # from the copied records alone, the same report
    assert report.make_report(study).read_text() == first  # in place, as study.py writes it


def test_the_report_points_at_predictions_md_only_where_the_study_has_one(tmp_path):
    """A user's own study has no predictions.md: its report says where its predictions are (the spec); a committed
    study keeps its write-up beside its records folder, and the report points there."""
    write_study(tmp_path / "study", synthetic_records())
    mine = report.make_report(tmp_path / "study", tmp_path / "mine" / "records").read_text()
    assert "the predictions and their reasons: the spec's hypotheses (spec.yaml)." in mine
    (tmp_path / "mine" / "predictions.md").write_text("# why\n")
    written = report.make_report(tmp_path / "mine" / "records").read_text()
    assert "the predictions and their reasons: predictions.md beside the study." in written


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
    committed = read_records(out / report.RECORDS)
    write_study(tmp_path / "fresh", [r if r["seed"] >= 5 else pending(r) for r in runs], commit="def5678")
    report.make_report(tmp_path / "fresh", out)
    joined = read_records(out / report.RECORDS)
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


def test_a_record_digest_sees_every_measurement_but_not_the_dropped_dev_predictions():
    run = record("tune", "ln_pre", 1e-3, "on", 100)
    run["scores"]["val/sorted/running"]["pred"] = "01"
    run["scores"]["dev/sorted/running"] = {"loss": 0.5, "accuracy": 0.8, "pred": "0101"}
    kept = json.loads(json.dumps(run))
    kept["scores"]["dev/sorted/running"].pop("pred")  # what the committed records keep of dev
    assert record_digest(run) == record_digest(kept)
    kept["curves"]["loss"][-1] += 1e-5
    assert record_digest(run) != record_digest(kept)


def test_a_folder_that_does_not_exist_is_named_so(tmp_path, capsys):
    from normlab.cli import report as report_cli

    assert report_cli.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (f"report.py: error: {tmp_path / 'nope'}: no such folder; give a scored "
                                               f"study directory or a folder of records")
    assert not (tmp_path / "nope").exists()  # not created on the way


def test_report_py_writes_only_the_report_unless_asked_for_a_wandb_run(tmp_path, monkeypatch, capsys):
    """scripts/report.py on a folder of records adds nothing but report.md and its figures; with
    --wandb the offline report run goes to --wandb-dir, not into that folder, and the output says where and how to
    upload it."""
    from normlab.cli import report as report_py
    out = tmp_path / "docs"
    out.mkdir()
    with gzip.open(out / report.RECORDS, "wt") as f:  # a folder of records, as docs/ keeps them
        f.write("".join(json.dumps(r) + "\n" for r in synthetic_records()))
    (out / "selection.json").write_text(json.dumps(SELECTION))
    (out / "spec.yaml").write_text(SPEC)
    before = {p.name for p in out.iterdir()}
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    assert report_py.main([str(out)]) == 0
    added = {p.name for p in out.iterdir()} - before
    assert added == {"report.md", "answer.png"} and not (tmp_path / "wandb").exists()
    assert report_py.main([str(out), "--wandb", "--wandb-dir", str(tmp_path / "elsewhere")]) == 0
    assert {p.name for p in out.iterdir()} - before == added  # still nothing else in the report's folder
    (run,) = (tmp_path / "elsewhere" / "wandb").glob("offline-run-*")
    assert f"W&B: {run} (offline report run {run.name.split('-')[-1]})    upload: wandb sync {run}\n" in \
        capsys.readouterr().out


def test_records_carry_their_schema_version_and_a_newer_one_is_refused(tmp_path):
    from normlab.study.records import SCHEMA_VERSION, write_records

    write_study(tmp_path / "study", synthetic_records()[:4])
    report.copy_records(tmp_path / "study", tmp_path)
    assert [r["schema_version"] for r in read_records(tmp_path / report.RECORDS)] == [SCHEMA_VERSION] * 4
    write_records(tmp_path / "r.jsonl.gz", [{**synthetic_records()[0], "schema_version": SCHEMA_VERSION + 1}])
    with pytest.raises(report.RecordsError, match=f"schema_version {SCHEMA_VERSION + 1}; this code reads up to"):
        read_records(tmp_path / "r.jsonl.gz")
    with pytest.raises(report.RecordsError, match=f"schema_version {SCHEMA_VERSION + 1}; this code reads up to"):
        RunRecord.from_dict({"name": "a", "schema_version": SCHEMA_VERSION + 1})


def test_a_run_record_reads_its_fields_by_name_and_gives_its_row_back():
    row = synthetic_records()[0]
    record = RunRecord.from_dict(row)
    assert record.to_dict() == row and list(record.to_dict()) == list(row)  # the same row, in its key order
    assert (record.variant, record.seed, record.status) == (row["variant"], row["seed"], row["status"])
    assert record.score() == row["scores"]["val/sorted/running"]["accuracy"]
    assert record.score("loss", "dev/sorted/running") != record.score("loss", "dev/sorted/running")  # absent: NaN
    assert record.steps == row["curves"]["step"][-1]
    assert record.evals() == {e["step"]: e["accuracy"] for e in row["curves"]["eval"]}
    bare = RunRecord.from_dict({"name": "x", "experiment": "board", "status": "completed"})
    assert bare.experiments == ["board"] and bare.schema_version == 1 and bare.scores == {}


def test_a_study_whose_board_has_not_run_scores_nothing_yet(tmp_path):
    """Study docs's committed records cut to its LR sweep (as they were before its board trained): the report says
    what ran and that no prediction is scored yet, instead of a scorecard of "undecided" rows."""
    import shutil

    from normlab.study.records import RECORDS, write_records

    sweep = tmp_path / "sweep"
    shutil.copytree(REPO_ROOT / "docs" / "study-docs" / "records", sweep)
    meta = json.loads((sweep / "meta.json").read_text())  # unfrozen, as it was then: HEAD refuses a frozen study
    (sweep / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if not k.startswith("report_")}))
    write_records(sweep / RECORDS, [r for r in read_records(sweep / RECORDS) if r["experiment"] == "tune"])
    text = report.make_report(sweep, tmp_path / "out").read_text()
    assert "No arm has finished runs at a chosen LR yet" in text and "36 training runs" in text
    assert text.rstrip().endswith("No prediction is scored yet: the arms have not trained at their chosen LRs.")
    assert "## Scorecard" not in text and "undecided" not in text


COMMITTED = sorted(p.parent for p in (REPO_ROOT / "docs").glob("study-*/**/runs.jsonl*"))


def test_head_reads_every_committed_records_folder():
    """Every folder of committed records (the finished studies' and their reruns') is still read at HEAD: its
    records, its LR choice in the present format, and, for a finished study, the commit its report regenerates at."""
    assert len(COMMITTED) >= 10
    for folder in COMMITTED:
        path = folder / report.RECORDS
        rows = read_records(path) if path.is_file() else [json.loads(x) for x in (folder / "runs.jsonl").open()]
        assert rows and all(r["name"] and r["status"] for r in rows), folder
        records = [RunRecord.from_dict(r) for r in rows]  # typed: the old ones without schema_version are 1
        assert [r.to_dict() for r in records] == rows and {r.schema_version for r in records} == {1}, folder
        assert all(r.experiment in r.experiments for r in records if r.experiment), folder
        for choice in read_selection(folder / "selection.json").values():
            assert choice["lr"] > 0 and all("lr" in row for row in choice.get("by_lr", [])), folder


@pytest.mark.parametrize("folder,commit", [
    *((f, "bb37ee6") for f in ("study-v3", "study-v4/quick", "study-v4/long", "study-v4/mlm", "study-v4/p2",
                               "study-v5/factorial")),
    *((f"study-v6/{part}", "836df07") for part in ("ghost", "batch8", "mechanism")),
    ("study-docs/records", "20ffecf"), ("study-docs-long/records", "c449e59"), ("study-v6/ghost-pn", "7954c61"),
    ("study-v7/records", "8d567d1")])
def test_a_finished_study_names_the_commit_that_regenerates_its_report_and_head_refuses_it(folder, commit, tmp_path):
    where = folder
    folder = StudyDir(REPO_ROOT / "docs" / folder)
    assert folder.frozen_at() == commit and (folder / "report.md").is_file()
    with pytest.raises(report.StudyError, match=f"regenerates at commit {commit}") as err:
        report.make_report(folder.path, tmp_path)
    # python -m from the commit's worktree runs its own code; scripts/report.py there imports the installed checkout
    assert f"cd /tmp/at-{commit} && python -m normlab.cli.report docs/{where} --out" in str(err.value)


def test_the_answer_figure_marks_its_own_datas_majority_class(tmp_path, monkeypatch):
    """The dotted line in answer.png is always answering the eval split's most common class, from the gold labels
    scoring wrote (0.594 on the documents' eval split, not SST-2's 0.509); without labels there is no line."""
    from normlab.study import plots

    drawn, plot_board = [], plots.plot_board
    monkeypatch.setattr(plots, "plot_board", lambda *args: drawn.append(plot_board(*args)) or drawn[-1])
    study = tmp_path / "study"
    write_study(study, synthetic_records())
    report.make_report(study)
    (study / "labels.json").write_text(json.dumps({"dev": "0101", "val": "1101100111"}))
    report.make_report(study)
    marked = [[ln.get_ydata()[0] for ax in fig.axes for ln in ax.get_lines()
               if ln.get_label() == "always the majority class"] for fig in drawn]
    assert marked == [[], [0.7]]
    assert StudyDir(REPO_ROOT / "docs/study-docs/records").majority_share() == pytest.approx(1180 / 1987)
    assert StudyDir(REPO_ROOT / "docs/study-v3").majority_share() == pytest.approx(444 / 872)


def test_sweep_and_answer_figures_draw_an_arm_alike_and_no_best_lr_star_hides_another(tmp_path, monkeypatch):
    """sweep.png and answer.png give each arm one colour; the stars of arms that chose the same LR (here all four,
    at one dev loss) stand side by side; the LRs are written as every figure writes them; and the arms table's
    plateau-exit window is said at the study's own batch size (16 here)."""
    from normlab.study import plots

    figs = {}
    for name in ("plot_board", "plot_sweep"):
        monkeypatch.setattr(plots, name, lambda *args, f=getattr(plots, name), n=name: figs.setdefault(n, f(*args)))
    selection = {k: {**v, "by_lr": [{"lr": lr, "dev_loss": 0.45 if lr == v["lr"] else 0.5} for lr in (1e-3, 3.16e-3)]}
                 for k, v in SELECTION.items()}
    write_study(tmp_path / "study", [{**r, "examples_per_step": 16} for r in synthetic_records()], selection=selection)
    assert "a moving mean over 640 examples (40 steps of 16)," in report.make_report(tmp_path / "study").read_text()
    answer = {line.get_label(): line.get_color() for line in figs["plot_board"].axes[1].get_lines()}
    sweep = figs["plot_sweep"].axes[0]
    curves = [line for line in sweep.get_lines() if line.get_marker() == "o"]
    assert {line.get_label(): line.get_color() for line in curves} == answer and len(answer) == 4
    stars = [line for line in sweep.get_lines() if line.get_marker() == "*"]
    at = {tuple(s.get_transform().transform((s.get_xdata()[0], s.get_ydata()[0])).round(1)) for s in stars}
    assert len(stars) == len(at) == 4
    assert [t.get_text() for t in sweep.get_xticklabels()] == ["1e-3", "3.2e-3"]


def test_the_sweep_figure_tells_an_arms_sweep_without_warmup_from_its_sweep_with_it():
    """An arm swept with and without warmup: two curves in the arm's colour, the one without warmup dashed and
    labelled so (before, both were drawn and labelled alike)."""
    from normlab.study import plots

    by_lr = [{"lr": lr, "dev_loss": loss} for lr, loss in ((1e-3, 0.5), (3.16e-3, 0.45))]
    selection = {f"tune/ln/wu{w}": {"lr": 3.16e-3, "by_lr": by_lr} for w in ("on", "off")}
    ax = plots.plot_sweep(selection, "sweep", plots.arm_colours(["ln"])).axes[0]
    curves = {line.get_label(): line for line in ax.get_lines() if line.get_marker() == "o"}
    assert set(curves) == {"ln", "ln (no warmup)"}
    assert curves["ln"].get_color() == curves["ln (no warmup)"].get_color()
    assert (curves["ln"].get_linestyle(), curves["ln (no warmup)"].get_linestyle()) == ("-", "--")


def test_freezing_a_finished_study_checks_its_report_regenerates_byte_for_byte(tmp_path, monkeypatch, capsys):
    """report.py --freeze names this commit in meta.json only where the committed report.md and figures come out of
    it byte-identical; a difference, uncommitted code or an already frozen study is refused in one line, and nothing
    is written. Frozen, the folder is refused by report.py, naming the commit."""
    from normlab.cli import report as report_cli
    from normlab.study import freeze

    study = tmp_path / "study"
    write_study(study, synthetic_records())
    out = tmp_path / "records"
    report.make_report(study, out)
    meta = (out / "meta.json").read_text()
    monkeypatch.setattr(freeze, "git_commit", lambda: "abc1234+dirty")
    assert report_cli.main([str(out), "--freeze"]) == 2
    assert "commit the code and the records first" in capsys.readouterr().err
    monkeypatch.setattr(freeze, "git_commit", lambda: "abc1234")
    (out / "report.md").write_text((out / "report.md").read_text() + "edited by hand\n")
    assert report_cli.main([str(out), "--freeze"]) == 2
    err = capsys.readouterr().err
    assert "report.md differ from what this commit regenerates" in err and len(err.strip().splitlines()) == 1
    assert (out / "meta.json").read_text() == meta
    report.make_report(out)
    assert report_cli.main([str(out), "--freeze"]) == 0 and "frozen at abc1234" in capsys.readouterr().out
    frozen = json.loads((out / "meta.json").read_text())
    assert frozen["report_commit"] == "abc1234" and frozen["invocations"] == json.loads(meta)["invocations"]
    assert frozen["report_command"].startswith("git worktree add /tmp/at-abc1234 abc1234 && cd /tmp/at-abc1234 && ")
    with pytest.raises(report.StudyError, match="regenerates at commit abc1234"):
        report.make_report(out)
    assert report_cli.main([str(out), "--freeze"]) == 2 and "abc1234" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report_cli.main([str(out), "--freeze", "--out", str(tmp_path / "x")])


def test_freezing_needs_the_records_committed_and_a_folder_git_ignores_is_not(tmp_path, monkeypatch):
    """A study under studies/ (ignored) would be frozen with a regenerate command whose worktree lacks it."""
    import subprocess

    from normlab.study import freeze, study_dir

    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / ".gitignore").write_text("studies/\n__pycache__/\n")
    (repo / "docs" / "meta.json").write_text("{}")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    monkeypatch.setattr(freeze, "REPO_ROOT", repo)
    monkeypatch.setattr(study_dir, "REPO_ROOT", repo)  # where git runs
    (repo / "studies" / "mine").mkdir(parents=True)
    (repo / "studies" / "mine" / "meta.json").write_text("{}")
    assert freeze.unchanged_in_git(repo / "docs") and freeze.unchanged_in_git(tmp_path / "outside")
    assert not freeze.unchanged_in_git(repo / "studies" / "mine")
    (repo / "docs" / "__pycache__").mkdir()  # left by an older NormLab's hook loading: bytecode, not records
    (repo / "docs" / "__pycache__" / "hooks.cpython-311.pyc").write_bytes(b"")
    assert freeze.unchanged_in_git(repo / "docs")
    (repo / "docs" / "meta.json").write_text('{"edited": true}')
    assert not freeze.unchanged_in_git(repo / "docs")


def test_the_answer_figure_puts_arms_of_different_batch_sizes_on_one_axis_of_examples():
    """An arm at batch 8 evaluates at 4x the steps of one at 32 over the same data: the accuracy curves are drawn
    against the examples seen, so both end at the same place; arms of one batch size keep the optimizer step."""
    from normlab.study import plots
    from normlab.study.records import RunRecord

    def runs(batch, steps):
        evals = [{"step": s, "accuracy": 0.5 + s / (10 * steps[-1])} for s in steps]
        return ([RunRecord(status="completed", scores={"val/sorted/running": {"accuracy": 0.6}},
                           curves={"eval": evals}, extra={"examples_per_step": batch})],)

    board = {"b32": runs(32, [64, 128]), "b8": runs(8, [256, 512])}
    right = plots.plot_board(board, "t", plots.arm_colours(list(board))).axes[1]
    assert {ln.get_label(): list(ln.get_xdata()) for ln in right.get_lines()} == {"b32": [2048, 4096],
                                                                                 "b8": [2048, 4096]}
    assert right.get_xlabel() == "training examples seen"
    same = plots.plot_board({"a": runs(32, [64, 128]), "b": runs(32, [64, 128])}, "t", plots.arm_colours(["a", "b"]))
    assert [list(ln.get_xdata()) for ln in same.axes[1].get_lines()] == [[64, 128]] * 2
    assert same.axes[1].get_xlabel() == "optimizer step"
