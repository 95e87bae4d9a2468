"""What reaches Weights & Biases, read back from the offline runs' .wandb files (normlab.tracking.wandb_records, wandb's
own protobuf classes): a training run's x-axis, tags and group, per-layer depth charts against metrics.jsonl, the
summary, the model and checkpoint artifacts (and evaluate.py loading the model back from them), evaluate.py --wandb's
confusion matrix and predictions table, a resumed run continuing its W&B run (and a completed one left alone), a
diverged run, the study report run, and the other trackers."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from normlab.cli import evaluate
from normlab.tracking.wandb_records import OfflineRun, RecordsError, read_records
from train_utils import REPO, rows, run_argv, run_here, summary

LAYER_CHARTS = ("grad_norm", "act_rms", "attn_logit_max", "update_ratio")
VALIDATION = REPO.parent / "shared" / "datasets" / "sst2" / "validation.parquet"


def offline_runs(wandb_dir) -> list[OfflineRun]:
    """The offline runs of this process, complete: wandb's core process writes the end of a run's file after
    run.finish() returns; shutting it down (it restarts at the next wandb.init) flushes and closes the files."""
    import wandb

    from normlab.tracking import wandb_records

    wandb.teardown()
    runs = wandb_records.offline_runs(wandb_dir)
    assert all(run.exited for run in runs)
    return runs


@pytest.fixture(autouse=True, scope="module")
def offline_without_a_key():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.delenv("WANDB_API_KEY", raising=False)
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory, wandb_home):
    """A tiny pre_ln run (6 steps, evaluations and checkpoints at 3 and 6) logged offline with checkpoints."""
    out = tmp_path_factory.mktemp("wandb") / "run"
    assert run_here(out, "--config", "pre_ln", "wandb.mode=offline", "train.max_steps=6", "train.eval_steps=3",
                    "train.save_steps=3", "wandb.log_checkpoints=true", "wandb.tags=smoke") == 0
    (run,) = offline_runs(out / "wandb")
    return out, run


def test_training_run_is_grouped_tagged_and_plotted_against_the_optimizer_step(trained):
    out, run = trained
    assert run.exited and run.id == summary(out)["wandb_run_id"]
    assert (run.group, run.job_type, run.project, run.name) == ("layernorm-pre", "train", "normlab", "run")
    assert {"layernorm", "pre", "pre_ln", "lr=0.002", "warmup=4", "seed=42", "smoke"} <= set(run.tags)
    assert run.config["train.lr"] == 0.002 and run.config["model.norm"] == "layernorm"
    assert {"name": "*", "step_metric": "step"} in run.metrics  # every panel's x-axis is the optimizer step
    logged = [h for h in run.history if "train/loss" in h]
    assert [h["step"] for h in logged] == [h["_step"] for h in logged] == list(range(1, 7))
    assert [h["step"] for h in run.history if "eval/accuracy" in h] == [3, 6]
    # the same names and values as metrics.jsonl
    for row, h in zip([r for r in rows(out) if "train/loss" in r], logged):
        assert {k: h[k] for k in row} == pytest.approx(row)


def test_wandbs_environment_variables_reach_the_run_unless_the_config_sets_them(tmp_path, monkeypatch):
    """WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP and WANDB_TAGS, as wandb.init reads them: here the config sets
    only the group, which wins; the tags join the automatic ones. The offline run's record holds what wandb got."""
    for var, value in {"WANDB_PROJECT": "their-project", "WANDB_ENTITY": "their-team",
                       "WANDB_RUN_GROUP": "their-group", "WANDB_TAGS": "night,ablation"}.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "run"
    assert run_here(out, "wandb.mode=offline", "wandb.group=mine", "wandb.log_model=false", "train.max_steps=2",
                    "train.kernels=reference") == 0
    (run,) = offline_runs(out / "wandb")
    assert (run.project, run.entity, run.group) == ("their-project", "their-team", "mine")
    assert {"night", "ablation", "custom_layernorm", "pre", "warmup=4", "seed=42"} <= set(run.tags)
    assert run.config["wandb.project"] == "their-project"  # config.yaml too: a resume keeps the same W&B run


def test_depth_charts_hold_every_layer_as_a_line(trained):
    out, run = trained
    charts = run.charts()
    for quantity in LAYER_CHARTS:
        assert charts[f"depth/{quantity}"] == "wandb/lineseries/v0"
        table = run.table(f"depth/{quantity}")  # the last one drawn: at the final evaluation, all 6 steps
        assert table["columns"] == ["step", "lineKey", "lineVal"]
        expected = [[r["step"], f"layer {i}", r[f"layers/{i}/{quantity}"]]
                    for i in range(2) for r in rows(out) if f"layers/{i}/{quantity}" in r]
        assert len(expected) == 12 and table["data"] == expected  # drawn from metrics.jsonl: the same floats
    assert not any(key.startswith("depth/stat_drift") for key in charts)  # no BN in this model


