"""The study runner's (normlab/study/runner.py, plan.py) plan, experiments, narrowing, skipping and failure recording,
with a fake runner (no training here; tests/test_study_smoke.py trains a tiny study end to end)."""

import json
import math
import sys
from pathlib import Path

import pytest

from normlab.cli import study as study_cli
from normlab.paths import REPO_ROOT
from normlab.study import runner as study
from normlab.study.plan import lr_grid, parse_only, resolve_preset

GRID = """
name: tiny
overrides: {train.max_steps: 5, data.max_train_samples: 64}
variants:
  post_ln: {config: post_ln}
  masked_batchnorm: {config: masked_batchnorm, warmup: [on], overrides: {model.bn_momentum: 0.2}}
lr: {min: 1.0e-4, max: 1.0e-2, num: 3}
warmup: {on: 10, off: 0}
seeds: [0, 1]
"""


@pytest.fixture()
def grid(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(GRID)
    return path, study.StudySpec.load(path)


def test_lr_grid_is_log_spaced_and_lists_pass_through():
    assert lr_grid({"min": 1e-4, "max": 1e-2, "num": 3}) == [1e-4, 1e-3, 1e-2]
    assert lr_grid({"min": 1e-3, "max": 1e-2, "num": 3}) == [1e-3, 0.00316, 1e-2]
    assert lr_grid([3e-4, 1e-3]) == [3e-4, 1e-3]
    with pytest.raises(study.StudyError):
        lr_grid({"min": 1e-2, "max": 1e-4, "num": 3})


def test_grid_expansion_respects_per_variant_warmup(grid):
    _, g = grid
    runs = g.plan.runs()
    # post_ln: 3 lr x 2 warmup x 2 seeds; masked_batchnorm: 3 lr x warmup on only x 2 seeds
    assert len(runs) == 12 + 6
    assert len({r.name for r in runs}) == len(runs)
    assert {r.warmup for r in runs if r.variant == "masked_batchnorm"} == {"on"}
    assert "post_ln-lr0.001-wuoff-s1" in {r.name for r in runs}


def test_narrowing_from_the_command_line(grid):
    _, g = grid
    runs = g.plan.runs()
    only = parse_only(["variant=post_ln,seed=0", "lr=1e-3,0.01"])
    assert only == {"variant": {"post_ln"}, "seed": {"0"}, "lr": {"1e-3", "0.01"}}
    picked = study.narrow(runs, only)
    assert sorted(r.name for r in picked) == sorted(
        f"post_ln-lr{lr}-wu{w}-s0" for lr in ("0.001", "0.01") for w in ("on", "off"))
    assert {r.name for r in study.narrow(runs, parse_only(["warmup=off"]))} == {
        r.name for r in runs if r.variant == "post_ln" and r.warmup == "off"}
    with pytest.raises(study.StudyError, match="lr=0.005: not in the grid; choose from 0.0001, 0.001, 0.01"):
        study.narrow(runs, parse_only(["lr=0.005"]))
    with pytest.raises(study.StudyError, match="unknown key 'norm'"):
        parse_only(["norm=rmsnorm"])


def out_dir(cmd) -> Path:
    """The run directory of a study's train.py command: that of the config.yaml it is launched with."""
    return Path(cmd[cmd.index("--config") + 1]).parent


def test_a_run_is_launched_with_its_resolved_config_file(grid, tmp_path):
    from normlab.config.loader import load_config
    from normlab.run_dir import RunDir

    _, g = grid
    run = next(r for r in g.plan.runs() if r.name == "masked_batchnorm-lr0.01-wuon-s1")
    engine = study.LocalEngine(parallel=1)
    job = study.study_job(g.plan, run, tmp_path / "st", ["train.batch_size=8", "train.max_steps=6"], ["python"], engine)
    run_dir = RunDir(tmp_path / "st" / "runs" / run.name)
    assert job.cmd == ["python", "-m", "normlab.train.run", "--config", str(run_dir.config_file)]
    cfg = run_dir.read_config()
    assert cfg == load_config("masked_batchnorm", ["model.bn_momentum=0.2", "train.lr=0.01", "seed=1",
                                                   "train.warmup_steps=10", f"output_dir={run_dir.path}",
                                                   "wandb.group=tiny", "train.resume=auto", "train.batch_size=8",
                                                   "train.max_steps=6", "data.max_train_samples=64",
                                                   "wandb.tags=[tiny,masked_batchnorm,warmup-on,masked_batchnorm]"])
    assert cfg.train.lr == 0.01 and type(cfg.train.lr) is float  # the grid's float, never text
    assert cfg.train.max_steps == 6  # command-line overrides come last and win


class FakeRunner:
    """Stands in for train.py: writes what train.py would, by the run's name."""

    def __init__(self, outcome):
        self.outcome, self.calls = outcome, []

    def __call__(self, job, env):
        assert job.config == job.run_dir / "config.yaml" == out_dir(job.cmd) / "config.yaml"
        self.calls.append(job.run_dir.name)
        outcome = self.outcome(job.run_dir.name)
        if outcome == "raise":
            raise OSError("cannot start")
        if outcome == "crash":
            job.log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
            return 1
        (job.run_dir / "summary.json").write_text(json.dumps({"status": outcome}))
        return 0 if outcome == "completed" else 3


def test_failed_runs_are_recorded_and_reruns_skip_finished_ones(grid, tmp_path):
    grid_file, g = grid
    runs = study.narrow(g.plan.runs(), parse_only(["variant=post_ln,warmup=on,seed=0"]))
    assert [r.name for r in runs] == [f"post_ln-lr{lr}-wuon-s0" for lr in ("0.0001", "0.001", "0.01")]
    study_dir = tmp_path / "st"

    def first_outcome(name):
        return {"0.0001": "completed", "0.001": "crash", "0.01": "diverged"}[name.split("-lr")[1].split("-")[0]]

    runner = FakeRunner(first_outcome)
    statuses = study.run_study(g, study_dir, runs, runner=runner, print_fn=lambda *a: None)
    assert runner.calls == [r.name for r in runs]  # the crash did not stop the study
    assert statuses == {"post_ln-lr0.0001-wuon-s0": "completed", "post_ln-lr0.001-wuon-s0": "failed",
                        "post_ln-lr0.01-wuon-s0": "diverged"}
    record = json.loads((study_dir / "study.json").read_text())
    failed = record["runs"]["post_ln-lr0.001-wuon-s0"]
    assert failed["status"] == "failed" and failed["returncode"] == 1 and "RuntimeError: boom" in failed["error"]
    assert record["runs"]["post_ln-lr0.01-wuon-s0"]["status"] == "diverged"
    assert record["name"] == "tiny" and record["grid_file"] == str(grid_file)
    # the plan is held once, in the spec snapshot beside study.json, not copied into it
    assert (study_dir / "spec.yaml").read_text() == GRID and not {"experiments", "score"} & set(record)

    # the same command again: only the failed run is trained; this time it cannot even start
    runner = FakeRunner(lambda name: "raise")
    statuses = study.run_study(g, study_dir, runs, runner=runner, print_fn=lambda *a: None)
    assert runner.calls == ["post_ln-lr0.001-wuon-s0"]
    record = json.loads((study_dir / "study.json").read_text())
    assert record["runs"]["post_ln-lr0.001-wuon-s0"]["error"] == "OSError: cannot start"
    assert statuses["post_ln-lr0.0001-wuon-s0"] == "completed"

    # and once it succeeds, nothing is left to do
    study.run_study(g, study_dir, runs, runner=FakeRunner(lambda name: "completed"),
                    print_fn=lambda *a: None)
    runner = FakeRunner(lambda name: "completed")
    study.run_study(g, study_dir, runs, runner=runner, print_fn=lambda *a: None)
    assert runner.calls == []
    record = json.loads((study_dir / "study.json").read_text())
    assert {r["status"] for r in record["runs"].values()} == {"completed", "diverged"}
    assert "error" not in record["runs"]["post_ln-lr0.001-wuon-s0"]  # the earlier failure is not carried over


def test_several_gpus_run_one_run_per_gpu_at_a_time(grid, tmp_path, monkeypatch):
    import threading
    import time

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    grid_file, g = grid
    runs = g.plan.runs()[:6]
    busy, seen, lock = set(), [], threading.Lock()

    def runner(job, env):
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            assert gpu not in busy  # never two runs on one GPU
            busy.add(gpu)
            seen.append(gpu)
        time.sleep(0.05)
        with lock:
            busy.discard(gpu)
        (job.run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
        return 0

    statuses = study.run_study(g, tmp_path / "st", runs, runner=runner, parallel=2, gpus=2,
                               print_fn=lambda *a: None)
    assert set(statuses.values()) == {"completed"} and len(statuses) == 6
    assert sorted(set(seen)) == ["0", "1"] and len(seen) == 6


def test_parallel_cpu_runs_split_the_cores(grid, tmp_path, monkeypatch):
    """Two CPU runs at once get half the cores each, as train.cpu_threads (unambiguous under accelerate launch)
    and as OMP_NUM_THREADS for everything else."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)  # the engines split the cores it gives
    from normlab.run_dir import RunDir

    grid_file, g = grid
    seen = []

    def runner(job, env):
        seen.append((RunDir(job.run_dir).read_config().train.cpu_threads, env["OMP_NUM_THREADS"]))
        (job.run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
        return 0

    study.run_study(g, tmp_path / "st", g.plan.runs()[:2], runner=runner, parallel=2, gpus=0,
                    print_fn=lambda *a: None)
    assert seen == [(4, "4")] * 2


def test_cli_dry_run_lists_runs_and_rejects_bad_input(grid, tmp_path, capsys):
    grid_file, _ = grid
    argv = ["--preset", str(grid_file), "--study-dir", str(tmp_path / "st"), "--dry-run"]
    assert study_cli.main(argv + ["--only", "variant=masked_batchnorm,seed=0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("3 runs (3 to train)")
    assert all(line.startswith("train") and "wandb.group=tiny" in line for line in lines[:3])
    assert not (tmp_path / "st").exists()  # a dry run writes nothing
    assert study_cli.main(argv + ["model.nrom=rmsnorm"]) == 2
    assert "unknown config key 'model.nrom'" in capsys.readouterr().err
    assert study_cli.main(["--preset", "nope", "--dry-run"]) == 2
    presets = sorted(p.stem for p in (REPO_ROOT / "configs" / "study").glob("*.yaml"))  # a new one too
    assert {"docs", "quick", "smoke"} <= set(presets)
    assert f"--preset 'nope' not found; choose one of {', '.join(presets)} or give a YAML file path" in \
        capsys.readouterr().err


@pytest.mark.parametrize("preset", ["quick", "full"])
def test_presets_hold_the_designed_experiments(preset):
    """What docs/study-v3/predictions.md promises: every arm swept over >= 4 LRs and >= 1.5 decades, then run at
    its own chosen LR on >= 10 fresh seeds (the primary hypotheses); the A/A arm at LN's LR; placement on a
    quarter-decade grid with warmup on and off and >= 10 seeds; one epoch without repeated rows."""
    g = study.StudySpec.load(resolve_preset(preset))
    common = g.plan.overrides
    tune, board, aa, placement = (g.plan.experiments[k] for k in ("tune", "leaderboard", "aa", "placement"))
    assert len(tune.lr) >= 4 and math.log10(max(tune.lr) / min(tune.lr)) >= 1.5 - 1e-3
    norms = {"ln_pre", "ln_post", "custom_ln", "rmsnorm", "dyt", "batchnorm", "masked_batchnorm", "powernorm",
             "no_norm"}
    assert set(tune.variants) == set(board.variants) == norms
    assert board.best_of == aa.best_of == "tune" and len(board.seeds) >= 10
    assert not set(board.seeds) & set(tune.seeds)  # chosen on some seeds, reported on others
    assert aa.variants["custom_ln_aa"].tune == "ln_pre" and aa.seeds == board.seeds
    assert set(placement.warmup) == {"on", "off"} and placement.warmup["off"] == 0
    assert placement.warmup["on"] >= 1 / (1 - float(common["train.adam_beta2"])) and len(placement.seeds) >= 10
    steps = placement.lr
    assert all(0.2 < math.log10(b / a) < 0.3 for a, b in zip(steps, steps[1:]))  # quarter decades
    assert common["train.epochs"] == 1 and "train.max_steps" not in common and g.plan.share_runs


STAGED = """
name: staged
share_runs: true
overrides: {train.max_steps: 5}
experiments:
  sweep:
    variants: {a: {config: pre_ln}, b: {config: post_ln}}
    lr: [1.0e-3, 1.0e-2]
    warmup: {on: 2}
    seeds: [100]
  final:
    variants: {a: {config: pre_ln}, b: {config: post_ln}, a_half: {config: pre_ln, tune: a, lr_scale: 0.5, seeds: [1]}}
    lr: {best_of: sweep}
    warmup: {on: 2}
    seeds: [0, 1]
  fixed:
    variants: {a: {config: pre_ln}}
    lr: [1.0e-2]
    warmup: {on: 2}
    seeds: [0]
score: {dev_rows: 10}
"""


def test_chosen_lr_experiments_wait_for_their_sweep_and_share_runs(tmp_path, monkeypatch):
    path = tmp_path / "staged.yaml"
    path.write_text(STAGED)
    g = study.StudySpec.load(path)
    first = g.plan.runs()
    assert {r.name for r in first} == {"a-lr0.001-wuon-s100", "a-lr0.01-wuon-s100", "b-lr0.001-wuon-s100",
                                          "b-lr0.01-wuon-s100", "a-lr0.01-wuon-s0"}
    chosen = {"sweep/a/wuon": {"lr": 0.01}, "sweep/b/wuon": {"lr": 0.001}}
    runs = {r.name: r for r in g.plan.runs(chosen)}
    assert runs["a-lr0.01-wuon-s0"].experiments == ["final", "fixed"]  # trained once, used by both
    assert "a_half-lr0.005-wuon-s1" in runs and "b-lr0.001-wuon-s1" in runs and len(runs) == 4 + 5
    assert "a_half-lr0.005-wuon-s0" not in runs  # a variant's own seeds replace the experiment's

    def fake_runner(job, env):
        (job.run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
        return 0

    # dev loss: lower for the LR each arm should get
    monkeypatch.setattr("normlab.study.selection.dev_losses", lambda study_dir, names, score, processes: {
        n: 0.3 if n in ("a-lr0.01-wuon-s100", "b-lr0.001-wuon-s100") else 0.6 for n in names})
    engine = study.LocalEngine(runner=fake_runner)
    study.run_stages(g, tmp_path / "st", {}, [], "cmd", engine)
    sel = json.loads((tmp_path / "st" / "selection.json").read_text())
    assert sel["sweep/a/wuon"]["lr"] == 0.01 and sel["sweep/b/wuon"]["lr"] == 0.001
    assert [(r["lr"], r["dev_loss"]) for r in sel["sweep/a/wuon"]["by_lr"]] == [(0.001, 0.6), (0.01, 0.3)]
    assert sel["sweep/a/wuon"]["by_lr"][1]["runs"] == ["a-lr0.01-wuon-s100"]
    trained = json.loads((tmp_path / "st" / "study.json").read_text())["runs"]
    assert set(trained) == set(runs) and all(r["status"] == "completed" for r in trained.values())
    assert all(r["commit"] and r["machine"] and r["started_at"] for r in trained.values())


def test_experiments_waiting_for_a_sweep_say_so_instead_of_training_nothing_silently(tmp_path, capsys):
    path = tmp_path / "staged.yaml"
    path.write_text(STAGED)
    argv = ["--preset", str(path), "--study-dir", str(tmp_path / "st"), "--dry-run", "--only", "experiment=final"]
    assert study_cli.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("0 runs (0 to train)")
    assert out[-1] == ("study staged: final waits for the LRs that sweep chooses, not chosen yet: train it (--only "
                       f"experiment=sweep), or copy a selection.json that has the choices into {tmp_path / 'st'}")
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "selection.json").write_text(json.dumps({"sweep/a/wuon": {"lr": 0.01},
                                                                "sweep/b/wuon": {"lr": 0.001}}))
    assert study_cli.main(argv) == 0
    assert "waits for" not in capsys.readouterr().out  # chosen: final expands


def test_a_whole_studys_dry_run_says_what_the_lr_choice_will_add_and_the_count_holds(tmp_path, capsys):
    """Before its sweep a whole study's dry run lists the sweep and says that the study itself chooses the LRs and
    then trains up to N more runs (before, it told the user to narrow to the sweep, as a narrowed run is told);
    once the choices are there, the dry run lists those N."""
    st = tmp_path / "st"
    assert study_cli.main(["--preset", "smoke", "--study-dir", str(st), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == f"6 runs (6 to train) in {st}"
    assert out[-1] == ("then, once tune has ended: each arm's LR chosen on the dev split, and up to 12 runs of board "
                       "at those LRs (a dry run lists them after the choice)")
    st.mkdir()
    (st / "selection.json").write_text(json.dumps({f"tune/{arm}/wuon": {"lr": 0.01, "runner_up": 0.00316}
                                                   for arm in ("ln_pre", "rmsnorm", "batchnorm")}))
    assert study_cli.main(["--preset", "smoke", "--study-dir", str(st), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"18 runs (18 to train) in {st}"  # 6 + the 12


def test_an_experiment_before_its_sweep_says_so_and_leaves_a_fresh_folder_untouched(tmp_path, capsys):
    """The documented `--only experiment=board` on a fresh folder, not a dry run: the waiting line and nothing else
    (no "done" line, no traceback), exit 0 (nothing ran, nothing failed), no study folder written."""
    st = tmp_path / "st"
    assert study_cli.main(["--preset", "smoke", "--only", "experiment=board", "--study-dir", str(st)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1:] == [  # after the pilot's floors line, which every load of smoke prints
        "study smoke: board waits for the LRs that tune chooses, not chosen yet: train it (--only experiment=tune), "
        f"or copy a selection.json that has the choices into {st}"]
    assert err == "" and not st.exists()


def test_a_typo_in_only_is_refused_before_the_sweep_has_chosen_too(tmp_path, capsys):
    """Before the LR choice only an `lr` value may name a run still to come: a variant, experiment, warmup or seed
    that the plan does not have is refused in one line (before, it read as a run waiting for its sweep)."""
    st = tmp_path / "st"
    assert study_cli.main(["--preset", "smoke", "--only", "variant=lnpre", "--study-dir", str(st), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == ("study.py: error: --only variant=lnpre: not in the grid; choose from "
                                               "batchnorm, ln_pre, rmsnorm")
    assert study_cli.main(["--preset", "smoke", "--only", "seed=7", "--study-dir", str(st), "--dry-run"]) == 2
    assert "--only seed=7: not in the grid; choose from 0, 1, 100" in capsys.readouterr().err
    # an LR may still be chosen, and a board variant is in the plan: no error
    assert study_cli.main(["--preset", "smoke", "--only", "lr=0.005", "--study-dir", str(st), "--dry-run"]) == 0
    assert study_cli.main(["--preset", "smoke", "--only", "experiment=board,variant=ln_pre", "--study-dir", str(st),
                           "--dry-run"]) == 0


def test_parallel_below_one_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        study_cli.main(["--preset", "smoke", "--parallel", "0", "--dry-run"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "study.py: error: --parallel=0 must be >= 1")


def test_bad_staged_grids_are_refused_in_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(STAGED.replace("lr: {best_of: sweep}", "lr: {best_of: swep}"))
    with pytest.raises(study.StudyError, match="best_of 'swep' is not a swept experiment; choose one of sweep, fixed"):
        study.StudySpec.load(path)
    path.write_text(STAGED.replace("tune: a,", "tune: c,"))
    with pytest.raises(study.StudyError, match="tuned as 'c', which sweep does not train"):
        study.StudySpec.load(path)
    path.write_text(STAGED.replace("fixed:\n    variants: {a: {config: pre_ln}}",
                                   "fixed:\n    variants: {a: {config: dyt}}"))
    with pytest.raises(study.StudyError, match=r"share_runs: variant a .* configured differently in experiments "
                                               r"final and fixed, which share seeds \[0\]"):
        study.StudySpec.load(path)
    path.write_text(STAGED.replace("    seeds: [0]\n", "    seeds: [7]\n").replace(
        "fixed:\n    variants: {a: {config: pre_ln}}", "fixed:\n    variants: {a: {config: dyt}}"))
    assert study.StudySpec.load(path).plan.experiments["fixed"].seeds == [7]  # no seed in common: never one run


def test_experiments_prefix_run_names_and_narrow_by_experiment(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENTS)
    g = study.StudySpec.load(path)
    runs = g.plan.runs()
    assert {r.name for r in runs} == {"a-post_ln-lr0.001-wuoff-s0", "a-post_ln-lr0.01-wuoff-s0",
                                         "b-batchnorm-lr0.001-wuon-s0", "b-batchnorm-lr0.001-wuon-s1"}
    picked = study.narrow(runs, parse_only(["experiment=b"]))
    assert {r.experiment for r in picked} == {"b"} and len(picked) == 2
    run = next(r for r in runs if r.experiment == "b")
    config, settings = study.run_settings(g.plan, run, tmp_path / "st")
    # study overrides, then the experiment's, then the variant's: the later one wins
    assert config == "configs/batchnorm.yaml" and list(settings)[:3] == [
        "train.max_steps", "data.group_by_length", "model.bn_momentum"]
    assert settings["train.warmup_steps"] == 7 and settings["wandb.tags"] == ["exp", "b", "batchnorm", "warmup-on",
                                                                             "batchnorm"]
    cfg = study.run_config(g.plan, run, tmp_path / "st")
    assert (cfg.train.max_steps, cfg.data.group_by_length, cfg.model.bn_momentum) == (5, True, 0.2)


EXPERIMENTS = """
name: exp
overrides: {train.max_steps: 5}
experiments:
  a:
    variants: {post_ln: {config: post_ln}}
    lr: [1.0e-3, 1.0e-2]
    warmup: {off: 0}
    seeds: [0]
  b:
    overrides: {data.group_by_length: true}
    variants: {batchnorm: {config: batchnorm, overrides: {model.bn_momentum: 0.2}}}
    lr: [1.0e-3]
    warmup: {on: 7}
    seeds: [0, 1]
"""


@pytest.mark.parametrize("change, words", [
    (("variants:", "varients:"), ["unknown key 'varients'", "did you mean 'variants'", "valid keys: name,"]),
    (("{config: post_ln}", "{confg: post_ln}"), ["variant post_ln: unknown key 'confg'", "did you mean 'config'"]),
    (("seeds: [0, 1]", "seeds: [0, one]"), ["seeds=[0, 'one'] has the wrong type", "expected list of int"]),
    (("name: tiny", "name: tiny\nshare_runs: maybe"), ["share_runs='maybe' has the wrong type; expected bool"]),
    (("name: tiny", "name: tiny\nsignal: {variants: {a: {}}, seeds: [0], stpes: 2, lr: 1.0e-3, batch_size: 4, "
                    "max_length: 16}"), ["signal: unknown key 'stpes'", "did you mean 'steps'"]),
    (("name: tiny", "name: tiny\nsignal: {variants: {a: {}}, seeds: [0], steps: 2, lr: {best_of: tnue}, "
                    "batch_size: 4, max_length: 16}"), ["signal: lr {'best_of': 'tnue'} must be a number or"]),
])
def test_a_bad_study_file_is_refused_in_one_line_naming_the_key(tmp_path, change, words):
    path = tmp_path / "bad.yaml"
    path.write_text(GRID.replace(*change))
    with pytest.raises(study.StudyError) as err:
        study.StudySpec.load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_a_run_directory_left_with_other_settings_is_refused_not_overwritten(grid, tmp_path):
    _, g = grid
    run = g.plan.runs()[0]
    engine = study.LocalEngine(parallel=1)
    job = study.study_job(g.plan, run, tmp_path / "st", [], ["python"], engine)
    config = out_dir(job.cmd) / "config.yaml"
    study.study_job(g.plan, run, tmp_path / "st", ["train.eval_steps=3"], ["python"], engine)  # a resume may change it
    with pytest.raises(study.StudyError, match="holds a run with other settings .*train.batch_size"):
        study.study_job(g.plan, run, tmp_path / "st", ["train.batch_size=8"], ["python"], engine)
    assert "eval_steps: 3" in config.read_text() and "batch_size: 8" not in config.read_text()


@pytest.mark.parametrize("text,words", [("1/2", None), ("2/2", "K must be at least 0 and below N"),
                                        ("half", "is not K/N")])
def test_the_sharded_commands_read_shard_as_k_of_n(text, words, capsys):
    """E1, the dev losses and the scoring share one --shard option (normlab/study/sharded.py)."""
    import argparse

    from normlab.study.sharded import add_shard_options

    parser = argparse.ArgumentParser(prog="score_runs.py")
    add_shard_options(parser, "score", "runs.jsonl")
    if words is None:
        assert parser.parse_args(["--shard", text]).shard == (1, 2) and parser.parse_args([]).shard == (0, 1)
        return
    with pytest.raises(SystemExit):
        parser.parse_args(["--shard", text])
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("score_runs.py: error: argument --shard: ") and words in line


@pytest.mark.parametrize("typed, recorded", [
    (["python", "scripts/study.py", "--preset", "smoke"], "python scripts/study.py --preset smoke"),
    (["python", "-m", "normlab.cli.study", "--preset", "smoke"], "python -m normlab.cli.study --preset smoke"),
    (["/venv/bin/python", "/venv/bin/normlab-study", "--preset", "smoke"], "normlab-study --preset smoke"),
])
def test_the_invocation_is_recorded_as_it_was_typed(monkeypatch, typed, recorded):
    """study.json and meta.json keep the command a person can run again: the one they typed, not always the
    script's (a study started with `python -m normlab.cli.study` was recorded as `python scripts/study.py`)."""
    monkeypatch.setattr(sys, "orig_argv", typed)
    assert study_cli.typed_command() == recorded
    assert study_cli.typed_command(["--preset", "smoke"]) == "python scripts/study.py --preset smoke"


def test_a_report_that_cannot_be_written_after_training_is_one_line_and_the_records_stay(tmp_path, monkeypatch, capsys):
    """The report is a function call after scoring: its refusal (here the records cannot join a folder) is said in
    report.py's one line, as when it ran as its own command, and what scoring wrote is left in place."""
    from normlab.errors import RecordsError
    from normlab.study import report

    monkeypatch.setattr(study, "run_sharded", lambda *args, **kwargs: (tmp_path / "runs.jsonl").write_text("{}\n"))

    def refuse(folder):
        raise RecordsError(f"{folder}: run a measured\nsomething else")

    monkeypatch.setattr(report, "make_report", refuse)
    (tmp_path / "scored.yaml").write_text(GRID + "score: {dev_rows: 10}\n")
    scored = study.StudySpec.load(tmp_path / "scored.yaml", quiet=True)
    study.after_training(scored, tmp_path, report=True)
    assert capsys.readouterr().err == f"report.py: error: {tmp_path}: run a measured something else\n"
    assert (tmp_path / "runs.jsonl").read_text() == "{}\n"
