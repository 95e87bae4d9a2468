"""Study v4's machinery: arms trained at their best and runner-up LRs (a coin-flip tuning trains both and is
flagged), the v4 presets' designs checked against the rules, and provenance on every record."""

import json
from pathlib import Path

import pytest

from normlab.study import grid as grid_mod
from normlab.study import rules
from normlab.study import runner as study

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
    out = Path(cmd[cmd.index("--config") + 1]).parent  # the run's own config.yaml
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"status": "completed"}))
    return 0


def test_a_coin_flip_tuning_trains_both_lrs_and_is_flagged(tmp_path, monkeypatch):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_LRS)
    g = study.load_grid(path)

    def dev_loss(name):
        arm, seed = name.rsplit("-wuon-s", 1)
        return DEV[arm][int(seed) - 100]

    monkeypatch.setattr("normlab.study.selection.dev_losses",
                        lambda study_dir, names, score, processes: {n: dev_loss(n) for n in names})
    study.run_stages(g, path, tmp_path / "st", {}, [], "cmd", study.LocalEngine(runner=fake_runner))
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
    g = study.load_grid(path)
    assert g["experiments"]["board"]["ranks"] == 2
    old = {"tune/a/wuon": {"lr": 0.001}, "tune/b/wuon": {"lr": 0.001}}  # v3's selection.json: no runner-up
    with pytest.raises(grid_mod.StudyError, match="runner-up"):
        study.expand(g, old)
    path.write_text(TWO_LRS.replace("ranks: 2", "ranks: 3"))
    with pytest.raises(grid_mod.StudyError, match="ranks"):
        study.load_grid(path)


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


def test_e1_rows_and_its_invocation_carry_commit_machine_and_start_time(tmp_path):
    from normlab.study import init_exp

    preset = tmp_path / "p.yaml"
    preset.write_text(TWO_LRS + "init: {placements: [pre], depths: [1], seeds: [0], adam_steps: 1, lr: 1.0e-3, "
                      "hidden_size: 16, num_attention_heads: 2, intermediate_size: 32, batch_size: 4, "
                      "max_length: 16}\n")
    preset.write_text(preset.read_text().replace("overrides: {train.max_steps: 5}",
                                                 "overrides: {train.max_steps: 5, data.max_train_samples: 64, "
                                                 "model.vocab_size: 300}"))
    (tmp_path / "st").mkdir()
    study.Study(tmp_path / "st", study.load_grid(preset), preset, "study.py").record("any", status="completed")
    assert init_exp.main([str(tmp_path / "st")]) == 0
    (row,) = [json.loads(x) for x in (tmp_path / "st" / "e1.jsonl").read_text().splitlines()]
    assert row["commit"] and row["machine"] and row["started_at"]
    (call,) = json.loads((tmp_path / "st" / "study.json").read_text())["invocations"]
    assert call["command"].startswith("python scripts/init_study.py") and call["commit"] and call["wall_s"] >= 0


def test_a_study_built_in_pieces_keeps_every_invocation(tmp_path):
    path, st = tmp_path / "two.yaml", tmp_path / "st"
    path.write_text(TWO_LRS)
    grid = study.load_grid(path)
    st.mkdir()
    for seeds in ("0", "1"):
        command = f"python scripts/study.py --only seed={seeds}"
        study.Study(st, grid, path, command).record(f"a-s{seeds}", status="completed")
        study.record_invocation(st, command, started=0.0)
    data = json.loads((st / "study.json").read_text())
    assert [c["command"] for c in data["invocations"]] == data["commands"] == [
        "python scripts/study.py --only seed=0", "python scripts/study.py --only seed=1"]
    assert set(data["runs"]) == {"a-s0", "a-s1"}


# --- the v4 report on synthetic records --------------------------------------------------------------------------

ARMS = ("ln_pre", "ln_post", "custom_ln", "rmsnorm", "dyt", "batchnorm", "masked_batchnorm", "powernorm", "no_norm")
BEST, RUNNER = 0.00316, 0.001


def synthetic_run(variant, lr, seed, exit_step, acc, experiment="board", steps=416):
    import math as m

    loss = [m.log(2) if s < exit_step else 0.45 for s in range(1, steps + 1)]
    evals = [{"step": s, "accuracy": acc - 0.001 * (steps - s) / 32, "loss": 0.5} for s in range(32, steps + 1, 32)]
    return {"name": f"{variant}-lr{lr:g}-wuon-s{seed}", "experiment": experiment, "experiments": [experiment],
            "variant": variant, "lr": lr, "warmup": "on", "seed": seed, "status": "completed", "commit": "abc1234",
            "machine": "test box", "started_at": "2026-12-01T00:00:00+0000",
            "curves": {"step": list(range(1, steps + 1)), "loss": loss, "eval": evals},
            "scores": {"val/sorted/running": {"accuracy": acc, "loss": 1 - acc}}}


