"""The few lines train.py prints when a run ends: how it ended, how long it took, its accuracy, and where its
model and W&B run are, each with the command a user runs next. Built from summary.json, metrics.jsonl and the
run directory alone, so it says only what the run directory holds."""

import shlex
import statistics
from pathlib import Path

from common.io import read_jsonl


def tokens_per_s(metrics_path) -> float | None:
    """The median of the logged train/tokens_per_s (the median: the first steps' warm-up does not count); None
    without rows."""
    rates = [r["train/tokens_per_s"] for r in read_jsonl(metrics_path)
             if isinstance(r.get("train/tokens_per_s"), (int, float))]
    return statistics.median(rates) if rates else None


def _q(path) -> str:
    return shlex.quote(str(path))


def headline(summary: dict, eval_split: str, rate: float | None) -> str:
    """'completed in 67 s (14,671 tokens/s): validation accuracy 0.810 (best 0.812 at step 2000), loss 0.440'."""
    status, step = summary["status"], summary["step"]
    where = "" if status == "completed" else f" at step {step} of {summary['total_steps']}"
    line = f"{status}{where} in {summary['wall_time_s']:.0f} s"
    if rate is not None:
        line += f" ({rate:,.0f} tokens/s)"
    final, best = summary.get("final") or {}, summary.get("best") or {}
    if "eval/accuracy" in final:
        line += f": {eval_split} accuracy {final['eval/accuracy']:.3f}"
        # only a better earlier evaluation is news; a tie kept from an earlier step is not
        if best and best.get("step") != step and best["eval/accuracy"] > final["eval/accuracy"]:
            line += f" (best {best['eval/accuracy']:.3f} at step {best['step']})"
        if "eval/loss" in final:
            line += f", loss {final['eval/loss']:.3f}"
    elif "eval/loss" in final:
        line += f": {eval_split} loss {final['eval/loss']:.3f}"
    return line


def format_summary(summary: dict, out_dir, eval_split: str, wandb_mode: str | None = None,
                   wandb_url: str | None = None) -> str:
    """The end-of-run lines for `summary` (summary.json's content) of the run in `out_dir`."""
    out = Path(out_dir)
    lines = [headline(summary, eval_split, tokens_per_s(out / "metrics.jsonl"))]
    if summary.get("final_model"):
        lines.append(f"  model:  {summary['final_model']}    evaluate: python scripts/evaluate.py {_q(out)}")
    elif summary["status"] == "interrupted":
        lines.append(f"  state:  {summary['last_checkpoint']}    continue: python train.py output_dir={_q(out)} "
                     f"train.resume=auto")
    elif summary["status"] == "diverged":
        lines.append(f"  state:  {summary['last_checkpoint'] or 'no checkpoint'} (before the non-finite step); "
                     f"no final/ model: try a lower train.lr or more train.warmup_steps")
    if summary.get("wandb_run_id"):
        local = sorted(out.glob("wandb/offline-run-*")) if wandb_mode == "offline" else []  # newest last
        if local:
            lines.append(f"  W&B:    {local[-1]}    upload: wandb sync {_q(local[-1])}")
            lines.append(f"  charts: python scripts/wandb_charts.py {_q(out)}    (depth charts, drawn locally)")
        elif wandb_url:
            lines.append(f"  W&B:    {wandb_url}")
    return "\n".join(lines)