def test_summary_holds_status_results_and_spikes(trained):
    out, run = trained
    s = summary(out)
    assert run.summary["status"] == "completed" and run.summary["loss_spikes"] == s["loss_spikes"] == 0
    assert run.summary["final/eval/accuracy"] == s["final"]["eval/accuracy"]
    assert run.summary["best/eval/accuracy"] == s["best"]["eval/accuracy"]
    assert run.summary["best/step"] == s["best"]["step"]
    assert run.summary["model_artifact"] == f"model-{run.id}:final"


def test_final_and_checkpoints_are_artifacts(trained, wandb_home):
    out, run = trained
    model = [a for a in run.artifacts if a["type"] == "model"]
    assert len(model) == 1 and model[0]["name"] == f"model-{run.id}"
    assert {"final", "step_6"} <= set(model[0]["aliases"])
    assert set(model[0]["files"]) == {p.name for p in (out / "final").iterdir()}
    staged = Path(model[0]["files"]["model.safetensors"])  # copied for a later `wandb sync`...
    assert staged.is_relative_to(out.resolve() / "wandb" / "data")  # ...inside the run directory
    assert not any((wandb_home / "data").rglob("*.safetensors"))  # nothing in the user's staging area
    assert staged.read_bytes() == (out / "final" / "model.safetensors").read_bytes()
    assert model[0]["metadata"]["final"]["eval/accuracy"] == summary(out)["final"]["eval/accuracy"]
    checkpoints = [a for a in run.artifacts if a["type"] == "checkpoint"]
    assert [a["name"] for a in checkpoints] == [f"checkpoint-{run.id}"] * 2
    assert [a["metadata"]["step"] for a in checkpoints] == [3, 6]
    assert "trainer_state.json" in checkpoints[0]["files"] and "optimizer.bin" in checkpoints[0]["files"]


