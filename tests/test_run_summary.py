"""The lines train.py prints when a run ends (normlab/train/run_summary.py), alone and at the end of a real tiny run."""

import json

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
    first, model, _best, wandb, charts = text.splitlines()
    assert first == ("completed in 67 s (14,671 tokens/s): validation accuracy 0.810 (best 0.812 at step 2000), "
                     "loss 0.440")
    assert "runs/default/final" in model and f"python scripts/evaluate.py {out}" in model
    # one folder and one sync for the whole run: wandb syncs the parts of a resumed run in order
    assert wandb == (f"  W&B:    {out / 'wandb'} (offline run ab12cd34, 2 parts: it was resumed)    upload: "
                     f"wandb sync {out / 'wandb'}")
    assert f"python scripts/wandb_charts.py {out}" in charts


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
    lines = captured.out.strip().splitlines()[-4:]
    # stderr is not a terminal here: no progress bar redraws (carriage returns), neither ours nor transformers'
    assert "\r" not in captured.err + captured.out and "Writing model shards" not in captured.err
    assert "step 3: eval/loss" in captured.out  # the evaluations still say how far it is
    assert lines[0].startswith("completed in ") and "tokens/s): validation accuracy " in lines[0]
    assert f"model:  {out / 'final'}" in lines[1]
    assert f"wandb sync {out / 'wandb'}" in lines[2]
    # SST-2's classes by name (data.label_names): config.json, the model card and a pipeline's output
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert "Labels: 0 = negative, 1 = positive." in (out / "final" / "README.md").read_text()
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(out / "final"), trust_remote_code=True, device="cpu")
    assert classify("a gorgeous film")[0]["label"] in ("negative", "positive")


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
