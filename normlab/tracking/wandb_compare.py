"""A comparison of training runs as one W&B run (job_type "compare"): each metric of normlab-compare's figure as a
line series with one line per run on shared axes, a table of the runs and the figure itself (docs/wandb.md,
"Comparing runs")."""

from pathlib import Path

from normlab.tracking.wandb_report import line_chart, rows_table
from normlab.tracking.wandb_run import CHART_POINTS, thin


def log_comparison(wandb_dir, name: str, group: str, runs: list[dict], charts: dict, image, mode: str,
                   project: str = "normlab") -> dict:
    """Log the comparison run; returns {"project", "group", "id", "mode", "dir"}.

    runs:   one flat dict per compared run (a `wandb_run_id` key links the comparison to that run).
    charts: {key: {"lines": {run label: (xs, ys)}, "title": str, "xname": str}}, logged as compare/<key>.
    image:  the figure's file.
    The run's files go to WANDB_DIR/wandb (offline unless `mode` is online)."""
    import wandb

    run = wandb.init(project=project, group=group, job_type="compare", name=name, mode=mode, dir=str(wandb_dir),
                     reinit="finish_previous", settings=wandb.Settings(silent=True),
                     config={"runs": [r["run"] for r in runs],
                             "wandb_runs": [r["wandb_run_id"] for r in runs if r.get("wandb_run_id")]})
    logged = {"compare/runs": rows_table(runs), "compare/figure": wandb.Image(str(image))}
    for key, chart in charts.items():
        lines = {label: thin(list(xs), list(ys), CHART_POINTS) for label, (xs, ys) in chart["lines"].items()}
        logged[f"compare/{key}"] = line_chart(lines, chart["title"], chart["xname"])
    run.log(logged)
    info = {"project": project, "group": group, "id": run.id, "mode": mode, "dir": str(Path(run.dir).parent)}
    run.finish()
    return info