def download_from_records(artifact: dict, root: Path) -> Path:
    """What `artifact.download()` gives once the offline run is synced: its files under their artifact paths."""
    for rel, staged in artifact["files"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(staged, root / rel)
    return root


def test_model_artifact_loads_back_with_evaluate(trained, tmp_path, monkeypatch, capsys):
    out, run = trained
    (model,) = [a for a in run.artifacts if a["type"] == "model"]
    downloaded = download_from_records(model, tmp_path / "artifact")
    fetched = []

    class Artifact:
        def __init__(self, ref):
            self.qualified_name = ref

        def download(self):
            return str(downloaded)

    class Api:  # stands in for the network: the artifact's files are the ones the offline run recorded
        def artifact(self, ref, type=None):
            fetched.append((ref, type))
            return Artifact(ref)

    import wandb

    monkeypatch.setattr(wandb, "Api", Api)
    assert evaluate.main([f"wandb:normlab/model-{run.id}:final", "--json"]) == 0
    from_artifact = json.loads(capsys.readouterr().out)
    assert fetched == [(f"normlab/model-{run.id}:final", "model")]
    assert from_artifact["artifact"] == f"normlab/model-{run.id}:final"
    assert evaluate.main([str(out), "--json"]) == 0
    from_run = json.loads(capsys.readouterr().out)
    # the artifact alone (its normlab_run.yaml carries the dataset config) gives the run's own evaluation
    assert from_artifact["num_examples"] == from_run["num_examples"] == len(pd.read_parquet(VALIDATION))
    for key in ("accuracy", "loss", "confusion_matrix"):
        assert from_artifact[key] == from_run[key]


def test_artifact_fetch_without_a_key_is_one_line(capsys):
    assert evaluate.main(["wandb:normlab/model-x:final"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not fetch the wandb artifact 'normlab/model-x:final'" in err


def test_evaluate_logs_confusion_matrix_and_predictions(trained, capsys):
    out, train_run = trained
    assert evaluate.main([str(out), "--wandb", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (run,) = [r for r in offline_runs(out / "wandb") if r.id == result["wandb"]["id"]]
    assert str(run.directory) == result["wandb"]["dir"]  # next to the training run, synced with it
    assert (run.job_type, run.group, run.name) == ("eval", train_run.group, "run-eval")
    assert run.config["train_run_id"] == train_run.id
    assert run.summary["eval/accuracy"] == result["accuracy"]
    assert run.charts()["eval/confusion_matrix"] == "wandb/confusion_matrix/v1"
    counts = {(a, p): n for a, p, n in run.table("eval/confusion_matrix")["data"]}
    names = result["labels"]
    assert counts == {(names[t], names[p]): result["confusion_matrix"][t][p] for t in range(2) for p in range(2)}
    table = run.table("eval/predictions")
    assert table["columns"] == ["sentence", "label", "prediction", "confidence", "correct", "loss"]
    truth = pd.read_parquet(VALIDATION)
    assert [r[0] for r in table["data"]] == truth["sentence"].tolist()  # every example, in the data's order
    assert [r[1] for r in table["data"]] == [names[y] for y in truth["label"]]
    assert all(r[4] == (r[1] == r[2]) and 0.5 <= r[3] <= 1 for r in table["data"])
    assert sum(r[4] for r in table["data"]) / len(table["data"]) == pytest.approx(result["accuracy"])


def test_evaluate_says_where_its_wandb_run_went(trained, capsys):
    """Without --json the tables end with the eval run's folder and the command that uploads it (before, nothing
    said a W&B run was made)."""
    out, _ = trained
    assert evaluate.main([str(out), "--text", "a gorgeous film", "--wandb"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    (run,) = [r for r in offline_runs(out / "wandb") if r.job_type == "eval" and f" {r.id})" in last]
    assert last == f"W&B: {run.directory} (offline eval run {run.id})    upload: wandb sync {run.directory}"


def _files(out) -> dict:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*") if p.is_file()}


def test_a_resumed_run_continues_its_wandb_run_from_the_run_directory_alone(trained, tmp_path, capsys):
    """`output_dir=X train.resume=auto` and a larger train.max_steps: the run's variant (pre_ln) and overrides come
    back from the run directory, the change is stated in one note, and the W&B run goes on under the same id in a
    second offline folder, which one `wandb sync` of X/wandb uploads after the first."""
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    capsys.readouterr()
    assert run_argv(f"output_dir={out}", "train.resume=auto", "train.max_steps=8") == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: resuming {out} with its saved config, changing train.max_steps=8 (was 6)"]
    assert f"W&B:    {out / 'wandb'} (offline run {summary(out)['wandb_run_id']}, 2 parts" in captured.out
    assert f"wandb sync {out / 'wandb'}" in captured.out
    run_id = summary(out)["wandb_run_id"]
    assert run_id == json.loads((out / "run.json").read_text())["wandb_run_id"]
    first, second = [run for run in offline_runs(out / "wandb") if run.job_type == "train"]  # not evaluate.py's
    assert first.id == second.id == run_id
    assert first.resume and second.resume
    assert "pre_ln" in second.tags and second.config["model.norm_placement"] == "pre"  # the variant restored
    steps = [[h["step"] for h in run.history if "train/loss" in h] for run in (first, second)]
    assert steps == [[1, 2, 3, 4, 5, 6], [7, 8]]
    assert [h["train/loss"] for h in second.history if "train/loss" in h] == [
        r["train/loss"] for r in rows(out) if "train/loss" in r and r["step"] > 6]
    assert second.summary["status"] == "completed" and second.summary["step"] == 8


def test_resuming_a_completed_run_without_more_steps_changes_nothing(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    before = _files(out)
    capsys.readouterr()
    # the run's own --config is accepted; no new step to train
    assert run_argv(f"output_dir={out}", "--config", "pre_ln", "train.resume=auto") == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines() == [
        f"{out}: the run is complete (6 of 6 steps); nothing to do (to train it further, add a larger "
        f"train.max_steps or train.epochs)"]
    assert _files(out) == before  # final/, summary.json, config.yaml, the W&B folder: untouched, none added


def test_a_run_stopped_before_its_first_checkpoint_starts_over_as_a_new_wandb_run(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    for folder in ("checkpoints", "final"):  # as if it had stopped at step 2, before its first save
        shutil.rmtree(out / folder)
    old_id = summary(out)["wandb_run_id"]
    (out / "summary.json").write_text(json.dumps({"status": "interrupted", "step": 2, "wandb_run_id": old_id}))
    capsys.readouterr()
    assert run_argv(f"output_dir={out}", "train.resume=auto") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: no checkpoint")]
    new_id = summary(out)["wandb_run_id"]
    assert new_id != old_id and summary(out)["status"] == "completed" and summary(out)["step"] == 6
    assert notes == [f"note: no checkpoint in {out} yet: the run starts again from step 0 (the earlier attempt "
                     f"stopped at step 2) and writes its metrics.jsonl anew; it is a new W&B run: the earlier "
                     f"attempt's, {old_id}, stays in {out / 'wandb'}"]
    assert [r["step"] for r in rows(out) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert {run.id for run in offline_runs(out / "wandb")} >= {old_id, new_id}


@pytest.mark.parametrize("argv,words", [
    (["train.lr=1e-4"], ["error: train.lr=0.0001 cannot change when resuming", "train.lr=0.002",
                         "train.max_steps, train.epochs"]),
    (["--config", "post_ln"], ["error: --config post_ln differs from the run's own (--config configs/pre_ln.yaml",
                               "train.resume=auto"]),
])
def test_a_resume_refuses_what_would_change_the_run(trained, argv, words, capsys):
    out = trained[0]
    before = _files(out)
    capsys.readouterr()
    assert run_argv(f"output_dir={out}", "train.resume=auto", *argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    for word in words:
        assert word in err, (word, err)
    assert _files(out) == before


def test_diverged_run_has_its_status_and_depth_charts_but_no_model(tmp_path):
    out = tmp_path / "run"
    assert run_here(out, "wandb.mode=offline", "train.lr=1e30", "train.warmup_steps=0", "train.max_steps=20") == 0
    (run,) = offline_runs(out / "wandb")
    assert run.summary["status"] == summary(out)["status"] == "diverged"
    # drawn at the end (no final evaluation); a non-finite value (the blown-up update) is left out of its line
    first = rows(out)[0]
    assert {f"depth/{q}" for q in LAYER_CHARTS if first[f"layers/0/{q}"] is not None} == set(run.charts())
    assert run.table("depth/grad_norm")["data"] == [[1, f"layer {i}", first[f"layers/{i}/grad_norm"]] for i in range(2)]
    assert not [a for a in run.artifacts if a["type"] == "model"]


@pytest.mark.parametrize("report_to", ["tensorboard", "none"])
def test_other_trackers_still_work(tmp_path, report_to):
    out = tmp_path / "run"
    assert run_here(out, "wandb.mode=offline", f"wandb.report_to={report_to}", "train.max_steps=2",
                    "train.eval_steps=100") == 0
    assert summary(out)["status"] == "completed" and summary(out)["wandb_run_id"] is None
    assert not (out / "wandb").exists()
    events = list(out.rglob("events.out.tfevents.*"))
    assert bool(events) == (report_to == "tensorboard")


def test_log_study_offline(tmp_path):
    from PIL import Image

    from normlab.tracking.wandb_report import log_study

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    runs = [{"run": "a-s0", "lr": 1e-3, "acc": 0.7, "wandb_run_id": "r0"},
            {"run": "a-s1", "lr": 1e-3, "acc": float("nan"), "wandb_run_id": None, "note": "crashed"}]
    sweeps = {"acc": {"xs": [-3, -2], "ys": {"a": [0.7, None], "b": [0.6, 0.65]}, "title": "acc", "xname": "lr"}}
    info = log_study(tmp_path, "st", runs, sweeps, [{"variant": "a", "verdict": "ok"}],
                     {"fig": tmp_path / "a.png", "fig2": (tmp_path / "a.png", "caption")}, "offline", "proj")
    (run,) = offline_runs(tmp_path / "wandb")
    assert str(run.directory) == info["dir"]
    assert (run.group, run.job_type, run.project, run.name) == ("st", "report", "proj", "st-report")
    assert run.config["runs"] == ["r0"] and run.config["num_runs"] == 2
    assert run.table("study/runs") == {"columns": ["run", "lr", "acc", "wandb_run_id", "note"], "data": [
        ["a-s0", 1e-3, 0.7, "r0", None], ["a-s1", 1e-3, None, None, "crashed"]]}
    assert run.table("study/verdicts")["data"] == [["a", "ok"]]
    assert run.table("study/acc")["data"] == [[-3, "a", 0.7], [-3, "b", 0.6], [-2, "b", 0.65]]  # no gap point
    assert run.summary["study/fig2"]["caption"] == "caption"
    assert log_study(tmp_path / "off", "st", runs, {}, [], {}, "disabled") is None
    assert not (tmp_path / "off").exists()


def test_records_reader_checks_the_format(trained, tmp_path):
    _, run = trained
    (path,) = run.directory.glob("*.wandb")
    assert path.stat().st_size > 32 * 1024  # records span LevelDB blocks: the reader joins split chunks
    complete = list(read_records(path))
    torn = tmp_path / "torn.wandb"
    torn.write_bytes(path.read_bytes()[: path.stat().st_size - 10])  # a writer killed mid-record
    assert 0 < len(list(read_records(torn))) < len(complete)
    (tmp_path / "x.wandb").write_bytes(b"not a wandb file")
    with pytest.raises(RecordsError, match="not a wandb transaction log"):
        list(read_records(tmp_path / "x.wandb"))


def test_wandb_charts_draws_the_logged_depth_charts(trained, tmp_path, capsys, monkeypatch):
    from PIL import Image

    from normlab.cli import wandb_charts

    out, run = trained
    png = tmp_path / "depth.png"
    assert wandb_charts.main([str(out), str(out), "--out", str(png)]) == 0
    assert wandb_charts.training_run(out).id == run.id  # the training run, not the evaluation run
    width, height = Image.open(png).size
    assert width > height > 0  # two rows of four panels
    # a copied run directory is enough (its offline run and staged files are inside it); the PNG's default name
    copy = tmp_path / "copied" / "run"
    shutil.copytree(out, copy)
    monkeypatch.chdir(tmp_path)
    assert wandb_charts.main([str(copy)]) == 0 and (tmp_path / "depth-charts.png").is_file()
    (model,) = [a for a in run.artifacts if a["type"] == "model"]
    staged = Path(model["files"]["model.safetensors"]).relative_to(out.resolve())
    assert (copy / staged).read_bytes() == (out / "final" / "model.safetensors").read_bytes()
    assert wandb_charts.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no offline wandb training run with depth charts" in capsys.readouterr().err


class FakeRun:
    """What wandb_charts reads of an offline run: its depth charts' tables, config and summary."""

    def __init__(self, norm, quantities):
        self.config = {"model.norm": norm, "model.norm_placement": "pre", "train.lr": 1e-3}
        self.summary = {"status": "completed", "final/eval/accuracy": 0.8}
        self.tables = {f"depth/{q}": {"data": [[s, f"layer {i}", 1.0 + s + i] for s in (1, 2) for i in range(2)]}
                       for q in quantities}

    def charts(self):
        return list(self.tables)

    def table(self, key):
        return self.tables[key]


def test_wandb_charts_titles_every_column_where_it_is_first_drawn():
    """An LN run above a BN run: the BN drift column is empty in the first row; its title goes on the BN run's
    panel, and every drawn column has one."""
    from normlab.cli import wandb_charts
    ln = FakeRun("layernorm", ["grad_norm", "act_rms"])
    bn = FakeRun("batchnorm", ["grad_norm", "act_rms", "stat_drift"])
    fig = wandb_charts.figure([ln, bn])
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    titles = [ax.get_title() for ax in axes if ax.get_title()]
    assert sorted(t.split("\n")[0] for t in titles) == ["depth/act_rms", "depth/grad_norm", "depth/stat_drift"]
    drift = fig.axes[-1]  # the BN run's drift panel (the last of the grid)
    assert drift.get_title().startswith("depth/stat_drift\nBN batch vs running statistics drift")
    # each row's label in short lines that fit its height, the LR as every figure writes it
    assert fig.axes[0].get_ylabel() == "layernorm\npre-norm, lr 1e-3\ncompleted, val acc 0.800"


def test_wandb_charts_scale_each_panel_as_normlab_compare_does():
    """A post-LN run's activation RMS sits within 0.3% of 1: a linear axis (it was a log one, labelled 9.995x10^-1);
    a gradient norm that falls 100x: a log axis in plain numbers; --linear: every axis linear."""
    from normlab.cli import wandb_charts

    run = FakeRun("layernorm", ["grad_norm", "act_rms"])
    points = [(s, i) for s in (1, 2, 3) for i in range(2)]
    run.tables["depth/act_rms"]["data"] = [[s, f"layer {i}", 1.0 + 0.001 * (s - i)] for s, i in points]
    run.tables["depth/grad_norm"]["data"] = [[s, f"layer {i}", 10.0 ** (1 - s)] for s, i in points]
    grad, rms = wandb_charts.figure([run]).axes[:2]
    assert (grad.get_yscale(), rms.get_yscale()) == ("log", "linear")
    grad.figure.canvas.draw()
    assert {t.get_text() for t in grad.yaxis.get_majorticklabels() if t.get_text()} >= {"0.1", "1", "10"}
    assert {ax.get_yscale() for ax in wandb_charts.figure([run], log_y=False).axes[:2]} == {"linear"}
