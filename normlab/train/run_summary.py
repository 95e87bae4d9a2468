"""The few lines train.py prints when a run ends: how it ended, how long it took, its accuracy, and where its
model and W&B run are, each with the command a user runs next. Built from summary.json, metrics.jsonl and the
run directory alone, so it says only what the run directory holds."""

import shlex
import statistics

from normlab.files.formats import read_jsonl
from normlab.run_dir import RunDir


def tokens_per_s(metrics_path=None, rows=None) -> float | None:
    """The median of the logged train/tokens_per_s (the median: the first steps' warm-up does not count), from
    metrics.jsonl or its rows where the caller has read them; None without rows."""
    rows = read_jsonl(metrics_path) if rows is None else rows
    rates = [r["train/tokens_per_s"] for r in rows if isinstance(r.get("train/tokens_per_s"), (int, float))]
    return statistics.median(rates) if rates else None


def _q(path) -> str:
    return shlex.quote(str(path))


def resume_command(out_dir, num_processes: int = 1) -> str:
    """The command that continues the run in `out_dir`: its config comes from the run directory (train.py
    restores it), so output_dir is all it takes; a run of several processes resumes with as many."""
    launcher = (f"accelerate launch --num_processes {num_processes} train.py" if num_processes > 1
                else "python train.py")
    return f"{launcher} output_dir={_q(out_dir)} train.resume=auto"


def best_key(metrics: dict) -> str:
    """The metric that picks a run's best evaluation: dev accuracy when dev rows are held out (data.dev_rows), so
    that the best eval/accuracy is not chosen on the split it reports; else eval accuracy."""
    return "dev/accuracy" if "dev/accuracy" in metrics else "eval/accuracy"


def better_best(summary: dict) -> bool:
    """Whether an earlier evaluation beat the final one: only that is news (a tie kept from an earlier step is
    not)."""
    final, best = summary.get("final") or {}, summary.get("best") or {}
    key = best_key(final)
    return bool(best) and key in final and best.get("step") != summary["step"] and best[key] > final[key]


def headline(summary: dict, eval_split: str, rate: float | None) -> str:
    """'completed in 67 s (14,671 tokens/s): validation accuracy 0.810 (best 0.812 at step 2000), loss 0.440'; the
    time is the run's without the C++ kernels' build, which is said apart when this run had to build them."""
    status, step = summary["status"], summary["step"]
    where = "" if status == "completed" else f" at step {step} of {summary['total_steps']}"
    building = summary.get("kernel_build_s") or 0.0
    line = f"{status}{where} in {summary['wall_time_s'] - building:.0f} s"
    if rate is not None:
        line += f" ({rate:,.0f} tokens/s)"
    if building >= 0.5:
        line += f", after {building:.0f} s building the C++ kernels (once: later runs load them)"
    final, best = summary.get("final") or {}, summary.get("best") or {}
    if "eval/accuracy" in final:
        line += f": {eval_split} accuracy {final['eval/accuracy']:.3f}"
        if better_best(summary):
            on_dev = f", chosen on dev accuracy {best['dev/accuracy']:.3f}" if "dev/accuracy" in best else ""
            line += f" (best {best['eval/accuracy']:.3f} at step {best['step']}{on_dev})"
        if "eval/loss" in final:
            line += f", loss {final['eval/loss']:.3f}"
    elif "eval/loss" in final:
        line += f": {eval_split} loss {final['eval/loss']:.3f}"
    return line


def format_summary(summary: dict, out_dir, eval_split: str, wandb_mode: str | None = None,
                   wandb_url: str | None = None) -> str:
    """The end-of-run lines for `summary` (summary.json's content) of the run in `out_dir`."""
    run_dir = RunDir(out_dir)
    out = run_dir.path
    lines = [headline(summary, eval_split, tokens_per_s(run_dir.metrics_file))]
    if summary.get("final_model"):
        lines.append(f"  model:  {summary['final_model']}    evaluate: python scripts/evaluate.py {_q(out)}")
    if better_best(summary) and summary["status"] == "completed":
        lines.append(f"  best:   {summary['best_checkpoint']} (step {summary['best']['step']})    evaluate: "
                     f"python scripts/evaluate.py {_q(summary['best_checkpoint'])}" if summary.get("best_checkpoint")
                     else f"  best:   step {summary['best']['step']} has no checkpoint (checkpoints every "
                          f"train.save_steps: make it a multiple of train.eval_steps to keep the best one)")
    elif summary["status"] == "interrupted":
        lines.append(f"  state:  {summary['last_checkpoint']}    continue: "
                     f"{resume_command(out, summary.get('num_processes') or 1)}")
    elif summary["status"] == "diverged":
        lines.append(f"  state:  {summary['last_checkpoint'] or 'no checkpoint'} (before the non-finite step); "
                     f"no final/ model: try a lower train.lr or more train.warmup_steps")
    if summary.get("wandb_run_id"):
        run_id = summary["wandb_run_id"]
        parts = sorted(run_dir.wandb_dir.glob(f"offline-run-*-{run_id}")) if wandb_mode == "offline" else []
        if parts:  # one folder per process that ran (a resumed run has several); one sync uploads them in order
            resumed = f", {len(parts)} parts: it was resumed" if len(parts) > 1 else ""
            lines.append(f"  W&B:    {run_dir.wandb_dir} (offline run {run_id}{resumed})    upload: "
                         f"wandb sync {_q(run_dir.wandb_dir)}")
            lines.append(f"  charts: python scripts/wandb_charts.py {_q(out)}    (depth charts, drawn locally)")
        elif wandb_url:
            lines.append(f"  W&B:    {wandb_url}")
    if run_dir.metrics_file.is_file():
        lines.append(f"  compare: normlab-compare {_q(out)} OTHER_RUN ...    (compare.png, metrics side by side; or "
                     f"python scripts/compare.py)")
    return "\n".join(lines)

