"""The lines train.py prints when a run ends (normlab/train/run_summary.py), alone and at the end of a real tiny run."""

import json

import pytest

from normlab.train.run_summary import format_summary, tokens_per_s
from train_utils import run_here

COMPLETED = {"status": "completed", "step": 2105, "total_steps": 2105, "wall_time_s": 67.4,
             "final": {"eval/loss": 0.4399, "eval/accuracy": 0.8096},
             "best": {"step": 2000, "eval/accuracy": 0.8119, "eval/loss": 0.45},
             "final_model": "runs/default/final", "last_checkpoint": "runs/default/checkpoints/step_2105",
             "wandb_run_id": "ab12cd34"}


def _run_dir(tmp_path, rates=(1000.0, 14671.0, 15000.0)):
    out = tmp_path / "default"
    (out / "wandb" / "offline-run-20260101_000000-ab12cd34").mkdir(parents=True)
    (out / "wandb" / "offline-run-20260102_000000-ab12cd34").mkdir()  # resumed later: a second part
    (out / "wandb" / "offline-run-20260103_000000-ef56ab78").mkdir()  # another run's (evaluate.py --wandb)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "train/tokens_per_s": r}) + "\n"
                                               for i, r in enumerate(rates)))
    return out


def test_completed_run_names_accuracy_time_model_and_wandb(tmp_path):
    out = _run_dir(tmp_path)
    text = format_summary(COMPLETED, out, "validation", wandb_mode="offline")
    first, model, _best, wandb, charts, compare = text.splitlines()
    assert first == ("completed in 67 s (14,671 tokens/s): validation accuracy 0.810 (best 0.812 at step 2000), "
                     "loss 0.440")
    assert "runs/default/final" in model and f"python scripts/evaluate.py {out}" in model
    # one folder and one sync for the whole run: wandb syncs the parts of a resumed run in order
    assert wandb == (f"  W&B:    {out / 'wandb'} (offline run ab12cd34, 2 parts: it was resumed)    upload: "
                     f"wandb sync {out / 'wandb'}")
    assert f"python scripts/wandb_charts.py {out}" in charts
    assert compare.startswith(f"  compare: normlab-compare {out} OTHER_RUN ...") and "scripts/compare.py" in compare


def test_the_best_checkpoint_is_named_when_it_beat_the_final_one(tmp_path):
    best = "runs/default/checkpoints/step_2000"
    lines = format_summary({**COMPLETED, "best_checkpoint": best}, _run_dir(tmp_path), "validation").splitlines()
    assert lines[2] == f"  best:   {best} (step 2000)    evaluate: python scripts/evaluate.py {best}"
    final_best = {**COMPLETED, "best": {"step": 2105, "eval/accuracy": 0.8096}, "best_checkpoint": best}
    assert "best:" not in format_summary(final_best, _run_dir(tmp_path / "b"), "validation")
    unsaved = format_summary(COMPLETED, _run_dir(tmp_path / "c"), "validation").splitlines()  # eval off save steps
    assert unsaved[2].startswith("  best:   step 2000 has no checkpoint") and "train.eval_steps" in unsaved[2]


def test_best_is_not_repeated_when_the_final_step_is_the_best(tmp_path):
    s = {**COMPLETED, "best": {"step": 2105, "eval/accuracy": 0.8096}}
    assert "best" not in format_summary(s, _run_dir(tmp_path), "validation").splitlines()[0]
    tie = {**COMPLETED, "best": {"step": 1500, "eval/accuracy": COMPLETED["final"]["eval/accuracy"]}}
    assert "best" not in format_summary(tie, _run_dir(tmp_path / "tie"), "validation").splitlines()[0]


def test_interrupted_and_diverged_runs_say_what_to_do(tmp_path):
    out = _run_dir(tmp_path)
    base = {**COMPLETED, "final_model": None, "wandb_run_id": None, "step": 700}
    interrupted = format_summary({**base, "status": "interrupted"}, out, "validation")
    assert interrupted.startswith("interrupted at step 700 of 2105 in 67 s")
    assert f"continue: python train.py output_dir={out} train.resume=auto" in interrupted
    two = format_summary({**base, "status": "interrupted", "num_processes": 2}, out, "validation")
    assert f"continue: accelerate launch --num_processes 2 train.py output_dir={out} train.resume=auto" in two
    diverged = format_summary({**base, "status": "diverged", "final": None, "best": None}, out, "validation")
    assert diverged.startswith("diverged at step 700 of 2105") and "train.lr" in diverged


def test_throughput_is_the_median_of_the_logged_rates(tmp_path):
    assert tokens_per_s(_run_dir(tmp_path, rates=(10.0, 500.0, 700.0, 20000.0)) / "metrics.jsonl") == 600.0
    assert tokens_per_s(tmp_path / "nothing.jsonl") is None


