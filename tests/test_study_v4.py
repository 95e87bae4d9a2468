"""The runner's chosen-LR machinery (from study v4): arms trained at their best and runner-up LRs (a coin-flip
tuning trains both and is flagged), LRs taken from another study, the signal measurement, and provenance on every
record."""

import json

import pytest

from normlab.study import runner as study
from normlab.study.study_dir import git_commit, record_invocation

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


def fake_runner(job, env):
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
    return 0


def test_a_coin_flip_tuning_trains_both_lrs_and_is_flagged(tmp_path, monkeypatch):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_LRS)
    g = study.StudySpec.load(path)

    def dev_loss(name):
        arm, seed = name.rsplit("-wuon-s", 1)
        return DEV[arm][int(seed) - 100]

    monkeypatch.setattr("normlab.study.selection.dev_losses",
                        lambda study_dir, names, score, processes: {n: dev_loss(n) for n in names})
    study.run_stages(g, tmp_path / "st", {}, [], "cmd", study.LocalEngine(runner=fake_runner))
    sel = json.loads((tmp_path / "st" / "selection.json").read_text())
    a, b = sel["tune/a/wuon"], sel["tune/b/wuon"]
    assert (a["lr"], a["runner_up"], a["near_tie"]) == (0.00316, 0.001, True)
    assert (b["lr"], b["runner_up"], b["near_tie"]) == (0.001, 0.00316, False)
    assert [r["lr"] for r in a["by_lr"]] == [0.001, 0.00316, 0.01]  # sorted, floats
    assert a["by_lr"][0]["dev_loss_by_seed"] == DEV["a-lr0.001"]
    trained = json.loads((tmp_path / "st" / "study.json").read_text())["runs"]
    board = {n for n, r in trained.items() if "board" in r["experiments"]}
    lrs = {"a": ("0.00316", "0.001"), "b": ("0.001", "0.00316")}
    assert board == {f"{arm}-lr{lr}-wuon-s{s}" for arm in lrs for lr in lrs[arm] for s in (0, 1)}
    # b's runner-up 3.16e-3 and best 1e-3 appear as the same names a's do: runs are shared by configuration only
    assert all(r["status"] == "completed" and r["commit"] and r["machine"] and r["started_at"]
               for r in trained.values())


def test_ranks_need_a_runner_up_and_are_checked(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_LRS)
    g = study.StudySpec.load(path)
    assert g.plan.experiments["board"].ranks == 2
    old = {"tune/a/wuon": {"lr": 0.001}, "tune/b/wuon": {"lr": 0.001}}  # v3's selection.json: no runner-up
    with pytest.raises(study.StudyError, match="runner-up"):
        g.plan.runs(old)
    path.write_text(TWO_LRS.replace("ranks: 2", "ranks: 3"))
    with pytest.raises(study.StudyError, match="ranks"):
        study.StudySpec.load(path)


@pytest.mark.slow  # trains and scores two tiny masked-LM runs
def test_mlm_runs_are_scored_on_their_masked_tokens_with_one_fixed_mask(tmp_path):
    from normlab.files.formats import read_jsonl
    from normlab.run_dir import RunDir
    from normlab.study.scoring import score_run, score_sets
    from tests.train_utils import run_here

    out = tmp_path / "mlm"
    assert run_here(out, "task=mlm", "train.max_steps=6", "train.eval_steps=6", "train.save_steps=6") == 0
    sets = score_sets(RunDir(out).read_config(), 200)
    scores, gap = score_run(out, {"val": sets["val"]}, True, 16)
    assert set(scores) == {"val/sorted/running"} and gap is None
    again, _ = score_run(out, {"val": sets["val"]}, True, 16)
    assert again == scores  # the same masks every time
    logged = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/loss" in r][-1]
    # the run's own evaluation (first 96 rows, its own masks) and the scoring (every row) measure one model
    assert scores["val/sorted/running"]["loss"] == pytest.approx(logged["eval/loss"], rel=0.05)


