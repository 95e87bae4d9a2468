"""Nothing is lost, nothing is a puzzle: SIGTERM saves and exits cleanly (under `accelerate launch` too, whoever
gets the signal), a `kill -9` run resumes to bitwise the same weights, checkpoints are atomic and a damaged one is
named, divergence is a status, the same seed gives the same losses, and bad input is one line on stderr with nothing
deleted."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from train_utils import (
    REFERENCE,
    REPO,
    accelerate_cmd,
    assert_same_weights,
    env,
    final_weights,
    losses,
    python_cmd,
    rows,
    run_argv,
    run_cmd,
    run_here,
    summary,
    terminal_signals,
)

pytestmark = pytest.mark.slow  # killed and resumed training runs in subprocesses

# Resumed runs are compared with the `reference` fixture's uninterrupted run (conftest.py; train_utils.REFERENCE).
# Dropout is on (RNG state restored on resume).


def start(out, *overrides) -> subprocess.Popen:
    return subprocess.Popen(python_cmd(out, *overrides), cwd=Path(__file__).resolve().parent.parent, env=env(),
                            preexec_fn=terminal_signals, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_step(proc, out, step, timeout=180) -> int:
    """Block until metrics.jsonl has a training row at `step` or later; return the last step seen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"run ended early: {proc.stderr.read()[-2000:]}"
        try:
            done = max((s for s, _ in losses(out)), default=0)
        except (OSError, ValueError):  # not there yet, or a line being written
            done = 0
        if done >= step:
            return done
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout}s")


def test_same_seed_same_losses(reference, tmp_path):
    assert run_here(tmp_path / "again", *REFERENCE) == 0
    assert losses(tmp_path / "again") == losses(reference)
    assert_same_weights(final_weights(tmp_path / "again"), final_weights(reference))


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_has_the_same_losses(reference, tmp_path):
    out = tmp_path / "run"
    proc = start(out, *REFERENCE)
    wait_for_step(proc, out, 6)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    s = summary(out)
    assert s["status"] == "interrupted" and 6 <= s["step"] < 40
    assert s["last_checkpoint"].endswith(f"step_{s['step']}") and Path(s["last_checkpoint"]).is_dir()
    assert not (out / "final").exists()  # final/ only for a completed run

    assert run_here(out, *REFERENCE, "train.resume=auto") == 0
    assert summary(out)["status"] == "completed"
    assert losses(out) == losses(reference)  # metrics.jsonl rewound to the checkpoint, then the same losses
    assert [r for r in rows(out) if "eval/loss" in r] == [r for r in rows(reference) if "eval/loss" in r]
    assert_same_weights(final_weights(out), final_weights(reference))


# (who gets the signal, which one, the launcher's exit status, overrides). accelerate's single-process launcher
# answers a SIGTERM or SIGINT of its own with a SIGTERM to train.py and to every process under it, W&B's service
# process included, and a SIGKILL 5 s later: train.py must take that SIGTERM as the same request, not as a second
# one that aborts, and go on to its checkpoint without W&B.
LAUNCHED_STOPS = [
    # the launcher's SIGTERM is the only one train.py gets; W&B on, as in the default run (offline here)
    ("launcher", signal.SIGTERM, 128 + signal.SIGTERM, ["wandb.mode=offline"]),
    ("training process", signal.SIGTERM, 0, []),
    ("group", signal.SIGTERM, 128 + signal.SIGTERM, []),  # `timeout`, a scheduler: train.py gets two
    ("group", signal.SIGINT, 128 + signal.SIGINT, []),  # Ctrl-C: train.py gets SIGINT, then the launcher's SIGTERM
]


@pytest.mark.parametrize("target,signum,launcher_status,overrides", LAUNCHED_STOPS,
                         ids=["launcher-term-wandb", "child-term", "group-term", "group-int"])