def synthetic_records():
    import numpy as np

    from normlab.study.analysis import Records

    rng = np.random.default_rng(0)
    runs, base = [], {a: 0.72 for a in ARMS}
    for seed in range(10):
        noise = rng.normal(0, 0.003)
        for arm in ARMS:
            for lr in (BEST, RUNNER):
                acc = base[arm] + noise + rng.normal(0, 0.002)
                if arm == "batchnorm" and lr == BEST:
                    acc += 0.05  # BN ahead of LN only at the best LR: H1 depends on the LR
                exit_step = 200 if arm == "dyt" else 60 + (40 if arm in ("ln_pre", "custom_ln", "rmsnorm") else 0)
                runs.append(synthetic_run(arm, lr, seed, exit_step + int(rng.integers(0, 12)), acc))
        runs.append(synthetic_run("ln_pre", BEST, seed + 10, 100, base["ln_pre"] + rng.normal(0, 0.003), "aa"))
    selection = {f"tune/{a}/wuon": {"lr": BEST, "runner_up": RUNNER, "near_tie": a == "ln_pre"} for a in ARMS}
    return Records(runs, selection)


def test_the_v4_report_applies_the_robustness_and_horizon_rules(tmp_path):
    from normlab.study import report_v4

    rec = synthetic_records()
    assert report_v4.is_v4(rec)
    rows = {r["id"]: r for r in report_v4.claim_rows(rec, "t")}
    assert set(rows) == {"H1", "H2", "H3", "H4"}  # no mechanism runs, no MLM in these records
    assert rows["H1"]["verdicts"] == {0: "refuted", 1: "not separated"} and rows["H1"]["verdict"] == rules.DEPENDS
    assert rows["H3"]["verdict"] == rules.HORIZON_TOO_SHORT  # DyT leaves the plateau at step ~205 of 416
    assert rows["H3"]["horizon_why"] == "late exit at the best LRs; late exit at the runner-up LRs"
    assert rows["H4"]["verdict"] == "confirmed" and rows["H4"]["horizon"] is None  # slow group exits later
    text = report_v4.write_markdown(rec, {"name": "synthetic", "invocations": []})
    assert "abc1234 (190)" in text and "near tie" in text and "**horizon too short**" in text
    assert "## Calibration: the A/A control" in text and "depends on the LR" in text
    assert "DyT's validation loss relative to pre-LN's: " in text and "(arXiv 2604.23434: -27%" in text
    # every synthetic run gains 0.001 accuracy per evaluation: the board's "last move" column says so
    assert report_v4.last_move(rec.runs[:3], "accuracy") == "+0.001" and "| yes | +0.001 | yes |" in text


def test_a_claim_the_exact_test_cannot_decide_at_its_seeds_is_said_so_not_not_separated():
    """4 seeds, sign-flip, Holm over H1-H4: the smallest attainable p is 4 x 2^-3 = 0.5, whatever the data."""
    from normlab.study.analysis import Records
    from normlab.study.report_v4 import claim_rows, write_markdown

    rec = synthetic_records()
    few = Records([r for r in rec.runs if r["seed"] < 4], rec.selection)
    rows = {r["id"]: r for r in claim_rows(few, "permutation")}
    assert rows["H2"]["floor"] == {0: 0.5, 1: 0.5}
    assert rows["H2"]["verdicts"] == {0: "could not decide (p >= 0.5)", 1: "could not decide (p >= 0.5)"}
    assert rows["H2"]["robust"] == rules.UNDECIDED
    assert "(no A/A control in these records)" in write_markdown(few, {"invocations": []})
    assert all(r["floor"] == {0: 0.0, 1: 0.0} for r in claim_rows(rec, "t"))  # a t test has no such floor


def test_a_part_trained_study_says_what_its_report_lacks():
    from normlab.study.analysis import Records
    from normlab.study.report_v4 import provenance_lines

    rec = synthetic_records()

    def late(r):  # the board's last two seeds: not trained yet
        return r["experiment"] == "board" and r["seed"] >= 8

    part = Records([{**r, "status": "pending"} if late(r) else r for r in rec.runs], rec.selection)
    n = sum(map(late, rec.runs))
    lines = provenance_lines(part, {"invocations": []})
    assert lines[1] == "- Invocations: none recorded in study.json (the study's own notes give its times)"
    assert lines[2] == (f"- **Not trained** (the study was stopped before them, or they crashed; left out): {n} of "
                        f"{len(rec.runs)} runs, by seed: 8 ({n // 2}), 9 ({n // 2})")
    assert len(provenance_lines(rec, {"invocations": []})) == 2  # all trained: no such line


