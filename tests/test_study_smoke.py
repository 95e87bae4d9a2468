"""The whole study pipeline on tiny data, for real: study.py trains a miniature of the quick preset's stages (an LR
sweep, the choice on dev, runs at the chosen LRs and the A/A arm, in warm workers), scores every final model
(score_runs.py) and writes the report."""

import json

import pytest

from normlab.cli import study

pytestmark = pytest.mark.slow  # a whole tiny study, for real

TINY = """
name: smoke
overrides:
  model.hidden_size: 16
  model.num_hidden_layers: 2
  model.num_attention_heads: 2
  model.intermediate_size: 32
  model.vocab_size: 400
  model.hidden_dropout_prob: 0.0
  model.attention_probs_dropout_prob: 0.0
  data.max_train_samples: 64
  data.max_eval_samples: 64
  data.max_length: 16
  train.batch_size: 16
  train.epochs: 1
  wandb.mode: disabled
share_runs: true
experiments:
  tune:
    variants: {ln_pre: {config: pre_ln}, batchnorm: {config: batchnorm}}
    lr: [1.0e-3, 1.0e-2]
    warmup: {on: 2}
    seeds: [100]
  leaderboard:
    variants: {ln_pre: {config: pre_ln}, batchnorm: {config: batchnorm}}
    lr: {best_of: tune}
    warmup: {on: 2}
    seeds: [0]
  aa:
    variants: {custom_ln_aa: {config: custom_ln, tune: ln_pre}}
    lr: {best_of: tune}
    warmup: {on: 2}
    seeds: [0]
score: {dev_rows: 40, batch_size: 16}
pilot: true
aa: {arm: ln_pre, copy: custom_ln_aa}
hypotheses:
  - {id: H1, outcome: accuracy, a: batchnorm, b: ln_pre, sign: -1}
"""


def test_tiny_study_trains_scores_and_reports(tmp_path, capsys):
    preset = tmp_path / "smoke.yaml"
    preset.write_text(TINY)
    study_dir = tmp_path / "st"
    assert study.main(["--preset", str(preset), "--study-dir", str(study_dir), "--parallel", "2"]) == 0
    runs = [json.loads(x) for x in (study_dir / "runs.jsonl").read_text().splitlines()]
    out = capsys.readouterr().out  # the merged file is named, not a part the two scoring processes wrote
    assert f"7 records -> {study_dir / 'runs.jsonl'}\n" in out and ".part" not in out
    # scored in two shards, merged in run-name order as one process writes it
    assert [r["name"] for r in runs] == sorted(r["name"] for r in runs) and not list(study_dir.glob("runs.part*"))
    selection = json.loads((study_dir / "selection.json").read_text())
    assert set(selection) == {"tune/ln_pre/wuon", "tune/batchnorm/wuon"}
    best = {k.split("/")[1]: f"{v['lr']:g}" for k, v in selection.items()}
    assert sorted(r["name"] for r in runs) == sorted(
        [f"{v}-lr{lr}-wuon-s100" for v in ("ln_pre", "batchnorm") for lr in ("0.001", "0.01")]
        + [f"ln_pre-lr{best['ln_pre']}-wuon-s0", f"batchnorm-lr{best['batchnorm']}-wuon-s0",
           f"custom_ln_aa-lr{best['ln_pre']}-wuon-s0"])
    labels = json.loads((study_dir / "labels.json").read_text())
    assert len(labels["dev"]) == 40 and len(labels["val"]) == 872  # scoring uses the whole validation split
    for r in runs:
        assert r["status"] == "completed" and len(r["curves"]["loss"]) == 4  # one epoch of 64 rows in 16s
        assert 0 < r["pad_fraction"] < 1 and r["tokens_per_s"] > 0  # kept beside the curves, from the logged steps
        assert r["examples_per_step"] == 16  # the outcome rules' window is 640 examples: 40 of these steps
        assert all(len(s["pred"]) == len(labels[k.split("/")[0]]) for k, s in r["scores"].items())
    bn = next(r for r in runs if r["norm"] == "batchnorm" and r["seed"] == 100)  # a sweep run: scored on dev too
    assert set(bn["scores"]) == {f"val/{h}/{m}" for h in ("sorted", "shuffled", "fixed")
                                 for m in ("running", "batch")} | {"dev/sorted/running"}
    # dev chooses LRs: the runs at the chosen LRs are not scored on it
    assert not any(k.startswith("dev/") for r in runs if r["seed"] == 0 for k in r["scores"])
    assert "stat_drift" in bn["curves"]
    # 2 blocks x 2 norms + the final norm; LN runs have no running statistics
    assert [len(bn["running_stats"][k]) for k in ("mean_gap", "log_var_ratio")] == [5, 5]
    assert all(v >= 0 for k in ("mean_gap", "log_var_ratio") for v in bn["running_stats"][k])
    assert not any("running_stats" in r for r in runs if r["norm"] != "batchnorm")
    # with running statistics nothing depends on the batch: the three batchings predict alike
    assert len({bn["scores"][f"val/{h}/running"]["pred"] for h in ("sorted", "shuffled", "fixed")}) == 1
    # the LR choice scored the sweeps on dev in two processes: the losses the records' own scoring finds
    by_name = {r["name"]: r for r in runs}
    for choice in selection.values():
        for row in choice["by_lr"]:
            for name, loss in zip(row["runs"], row["dev_loss_by_seed"]):
                assert loss == pytest.approx(by_name[name]["scores"]["dev/sorted/running"]["loss"], abs=1e-5)
    assert not list(study_dir.glob("dev_losses*"))  # passed through, then removed: selection.json keeps them
    (call,) = json.loads((study_dir / "study.json").read_text())["invocations"]  # the study's, its workers' CPU
    assert call["command"].startswith("python scripts/study.py --preset") and call["cpu_s"] > 0
    text = (study_dir / "report.md").read_text()
    assert text.startswith("# smoke: report\n\n2 arms, each at its best LR on dev; 4 steps; 1 seed (0).")
    assert "ln_pre on two seed sets: 1 and 1 runs, under the 8 a resample needs" in text
    assert "| H1 | claim |" in text and "too few seeds to decide" in text and "nan" not in text.lower()
    assert (study_dir / "spec.yaml").read_text() == TINY  # the snapshot the report read
    assert (study_dir / "answer.png").is_file() and (study_dir / "runs.jsonl.gz").is_file()
    # a later invocation scores again: no run changed, so every record is kept as it was, none recomputed
    from normlab.study import scoring

    before, _ = (study_dir / "runs.jsonl").read_text(), capsys.readouterr()
    scoring.score(study_dir)
    out = capsys.readouterr().out
    assert (study_dir / "runs.jsonl").read_text() == before
    assert f"kept {len(runs)} records scored before" in out and "scored " not in out.replace("scored before", "")