def test_a_stop_under_accelerate_launch_saves_and_the_resumed_run_has_the_same_losses(
        reference, tmp_path, target, signum, launcher_status, overrides):
    import psutil

    out = tmp_path / "run"
    # a process group of its own, as a job's: the group's signal reaches the launcher and train.py, not pytest
    proc = subprocess.Popen(accelerate_cmd(out, *REFERENCE, *overrides), cwd=REPO, env=env(),
                            start_new_session=True, preexec_fn=terminal_signals, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(proc, out, 6)
        trainer = psutil.Process(proc.pid).children()[0].pid  # train.py, which the launcher started
        {"launcher": lambda: os.kill(proc.pid, signum), "training process": lambda: os.kill(trainer, signum),
         "group": lambda: os.killpg(proc.pid, signum)}[target]()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == launcher_status and "Traceback" not in err, err[-3000:]
    s = summary(out)
    assert s["status"] == "interrupted" and 6 <= s["step"] < 40
    assert s["last_checkpoint"].endswith(f"step_{s['step']}") and Path(s["last_checkpoint"]).is_dir()

    assert run_argv(f"output_dir={out}", "train.resume=auto") == 0  # the command the continue line gives
    assert summary(out)["status"] == "completed"
    assert losses(out) == losses(reference)
    assert_same_weights(final_weights(out), final_weights(reference))


def test_kill_9_then_resume_gives_bitwise_equal_weights(reference, tmp_path):
    out = tmp_path / "run"
    proc = start(out, *REFERENCE)
    wait_for_step(proc, out, 23)  # past the step-20 checkpoint, mid second epoch
    proc.kill()
    proc.wait(timeout=60)
    assert not (out / "summary.json").exists()

    # the command the README gives: the run's config (TINY and REFERENCE's overrides) comes from its directory
    assert run_argv(f"output_dir={out}", "train.resume=auto") == 0
    assert summary(out)["status"] == "completed"
    assert_same_weights(final_weights(out), final_weights(reference))
    assert losses(out) == losses(reference)


def test_mlm_resume_from_a_mid_epoch_checkpoint_is_bitwise(tmp_path):
    """MLM draws its masks in the data collator, from the same RNG as dropout: resume must reproduce both."""
    mlm = ["task=mlm", "train.max_steps=30", "train.save_steps=10", "train.eval_steps=100"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert run_here(ref, *mlm) == 0
    shutil.copytree(ref, out)  # as if the run had stopped right after its step-10 checkpoint (mid first epoch)
    for ckpt in (out / "checkpoints").iterdir():
        if ckpt.name != "step_10":
            shutil.rmtree(ckpt)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    assert run_here(out, *mlm, "train.resume=auto") == 0
    assert losses(out) == losses(ref)
    assert_same_weights(final_weights(out), final_weights(ref))


def test_damaged_checkpoints_are_named_and_skipped(reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()  # pretend the run stopped after its step-40 checkpoint...
    shutil.rmtree(out / "final")
    ckpt = out / "checkpoints" / "step_40"
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # ...and that checkpoint was damaged
    (out / "checkpoints" / ".tmp-step_50").mkdir()  # a kill during a save leaves this: never read

    assert run_here(out, *REFERENCE, f"train.resume={ckpt}") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(ckpt) in err and "corrupted" in err
    assert weights.stat().st_size == 1000  # nothing deleted or rewritten

    # auto skips the damaged newest checkpoint (saying so) and continues from step 30 to the same weights
    assert run_here(out, *REFERENCE, "train.resume=auto") == 0
    assert "skipping checkpoint" in capsys.readouterr().err
    assert_same_weights(final_weights(out), final_weights(reference))
    assert not (out / "checkpoints" / ".tmp-step_50").exists()


def _junk(path):
    path.write_text("{not json")


# (a file of the checkpoint, how it is damaged, what the one-line error says)
DAMAGE = [
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:1000]), "corrupted: model.safetensors has 1000"),
    ("config.json", _junk, "corrupted: config.json has 9 bytes"),
    ("tokenizer.json", Path.unlink, "incomplete: tokenizer.json is missing"),
]


@pytest.mark.parametrize("name,damage,words", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_resuming_from_a_damaged_checkpoint_names_the_file(reference, tmp_path, capsys, name, damage, words):
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("final", "summary.json"))
    ckpt = out / "checkpoints" / "step_40"
    damage(ckpt / name)
    assert run_argv(f"output_dir={out}", f"train.resume={ckpt}") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: checkpoint {ckpt} is {words}"), err
    assert "resume from an earlier checkpoint" in err


def test_the_best_evaluations_checkpoint_is_kept_whatever_save_total_limit_says(tmp_path, capsys):
    out = tmp_path / "run"
    # evaluations and checkpoints every 4 steps, and only 1 kept; this post-LN run's best evaluation is at step 4
    # (0.604, then 0.396 at step 12), two checkpoints before the last
    assert run_here(out, "--config", "post_ln", "train.max_steps=12", "train.eval_steps=4", "train.save_steps=4",
                    "train.save_total_limit=1") == 0
    s = summary(out)
    evals = [r for r in rows(out) if "eval/accuracy" in r]
    best = max(evals, key=lambda r: r["eval/accuracy"])  # the first of the best: a tie is no better
    assert s["best"]["step"] == best["step"] < 12 and best["eval/accuracy"] > s["final"]["eval/accuracy"], evals
    assert s["best_checkpoint"] == str(out / "checkpoints" / f"step_{best['step']}")
    assert {p.name for p in (out / "checkpoints").iterdir()} == {f"step_{best['step']}", "step_12"}
    assert f"best:   {s['best_checkpoint']} (step {best['step']})" in capsys.readouterr().out


