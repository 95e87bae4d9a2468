"""What a training run shows in Weights & Biases beyond its scalar rows (docs/wandb.md, "What you will see in
W&B"). train.py calls these on the main process with accelerate's wandb run
(`accelerator.get_tracker("wandb", unwrap=True)`)."""

import math
import netrc
import os
import re
from pathlib import Path
from urllib.parse import urlparse

from normlab.config.run_length import warmup_steps
from normlab.files.formats import read_jsonl
from normlab.tracking.wandb_report import line_chart

# Per-layer metric names (normlab/train/probes.py) -> what their depth chart shows.
DEPTH_CHARTS = {
    "grad_norm": "gradient norm per layer (before clipping)",
    "act_rms": "residual-stream activation RMS after each layer",
    "attn_logit_max": "largest attention logit per layer",
    "update_ratio": "update ratio ||dw||/||w|| per layer",
    "stat_drift": "BN batch vs running statistics drift per layer",
    "stat_noise": "BN batch vs population statistics (same weights) at each evaluation, per layer",
}
_PER_LAYER = re.compile(r"^(?:layers|bn)/(\d+)/(\w+)$")
# Points per line of a depth chart: longer histories are thinned evenly (W&B's own line plots sample too).
CHART_POINTS = 500


def api_key_present() -> bool:
    """A wandb API key in the environment or in ~/.netrc (what `wandb login` writes); never prompts."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(setting: str) -> str:
    """online | offline | disabled from a `wandb.mode` setting: auto follows $WANDB_MODE, else online when a key is
    configured and offline otherwise. ValueError for online without a key (it would prompt or fail later)."""
    if setting == "auto":
        env = os.environ.get("WANDB_MODE", "").lower()
        if env in ("online", "offline", "disabled"):
            return env
        return "online" if api_key_present() else "offline"
    if setting == "online" and not api_key_present():
        raise ValueError("wandb.mode=online but no wandb API key is configured; run `wandb login`, set "
                         "WANDB_API_KEY, or use wandb.mode=offline (then `wandb sync`)")
    return setting


def keep_offline_files_in(run_dir) -> None:
    """Sets $WANDB_DATA_DIR (where wandb stages logged artifacts and tables for `wandb sync`) and $WANDB_CACHE_DIR
    to RUN_DIR/wandb/data and cache, so a copy of RUN_DIR (a normlab.run_dir.RunDir) keeps them."""
    root = run_dir.wandb_dir.resolve()
    os.environ.update(WANDB_DATA_DIR=str(root / "data"), WANDB_CACHE_DIR=str(root / "cache"))


def init_kwargs(cfg, mode: str, run_id: str, variant: str | None, total_steps: int) -> dict:
    """wandb.init arguments for accelerate's init_trackers: in wandb.entity's wandb.project (the config's values,
    which $WANDB_ENTITY and $WANDB_PROJECT set unless a variant file or override does: normlab/config/loader.py),
    grouped by wandb.group (a study's name) or <norm>-<placement>, job_type train, tagged to filter a study by (norm,
    placement, task, lr=, warmup= the run's warmup steps of its `total_steps`, seed=, the variant's config file,
    wandb.tags), resumable under the id the checkpoints keep."""
    m, t, w = cfg.model, cfg.train, cfg.wandb
    tags = [m.norm, m.norm_placement, cfg.task, f"lr={t.lr:g}", f"warmup={warmup_steps(t, total_steps)}",
            f"seed={cfg.seed}", variant, *w.tags]
    return {"dir": cfg.output_dir, "group": w.group or f"{m.norm}-{m.norm_placement}",
            "job_type": "train", "tags": list(dict.fromkeys(tag for tag in tags if tag)), "mode": mode,
            "name": Path(cfg.output_dir).name, "id": run_id, "resume": "allow",
            **({"entity": w.entity} if w.entity else {})}


def define_metrics(run) -> None:
    """`step` (the optimizer step, logged with every row) is the x-axis of every metric, eval metrics included;
    step_sync fills it in for rows that lack it (the depth charts)."""
    run.define_metric("step")
    run.define_metric("*", step_metric="step", step_sync=True)


def depth_series(rows) -> dict:
    """metrics.jsonl rows -> {quantity: {layer: (steps, values)}} for the per-layer metrics (finite values only)."""
    series = {}
    for row in rows:
        step = row.get("step")
        for key, value in row.items():
            match = _PER_LAYER.match(key)
            if match is None or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            steps, values = series.setdefault(match[2], {}).setdefault(int(match[1]), ([], []))
            steps.append(step)
            values.append(value)
    return series


def thin(xs: list, ys: list, points: int):
    if len(xs) <= points:
        return xs, ys
    keep = sorted({round(i * (len(xs) - 1) / (points - 1)) for i in range(points)})  # first and last kept
    return [xs[i] for i in keep], [ys[i] for i in keep]


def depth_charts(rows, points: int = CHART_POINTS) -> dict:
    """{"depth/<quantity>": a line chart with one line per layer} from metrics.jsonl rows."""
    charts = {}
    for quantity, by_layer in depth_series(rows).items():
        lines = {f"layer {i}": thin(*by_layer[i], points) for i in sorted(by_layer)}
        charts[f"depth/{quantity}"] = line_chart(lines, DEPTH_CHARTS.get(quantity, quantity), xname="step")
    return charts


def log_depth_charts(run, metrics_path) -> None:
    """Draw the depth charts from the run's metrics.jsonl (so a resumed run's cover the whole run), at its last
    logged step."""
    rows = read_jsonl(metrics_path)
    charts = depth_charts(rows)
    if charts:
        run.log(charts, step=max(r.get("step", 0) for r in rows))


def write_summary(run, summary: dict) -> None:
    """summary.json into the run summary; nested dicts one level flat (final/eval/accuracy, best/step, ...)."""
    for key, value in summary.items():
        flat = {f"{key}/{sub}": v for sub, v in value.items()} if isinstance(value, dict) else {key: value}
        run.summary.update(flat)


def log_model(run, final_dir, cfg, summary: dict) -> str:
    """final/ as the run's `model` artifact (aliases final and step_N), staged for `wandb sync`; returns its
    name:alias."""
    import wandb

    m = cfg.model
    artifact = wandb.Artifact(
        f"model-{run.id}", type="model",
        description=f"NormLab {m.norm} ({m.norm_placement}) encoder, {cfg.task}: the run's final/ "
                    f"(load with from_pretrained(..., trust_remote_code=True) or scripts/evaluate.py)",
        metadata={"norm": m.norm, "norm_placement": m.norm_placement, "task": cfg.task,
                  "step": summary["step"], "final": summary.get("final"), "best": summary.get("best")})
    artifact.add_dir(str(final_dir))
    run.log_artifact(artifact, aliases=["final", f"step_{summary['step']}"])
    name = f"{artifact.name}:final"
    run.summary["model_artifact"] = name
    return name


def log_checkpoint(run, checkpoint_dir, step: int) -> None:
    """A checkpoint as a version of the run's `checkpoint` artifact, staged at once: rotating old checkpoints away
    does not lose what is to be uploaded."""
    import wandb

    artifact = wandb.Artifact(f"checkpoint-{run.id}", type="checkpoint", metadata={"step": step})
    artifact.add_dir(str(checkpoint_dir))
    run.log_artifact(artifact, aliases=[f"step_{step}"])