def test_the_report_counts_runs_that_no_listed_invocation_trained():
    """meta.json should list every invocation: a run whose start lies in none of them (an invocation whose record
    was lost) is counted; study.json's older invocation times, written without an offset, are read as UTC."""
    from normlab.study.analysis import Records
    from normlab.study.report_v4 import provenance_lines

    rec = synthetic_records()
    runs = [{**r, "started_at": "2026-12-01T10:30:00+0000" if r["seed"] < 8 else "2026-12-01T13:00:00+0000"}
            for r in rec.runs]
    late = sum(r["seed"] >= 8 for r in runs)
    calls = [{"command": "study.py", "commit": "abc1234", "started": "2026-12-01 10:00:00", "wall_s": 3600.0}]
    lines = provenance_lines(Records(runs, rec.selection), {"invocations": calls})
    assert lines[2] == (f"- **{late} of {len(runs)} runs started outside every invocation listed**: meta.json lacks "
                        f"the invocations that trained them (the study's own notes give their times)")
    calls.append({**calls[0], "started": "2026-12-01 12:59:00+0000"})
    assert len(provenance_lines(Records(runs, rec.selection), {"invocations": calls})) == 2


def test_make_report_writes_the_v4_report_for_v4_records_and_keeps_v3s(tmp_path):
    import gzip

    from normlab.study.report import RECORDS, make_report

    rec = synthetic_records()
    with gzip.open(tmp_path / RECORDS, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rec.runs)
    (tmp_path / "selection.json").write_text(json.dumps(rec.selection))
    (tmp_path / "meta.json").write_text(json.dumps({"name": "quick_v4", "invocations": []}))
    text = make_report(tmp_path, wandb_mode="disabled").read_text()
    assert text.startswith("# Study v4 (quick_v4): report") and "| H2 |" in text
    assert "](answer.png)" in text and (tmp_path / "answer.png").stat().st_size > 10_000  # the board's figure


def p2_records(differ: int, seeds: int = 12):
    from normlab.study.analysis import Records

    lrs, runs = (1.78e-3, 2.37e-3, 3.16e-3, 4.22e-3), []
    for seed in range(seeds):
        largest = {"off": 1, "on": 2 if seed < differ else 1}  # index of the largest LR that learns
        for warmup, top in largest.items():
            for i, lr in enumerate(lrs):
                r = synthetic_run("ln_post", lr, seed, 60 if i <= top else 10_000, 0.75, "placement")
                runs.append(dict(r, warmup=warmup, name=r["name"].replace("wuon", f"wu{warmup}")))
    return Records(runs, {})


def test_p2_is_undecidable_when_too_few_seeds_differ_and_decided_when_enough_do():
    from normlab.study import report_v4

    assert report_v4.is_v4(p2_records(3))
    few = "\n".join(report_v4.p2_lines(p2_records(differ=5)))
    assert "could not decide: 5 of 12 seeds differ, so p cannot go below 0.0625" in few
    enough = "\n".join(report_v4.p2_lines(p2_records(differ=9)))
    assert "9 non-zero pairs" in enough and "Verdict: **confirmed**" in enough


def test_m1_correlates_the_spread_with_the_exit_across_arms():
    from normlab.study import report_v4

    rec = synthetic_records()
    exits = {a: rules.median_exit(report_v4.runs_at(rec, a, 0)) for a in report_v4.M1_ARMS}
    signal = [{"variant": a, "seed": s, "cosine": [0.9, 1 - 1 / exits[a]]} for a in report_v4.M1_ARMS
              for s in range(3)]  # more spread, earlier exit
    text = "\n".join(report_v4.m1_lines(rec, signal))
    assert "Spearman's rho over 7 arms: -" in text and "**confirmed**" in text
    backwards = [dict(r, cosine=[0.9, 1 - exits[r["variant"]] / 1000]) for r in signal]
    assert "**refuted**" in "\n".join(report_v4.m1_lines(rec, backwards))