def test_divergence_is_a_status_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    # lr 1e30, no warmup: the first update blows the weights up, the next forward overflows
    assert run_here(out, "train.lr=1e30", "train.warmup_steps=0", "train.max_steps=20", "train.save_steps=1") == 0
    s = summary(out)
    assert s["status"] == "diverged" and s["step"] < 20
    assert s["last_checkpoint"].endswith(f"step_{s['step']}") and Path(s["last_checkpoint"]).is_dir()
    assert not (out / "final").exists()
    last = rows(out)[-1]
    assert last["events/nonfinite"] == 1 and last["step"] == s["step"] + 1


def test_bad_input_is_one_line_and_deletes_nothing(reference, tmp_path, capsys):
    # from the command line: one line on stderr, exit 2, no traceback, before any data is loaded
    result = run_cmd(python_cmd(tmp_path / "x", "model.nrom=rmsnorm"), timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.strip().count("\n") == 0
    assert "model.nrom" in result.stderr and "norm" in result.stderr
    assert not (tmp_path / "x").exists()

    # --debug shows the traceback
    with pytest.raises(ValueError):
        from normlab.train import run as train

        train.main([f"output_dir={tmp_path / 'x'}", "train.lr=-1", "--debug"])

    # a missing data path
    assert run_here(tmp_path / "y", "data.path=/nonexistent/sst2.parquet") == 2
    assert "/nonexistent/sst2.parquet" in capsys.readouterr().err

    # an output_dir holding a finished run of another config: refused, nothing touched
    before = {p: p.stat().st_mtime_ns for p in reference.rglob("*")}
    assert run_here(reference, *REFERENCE, "train.lr=1e-4") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "train.lr" in err and "output_dir" in err
    assert {p: p.stat().st_mtime_ns for p in reference.rglob("*")} == before
    # ...and the same config without train.resume is refused too (never overwritten)
    assert run_here(reference, *REFERENCE) == 2
    err = capsys.readouterr().err
    assert "finished run" in err and f"output_dir={reference}-2" in err and "train.resume=auto" in err
    assert "train.max_steps" in err  # continuing a finished run means training it further


def test_resume_auto_of_a_typod_output_dir_is_refused_naming_the_run_beside_it(reference, capsys):
    """Never a new full run in place of a resume (HF's Trainer raises too): one line, exit 2, nothing written."""
    typo = reference.with_name(reference.name + "s")
    capsys.readouterr()
    assert run_argv(f"output_dir={typo}", "train.resume=auto") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: train.resume=auto: nothing to resume in output_dir={typo}")
    assert f"run directories nearby: {reference}" in err and "train.resume=null" in err
    assert not typo.exists()


def _write_csv(path, rows_, header="sentence,label"):
    path.write_text("\n".join([header, *rows_]) + "\n")
    return path


GOOD_ROWS = [f"a fine sentence number {i},{i % 2}" for i in range(30)]

# (what is wrong, how to make the data file or None, extra overrides, words the one-line error must contain)
BAD_INPUTS = [
    ("unknown value", None, ["model.norm=layrnorm"], ["model.norm", "layernorm"]),
    ("max_length beyond positions", None, ["data.max_length=200"], ["max_length", "max_position_embeddings"]),
    ("empty dataset", lambda p: _write_csv(p, []), [], ["empty"]),
    ("empty text rows", lambda p: _write_csv(p, GOOD_ROWS + [",1", ",0"]), [], ["sentence", "empty"]),
    ("labels out of range", lambda p: _write_csv(p, GOOD_ROWS + ["one more,7"]), ["data.num_labels=2"], ["label", "7"]),
    ("labels missing", lambda p: _write_csv(p, [f"text {i}" for i in range(30)], header="sentence"), [], ["label"]),
    ("text not text", lambda p: _write_csv(p, [f"{i},{i % 2}" for i in range(30)]), [], ["sentence", "text"]),
]


@pytest.mark.parametrize("case,make_data,overrides,words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_each_bad_input_is_one_named_line(case, make_data, overrides, words, tmp_path, capsys):
    """Through train.main: exit 2, one `error:` line naming the problem, nothing deleted."""
    keep = tmp_path / "keep.txt"
    keep.write_text("a user's file")
    if make_data is not None:
        overrides = [f"data.path={make_data(tmp_path / 'data.csv')}", *overrides]
    assert run_here(tmp_path / "run", *overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for word in words:
        assert word.lower() in err[0].lower(), (word, err[0])
    assert keep.read_text() == "a user's file"
    assert not (tmp_path / "run" / "final").exists()