def test_pooled_cosine_is_one_for_identical_sentences_and_matches_a_hand_computation():
    import torch

    from model import NormLabConfig, NormLabForSequenceClassification
    from normlab.study.signal import cosine_over_steps, pooled_cosine

    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, norm="layernorm", hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, num_labels=2, pad_token_id=0)
    model = NormLabForSequenceClassification(config).eval()
    ids = torch.tensor([[2, 5, 6, 3, 0], [2, 7, 8, 9, 3], [2, 11, 3, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([0, 1, 0])}
    same = {"input_ids": ids[[0, 0, 0]], "attention_mask": batch["attention_mask"][[0, 0, 0]]}
    assert pooled_cosine(model, same) == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():
        cls = model.base_model(input_ids=ids, attention_mask=batch["attention_mask"])[0][:, 0]
    cos = torch.nn.functional.cosine_similarity(cls[:, None], cls[None], dim=-1)
    assert pooled_cosine(model, batch) == pytest.approx(((cos.sum() - 3) / 6).item(), abs=1e-6)
    curve = cosine_over_steps(model, [batch, batch], batch, lr=1e-2)
    assert len(curve) == 3 and curve[0] == pytest.approx(((cos.sum() - 3) / 6).item(), abs=1e-6)
    assert curve[2] != curve[0]  # two Adam steps move the pooled vectors


def test_signal_rows_and_its_invocation_carry_commit_machine_and_start_time(tmp_path, capsys):
    """The signal measurement by hand (no training) into a study: each row carries commit, machine and start time,
    its invocation joins study.json's (meta.json lists them); a block at a chosen LR not chosen yet is one line."""
    from normlab.study import signal

    preset = tmp_path / "p.yaml"
    preset.write_text(TWO_LRS.replace("overrides: {train.max_steps: 5}", "overrides: {train.max_steps: 5, "
                                      "data.max_train_samples: 64, model.vocab_size: 300}")
                      + "signal: {variants: {a: {config: configs/pre_ln.yaml}}, seeds: [0], steps: 2, lr: 1.0e-3, "
                      "batch_size: 4, max_length: 16}\n")
    study.StudyLedger(tmp_path / "st", study.StudySpec.load(preset), "study.py").record("any", status="completed")
    assert signal.main([str(tmp_path / "st")]) == 0
    (row,) = [json.loads(x) for x in (tmp_path / "st" / "signal.jsonl").read_text().splitlines()]
    assert (row["variant"], row["seed"], row["lr"], len(row["cosine"])) == ("a", 0, 1e-3, 3)
    assert row["commit"] and row["machine"] and row["started_at"]
    (call,) = json.loads((tmp_path / "st" / "study.json").read_text())["invocations"]
    assert call["command"].startswith("python -m normlab.study.signal") and call["commit"] and call["cpu_s"] > 0
    (tmp_path / "st" / "spec.yaml").write_text(preset.read_text().replace("lr: 1.0e-3, batch", "lr: {best_of: tune}, "
                                                                        "batch"))
    capsys.readouterr()
    assert signal.main([str(tmp_path / "st")]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # "arm a's LR is not chosen yet; train its sweep first ..."
    # by hand into a new folder: a preset refused leaves nothing behind; one that can run is kept as its spec
    assert signal.main([str(tmp_path / "new"), "--preset", str(tmp_path / "st" / "spec.yaml")]) == 2
    assert not (tmp_path / "new").exists()
    assert signal.main([str(tmp_path / "new"), "--preset", str(preset)]) == 0
    assert (tmp_path / "new" / "spec.yaml").read_text() == preset.read_text()
    assert (tmp_path / "new" / "signal.jsonl").read_text().count("\n") == 1


def test_a_study_built_in_pieces_keeps_every_invocation(tmp_path):
    path, st = tmp_path / "two.yaml", tmp_path / "st"
    path.write_text(TWO_LRS)
    grid = study.StudySpec.load(path)
    st.mkdir()
    for seeds in ("0", "1"):
        command = f"python scripts/study.py --only seed={seeds}"
        study.StudyLedger(st, grid, command).record(f"a-s{seeds}", status="completed")
        record_invocation(st, command, started=0.0)
    data = json.loads((st / "study.json").read_text())
    assert [c["command"] for c in data["invocations"]] == data["commands"] == [
        "python scripts/study.py --only seed=0", "python scripts/study.py --only seed=1"]
    assert set(data["runs"]) == {"a-s0", "a-s1"}


def test_an_invocation_keeps_the_commit_it_started_at(tmp_path):
    """study.py reads the commit when it starts: a commit made while its runs train (docs, say) must not be named
    as the code they ran. Without one given, the checkout's commit now."""
    path, st = tmp_path / "two.yaml", tmp_path / "st"
    path.write_text(TWO_LRS)
    st.mkdir()
    study.StudyLedger(st, study.StudySpec.load(path), "a").record("a-s0", status="completed")
    record_invocation(st, "started earlier", started=0.0, commit="1234abc")
    record_invocation(st, "now", started=0.0)
    calls = json.loads((st / "study.json").read_text())["invocations"]
    assert [c["commit"] for c in calls] == ["1234abc", git_commit()]


def test_the_runner_measures_the_signal_once_each_arm_has_its_best_lr(tmp_path, monkeypatch, capsys):
    """`signal` is a stage of the study, from the spec alone: once the sweep has chosen, every arm (an
    intervention through its tune arm) at its best LR, in the block's order, whatever the number of processes."""
    preset = tmp_path / "p.yaml"
    preset.write_text(TWO_LRS.replace("overrides: {train.max_steps: 5}",
                                      "overrides: {train.max_steps: 5, data.max_train_samples: 64, "
                                      "model.vocab_size: 300, model.hidden_size: 16, model.num_hidden_layers: 1, "
                                      "model.num_attention_heads: 2, model.intermediate_size: 32}")
                      + "signal: {variants: {a: {config: configs/pre_ln.yaml}, b: {config: configs/batchnorm.yaml}, "
                        "a_mean: {config: configs/pre_ln.yaml, overrides: {model.pooling: mean}, tune: a}}, "
                        "seeds: [0, 1], steps: 2, lr: {best_of: tune}, batch_size: 4, max_length: 16}\n")
    spec = study.StudySpec.load(preset)
    study.dry_run(spec.plan, spec.plan.runs(), tmp_path / "st", [])
    assert "then the signal measurement (6 arm-seed pairs, no training)" in capsys.readouterr().out
    monkeypatch.setattr("normlab.study.selection.dev_losses", lambda study_dir, names, score, processes: {
        n: DEV[n.rsplit("-wuon-s", 1)[0]][int(n.rsplit("-s", 1)[1]) - 100] for n in names})
    study.run_stages(spec, tmp_path / "st", {}, [], "cmd", study.LocalEngine(runner=fake_runner), shards=2)
    rows = [json.loads(x) for x in (tmp_path / "st" / "signal.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"]) for r in rows] == [(v, s) for v in ("a", "b", "a_mean") for s in (0, 1)]
    assert {r["variant"]: r["lr"] for r in rows} == {"a": 0.00316, "b": 0.001, "a_mean": 0.00316}
    assert all(len(r["cosine"]) == 3 and r["commit"] and r["machine"] and r["started_at"] for r in rows)
    again = (tmp_path / "st" / "signal.jsonl").read_text()
    study.run_stages(spec, tmp_path / "st", {}, [], "cmd", study.LocalEngine(runner=fake_runner))
    assert (tmp_path / "st" / "signal.jsonl").read_text() == again  # measured once


def test_a_study_can_take_its_lrs_from_another_and_never_trains_the_named_sweep(tmp_path):
    path = tmp_path / "long.yaml"
    source = tmp_path / "quick_selection.json"
    path.write_text(TWO_LRS.replace("share_runs: true", f"share_runs: true\nselection_from: {source}"))
    g = study.StudySpec.load(path)
    with pytest.raises(study.StudyError, match="selection_from: .* not found"):
        study.study_selection(g.plan, tmp_path / "st")
    source.write_text(json.dumps({"tune/a/wuon": {"lr": 0.001, "runner_up": 0.00316}}))
    with pytest.raises(study.StudyError, match="no choice for tune/b/wuon"):
        study.study_selection(g.plan, tmp_path / "st")
    source.write_text(json.dumps({f"tune/{v}/wuon": {"lr": 0.001, "runner_up": 0.00316} for v in "ab"}))
    study.run_stages(g, tmp_path / "st", {}, [], "cmd", study.LocalEngine(runner=fake_runner))
    trained = json.loads((tmp_path / "st" / "study.json").read_text())["runs"]
    assert len(trained) == 2 * 2 * 2 and all("board" in r["experiments"] for r in trained.values())
    assert json.loads((tmp_path / "st" / "selection.json").read_text()) == json.loads(source.read_text())


def test_a_diverged_tuning_seed_gives_no_gap_and_no_near_tie():
    from normlab.study.selection import choice

    picked = choice({1e-3: [0.40, 0.41], 1e-2: [0.41, float("inf")]})
    assert (picked["lr"], picked["runner_up"], picked["gap"], picked["seed_sd"]) == (1e-3, 1e-2, None, None)
    assert picked["by_lr"][1] == {"lr": 0.01, "dev_loss": float("inf"), "dev_loss_by_seed": [0.41, None]}
    assert picked["near_tie"] is False
    assert "runner_up" not in choice({1e-3: [0.4]})  # a one-LR sweep has no runner-up


def test_a_signal_arm_is_measured_at_a_choice_its_sweep_makes_even_where_no_experiment_trains_it(tmp_path):
    """The block's {best_of} LRs are choices like the chosen-LR experiments': pending until the sweep has made them
    (so the runner makes them), keyed by the warmup its tune variant's sweep trains with."""
    path = tmp_path / "p.yaml"
    path.write_text(TWO_LRS.replace("variants: {a: {config: pre_ln}, b: {config: post_ln}}\n    lr: {best_of",
                                    "variants: {a: {config: pre_ln}}\n    lr: {best_of")
                    .replace("    warmup: {on: 2}\n    seeds: [100", "    warmup: {off: 0}\n    seeds: [100")
                    .replace("    warmup: {on: 2}\n    seeds: [0, 1]", "    warmup: {off: 0}\n    seeds: [0, 1]")
                    + "signal: {variants: {b: {config: post_ln}}, seeds: [0], steps: 2, lr: {best_of: tune}, "
                      "batch_size: 4, max_length: 16}\n")
    plan = study.StudySpec.load(path).plan
    assert set(plan.pending({})) == {"tune/a/wuoff", "tune/b/wuoff"}  # b: for the signal block only
    chosen = {"tune/a/wuoff": {"lr": 0.001}, "tune/b/wuoff": {"lr": 0.00316}}
    assert plan.pending(chosen) == {} and plan.signal_lr("b", chosen) == 0.00316
