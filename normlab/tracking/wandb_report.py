"""A study's report run in Weights & Biases, in the group of the study's training runs (job_type "report"; what
it holds: docs/wandb.md). Generic on purpose: scripts/report.py decides what the rows, sweeps and verdicts are.
And the line every command that logs a W&B run ends with."""

import math
from pathlib import Path


def where_logged(info: dict, kind: str = "") -> str:
    """`W&B: DIR (offline eval run ID)    upload: wandb sync DIR`: where a command's W&B run (`info`: its dir, mode
    and id) keeps its files and, offline, the command that uploads them."""
    run = " ".join(filter(None, (info["mode"], kind, "run", info["id"])))
    upload = f"    upload: wandb sync {info['dir']}" if info["mode"] == "offline" else ""
    return f"W&B: {info['dir']} ({run}){upload}"


def _cell(value):
    """A table cell wandb accepts: NaN/inf as empty, containers as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple, dict, Path)):
        return str(value)
    return value


def rows_table(rows: list[dict]):
    """wandb.Table of dict rows; the columns are every key, in order of first appearance."""
    import wandb

    columns = list(dict.fromkeys(key for row in rows for key in row))
    return wandb.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])


def line_chart(lines: dict, title: str = "", xname: str = "x"):
    """wandb.plot.line_series with one line per `{name: (xs, ys)}` entry; missing points (None, NaN) are left out of
    their line instead of breaking it."""
    import wandb

    kept = {}
    for name, (xs, ys) in lines.items():
        points = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
        if points:
            kept[name] = points
    return wandb.plot.line_series(xs=[[x for x, _ in p] for p in kept.values()],
                                  ys=[[y for _, y in p] for p in kept.values()],
                                  keys=list(kept), title=title, xname=xname)


def log_study(study_dir, name: str, runs: list[dict], sweeps: dict, verdicts: list[dict], images: dict,
              mode: str, project: str = "normlab") -> dict | None:
    """Log one study's report run; returns {"project", "group", "id", "mode", "dir"} (None when mode is disabled).

    runs:     one flat dict per training run; a `wandb_run_id` key links the report to that run.
    sweeps:   {key: {"xs": [...], "ys": {line name: [y per x]}, "title": str, "xname": str}}.
    verdicts: one dict per row of the verdict table.
    images:   {key: path} or {key: (path, caption)}.
    The run goes to STUDY_DIR/wandb (offline unless `mode` is online), next to nothing of the training runs'.
    """
    if mode == "disabled":
        return None
    import wandb

    run_ids = [r["wandb_run_id"] for r in runs if r.get("wandb_run_id")]
    run = wandb.init(project=project, group=name, job_type="report", name=f"{name}-report", mode=mode,
                     dir=str(study_dir), reinit="finish_previous", settings=wandb.Settings(silent=True),
                     config={"study": name, "study_dir": str(study_dir), "num_runs": len(runs), "runs": run_ids})
    logged = {"study/runs": rows_table(runs), "study/verdicts": rows_table(verdicts)}
    for key, sweep in sweeps.items():
        lines = {line: (sweep["xs"], ys) for line, ys in sweep["ys"].items()}
        logged[f"study/{key}"] = line_chart(lines, sweep.get("title", key), sweep.get("xname", "x"))
    for key, image in images.items():
        path, caption = image if isinstance(image, tuple) else (image, None)
        logged[f"study/{key}"] = wandb.Image(str(path), caption=caption)
    run.log(logged)
    info = {"project": project, "group": name, "id": run.id, "mode": mode, "dir": str(Path(run.dir).parent)}
    run.finish()
    return info

