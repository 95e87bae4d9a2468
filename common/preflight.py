"""Checks that run before a run loads anything: whether the run directory is ours to write (a finished or
unfinished run there is never overwritten), whether a checkpoint to resume from fits this config, and which
trackers the run reports to."""

import os
from pathlib import Path

from common import wandb_run
from common.checkpointing import list_checkpoints, resolve_resume, validate_checkpoint
from common.config import ConfigError, flatten_config
from common.io import read_json, read_yaml
from common.writes import check_writable_dir

# Keys that may change when a run is resumed; any other difference from the checkpoint's config is an error.
RESUMABLE_CHANGES = ("train.resume", "train.max_steps", "train.epochs", "train.eval_steps", "train.save_steps",
                     "train.log_steps", "train.save_total_limit", "train.compile", "train.cpu_threads",
                     "train.tf32", "train.kernels", "data.label_names", "wandb.")


def config_diff(a: dict, b: dict) -> list[str]:
    fa, fb = flatten_config(a), flatten_config(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def check_output_dir(cfg: dict) -> None:
    """Never overwrite a run: a finished run, or an unfinished one that has checkpoints, is only continued
    (train.resume), never restarted in place."""
    out = Path(cfg["output_dir"])
    if cfg["train"]["resume"] is not None:
        return  # continuing; the checkpoint's config is checked against this one (check_resume_config)
    summary = read_json(out / "summary.json")
    status = summary.get("status") if isinstance(summary, dict) else None
    if status == "completed":
        previous = read_yaml(out / "config.yaml")
        diff = [k for k in config_diff(previous, cfg) if k != "train.resume"] if isinstance(previous, dict) else []
        what = f"a different config (differs in: {', '.join(diff[:6])})" if diff else "this config"
        raise ConfigError(
            f"output_dir={out} already holds a finished run of {what} ({summary.get('step')} steps), which is never "
            f"overwritten; for a new run pick another output_dir (e.g. output_dir={out}-2) or delete {out}; to train "
            f"this one further pass train.resume=auto with a larger train.max_steps or train.epochs")
    if summary is not None or list_checkpoints(out):
        what = f"status {status}" if status else "checkpoints"
        raise ConfigError(
            f"output_dir={out} already holds an unfinished run ({what}); pass train.resume=auto to continue it, "
            f"or pick another output_dir")


def check_resume_config(cfg: dict, ckpt_cfg: dict, path: Path) -> list[str]:
    """ConfigError when the checkpoint was trained with another model/data/batch setup; the harmless
    differences (more steps, other logging...) are returned for a notice."""
    diff = config_diff(ckpt_cfg, cfg)
    fatal = [k for k in diff if not k.startswith(RESUMABLE_CHANGES) and k != "output_dir"]
    if fatal:
        shown = ", ".join(f"{k}={flatten_config(ckpt_cfg).get(k)!r}" for k in fatal[:4])
        raise ConfigError(
            f"checkpoint {path} was trained with {shown}; resume with the same values (or start a new output_dir)")
    return diff


def resolve_trackers(cfg: dict) -> tuple[list[str], str]:
    """accelerate tracker names and the wandb mode (online | offline | disabled); never prompts."""
    mode = wandb_run.resolve_mode(cfg["wandb"]["mode"])
    report_to = cfg["wandb"]["report_to"]
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if "all" in names:
        names = ["wandb", "tensorboard"]
    names = [n for n in names if n != "none" and not (n == "wandb" and mode == "disabled")]
    return names, mode


def preflight(cfg: dict) -> tuple[Path | None, list[str], list[str], str]:
    """Before loading anything: the checkpoint to resume from, whether the run directory is ours to write, and
    the trackers. -> (resume path, notices, tracker names, wandb mode)."""
    t, out = cfg["train"], Path(cfg["output_dir"])
    if not isinstance(t["save_total_limit"], int) or t["save_total_limit"] < 1:
        raise ConfigError(f"train.save_total_limit={t['save_total_limit']!r} must be an integer >= 1")
    check_writable_dir(out)
    check_output_dir(cfg)
    resume_path, notices = resolve_resume(t["resume"], out)
    if resume_path is not None:
        changed = check_resume_config(cfg, validate_checkpoint(resume_path)["config"], resume_path)
        notices += [f"resuming with changed {k}" for k in changed if k != "train.resume"]
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError(
            "train.py does not run under DeepSpeed (its per-step stability metrics read every parameter's gradient "
            "and update, which ZeRO partitions and applies inside backward); use configs/accelerate/fsdp.yaml or "
            "multi_gpu.yaml, or configs/accelerate/deepspeed_zero2.yaml with a transformers Trainer script")
    trackers, wandb_mode = resolve_trackers(cfg)
    os.environ.setdefault("WANDB_SILENT", "true")
    if "wandb" in trackers:
        os.environ["WANDB_MODE"] = wandb_mode  # offline: wandb never touches the network
        if wandb_mode == "offline":
            wandb_run.keep_offline_files_in(out)
    return resume_path, notices, trackers, wandb_mode