def test_a_real_run_ends_with_the_summary_and_names_its_labels(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_here(out, "train.max_steps=6", "train.eval_steps=3", "train.kernels=reference",
                    "wandb.mode=offline", "wandb.log_model=false") == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()[-5:]
    # stderr is not a terminal here: no progress bar redraws (carriage returns), neither ours nor transformers'
    assert "\r" not in captured.err + captured.out and "Writing model shards" not in captured.err
    assert "step 3: eval/loss" in captured.out  # the evaluations still say how far it is
    progress = [line for line in captured.err.splitlines() if line.startswith("train: step ")]
    assert progress[-1].startswith("train: step 6/6 (100%), ") and " left, " in progress[-1]  # and where it ends
    assert lines[0].startswith("completed in ") and "tokens/s): validation accuracy " in lines[0]
    assert f"model:  {out / 'final'}" in lines[1]
    assert f"wandb sync {out / 'wandb'}" in lines[2]
    assert lines[4] == f"  compare: normlab-compare {out} OTHER_RUN ...    (compare.png, metrics side by side; or " \
                       f"python scripts/compare.py)"
    # SST-2's classes by name (data.label_names): config.json, the model card and a pipeline's output
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert "Labels: 0 = negative, 1 = positive." in (out / "final" / "README.md").read_text()
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(out / "final"), trust_remote_code=True, device="cpu")
    assert classify("a gorgeous film")[0]["label"] in ("negative", "positive")


def test_a_short_run_warms_up_and_evaluates_in_proportion_to_its_length(tmp_path, capsys):
    """With the defaults' warmup_ratio (0.095) and eval_count (4), a 20-step run warms up for ceil(1.9) = 2 steps
    (HF's linear schedule: the LR each step used is lr * min(s / 2, (20 - s) / 18) at s = step - 1) and
    evaluates every 5 steps, where the constants gave 200 steps of warmup and one evaluation at the end."""
    from train_utils import rows, summary

    out = tmp_path / "run"
    assert run_here(out, "train.warmup_steps=null", "train.max_steps=20", "train.kernels=reference") == 0
    capsys.readouterr()
    lr = 2e-3  # train_utils.TINY's
    logged = [r for r in rows(out) if "train/lr" in r]
    expected = [lr * min(s / 2, (20 - s) / 18) for s in range(20)]
    assert [r["train/lr"] for r in logged] == pytest.approx(expected)
    assert [r["step"] for r in rows(out) if "eval/accuracy" in r] == [5, 10, 15, 20]
    assert summary(out)["status"] == "completed"


def test_the_model_cards_best_line_is_readable():
    from normlab.config.loader import load_config
    from normlab.tracking.model_card import model_card

    card = model_card(load_config(), {**COMPLETED, "loss_spikes": 0}, {0: "negative", 1: "positive"})
    assert ("Best evaluation (highest accuracy): step 2000: eval/accuracy 0.8119, eval/loss 0.4500. Loss spikes "
            "during training:\n0.") in card
    assert "{" not in card.split("## Results")[1].split("## Config")[0]  # no Python dict in the results
    no_eval = model_card(load_config(), {**COMPLETED, "best": None})
    assert "Best evaluation (highest accuracy): no evaluation." in no_eval


def test_progress_bars_show_on_a_terminal_only():
    import io

    from transformers.utils import logging as hf_logging

    from normlab.train.progress_bars import bars_on

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    hf_logging.enable_progress_bar()
    try:
        assert bars_on(Terminal()) and hf_logging.is_progress_bar_enabled()
        assert not bars_on(io.StringIO()) and not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_the_kernel_build_is_said_apart_from_the_runs_time(tmp_path):
    built = format_summary({**COMPLETED, "wall_time_s": 206.6, "kernel_build_s": 139.2}, _run_dir(tmp_path),
                           "validation").splitlines()[0]
    assert built.startswith("completed in 67 s (14,671 tokens/s), after 139 s building the C++ kernels (once: "
                            "later runs load them): validation accuracy 0.810")
    cached = format_summary({**COMPLETED, "kernel_build_s": 0.0}, _run_dir(tmp_path / "b"), "validation")
    assert cached.startswith("completed in 67 s (14,671 tokens/s): ") and "building" not in cached


def test_a_log_gets_a_progress_line_at_a_steady_interval():
    """Redirected (not a terminal), the loop's progress is one plain line every `every` seconds (a fake clock
    here), tqdm's numbers without carriage returns; close() adds the last step's line if it was not shown."""
    import io

    from normlab.train.progress_bars import ProgressLines, step_progress

    now, log = [0.0], io.StringIO()
    progress = ProgressLines(total=100, initial=10, every=30.0, stream=log, clock=lambda: now[0])  # resumed at 10
    for step in range(11, 101):
        now[0] += 1.0
        progress.set_postfix(loss=f"{1 / step:.4f}")
        progress.update(1)
    progress.close()
    assert log.getvalue().splitlines() == [
        "train: step 40/100 (40%), 00:30 elapsed, 01:00 left, 1.00step/s, loss 0.0250",
        "train: step 70/100 (70%), 01:00 elapsed, 00:30 left, 1.00step/s, loss 0.0143",
        "train: step 100/100 (100%), 01:30 elapsed, 00:00 left, 1.00step/s, loss 0.0100"]
    now, log = [0.0], io.StringIO()
    short = ProgressLines(total=10, every=30.0, stream=log, clock=lambda: now[0])
    for _ in range(5):
        now[0] += 2.0
        short.update(1)
    short.write("step 5: eval/loss 0.5", file=log)  # as tqdm.write: a line of its own
    short.close()  # interrupted at step 5
    assert log.getvalue() == ("step 5: eval/loss 0.5\n"  # and tqdm inverts a slow rate
                              "train: step 5/10 (50%), 00:10 elapsed, 00:10 left, 2.00s/step\n")
    assert isinstance(step_progress(10, 0, speaks=True, stream=io.StringIO()), ProgressLines)
    assert step_progress(10, 0, speaks=False, stream=io.StringIO()).disable  # a silent tqdm on other processes