def test_signal_rows_take_each_arms_best_lr_and_carry_provenance(tmp_path):
    from normlab.study import signal

    preset = tmp_path / "p.yaml"
    preset.write_text(TWO_LRS.replace("overrides: {train.max_steps: 5}",
                                      "overrides: {train.max_steps: 5, data.max_train_samples: 64, "
                                      "model.vocab_size: 300, model.hidden_size: 16, model.num_hidden_layers: 1, "
                                      "model.num_attention_heads: 2, model.intermediate_size: 32}")
                      + "signal: {variants: {a: {config: configs/pre_ln.yaml}, b: {config: configs/batchnorm.yaml}, "
                        "a_mean: {config: configs/pre_ln.yaml, overrides: {model.pooling: mean}, tune: a}}, "
                        "seeds: [0], steps: 2, lr: 1.0e-3, batch_size: 4, max_length: 16}\n")
    (tmp_path / "st").mkdir()
    study.Study(tmp_path / "st", study.load_grid(preset), preset, "study.py").record("any", status="completed")
    (tmp_path / "sel.json").write_text(json.dumps({"tune/a/wuon": {"lr": 0.00316}}))
    out = tmp_path / "st" / "signal.jsonl"
    assert signal.main(["--preset", str(preset), "--out", str(out), "--selection", str(tmp_path / "sel.json")]) == 0
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert {v: r["lr"] for v, r in rows.items()} == {"a": 0.00316, "b": 1e-3, "a_mean": 0.00316}  # b: not tuned
    assert all(len(r["cosine"]) == 3 and r["commit"] and r["machine"] and r["started_at"] for r in rows.values())
    (call,) = json.loads((tmp_path / "st" / "study.json").read_text())["invocations"]
    assert call["command"].startswith("python -m normlab.study.signal")


def test_a_study_can_take_its_lrs_from_another_and_never_trains_the_named_sweep(tmp_path):
    path = tmp_path / "long.yaml"
    source = tmp_path / "quick_selection.json"
    path.write_text(TWO_LRS.replace("share_runs: true", f"share_runs: true\nselection_from: {source}"))
    g = study.load_grid(path)
    with pytest.raises(grid_mod.StudyError, match="selection_from: .* not found"):
        study.study_selection(g, tmp_path / "st")
    source.write_text(json.dumps({"tune/a/wuon": {"lr": 0.001, "runner_up": 0.00316}}))
    with pytest.raises(grid_mod.StudyError, match="no choice for tune/b/wuon"):
        study.study_selection(g, tmp_path / "st")
    source.write_text(json.dumps({f"tune/{v}/wuon": {"lr": 0.001, "runner_up": 0.00316} for v in "ab"}))
    study.run_stages(g, path, tmp_path / "st", {}, [], "cmd", study.LocalEngine(runner=fake_runner))
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


def test_the_long_report_says_where_its_answer_differs_from_the_quick_one(tmp_path):
    import gzip

    from normlab.study.analysis import Records
    from normlab.study.report import RECORDS, make_report

    quick = synthetic_records()
    later = [dict(r) for r in quick.runs if r["experiment"] == "board"]  # no A/A: the sign-flip test
    for r in later:
        r["curves"] = {**r["curves"], "eval": [{**e, "accuracy": e["accuracy"] + (0.05 if r["variant"] == "dyt" else 0)}
                                               for e in r["curves"]["eval"]]}
        r["scores"] = {"val/sorted/running": {k: v + 0.05 if r["variant"] == "dyt" and k == "accuracy" else v
                                              for k, v in r["scores"]["val/sorted/running"].items()}}
    for folder, rec in (("quick_v4", quick), ("long_v4", Records(later, quick.selection))):
        (tmp_path / folder).mkdir()
        with gzip.open(tmp_path / folder / RECORDS, "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rec.runs)
        (tmp_path / folder / "selection.json").write_text(json.dumps(rec.selection))
        (tmp_path / folder / "meta.json").write_text(json.dumps({"name": folder, "invocations": []}))
    text = make_report(tmp_path / "long_v4", compare=tmp_path / "quick_v4").read_text()
    section = text[text.index("## Against quick_v4"):text.index("## Every arm")]
    assert "| H1 |" in section and "depends on the LR" in section  # BN ahead at the best LRs only, in both
    dyt = [line for line in section.splitlines() if line.startswith("| dyt |")]
    assert len(dyt) == 2 and all(line.rstrip(" |").endswith("+0.050") and "| 1 |" in line for line in dyt)
    with pytest.raises(FileNotFoundError, match="--compare"):
        make_report(tmp_path / "long_v4", compare=tmp_path)
    # stopped after 4 seeds: no claim can be decided there, and the comparison says so rather than "changed"
    (part := tmp_path / "long_part").mkdir()
    with gzip.open(part / RECORDS, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in later if r["seed"] < 4)
    (part / "selection.json").write_text(json.dumps(quick.selection))
    text = make_report(part, compare=tmp_path / "quick_v4").read_text()
    section = text[text.index("## Against quick_v4"):text.index("## Every arm")]
    assert "| **could not decide** | undecided here |" in section and "**changed**" not in section
