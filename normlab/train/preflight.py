"""Checks that run before a run loads anything: the config of a resumed run (the run's own, saved in its
directory), whether the run directory is ours to write (a finished or unfinished run there is never overwritten),
whether a checkpoint to resume from fits this config, and which trackers the run reports to."""

import os
from pathlib import Path

from normlab.config.loader import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    ConfigError,
    RunConfig,
    flatten_config,
    load_config,
    replace_keys,
    resolve_config_file,
)
from normlab.files.formats import load_yaml_mapping
from normlab.files.writes import check_writable_dir
from normlab.run_dir import RunDir, saved_config_raw
from normlab.tracking import wandb_run
from normlab.train.checkpointing import TRAINER_STATE, list_checkpoints, resolve_resume, validate_checkpoint
from normlab.train.run_summary import resume_command

# What a resumed run may change (docs/training.md, "Resuming a run"): how long it trains, how often it logs,
# evaluates and saves, how it runs (threads, kernels, compilation) and what it reports to W&B; nothing that changes
# what is trained. Any other difference from the run's saved config is refused.
RESUMABLE = ("train.max_steps", "train.epochs", "train.eval_steps", "train.eval_count", "train.save_steps",
             "train.log_steps", "train.save_total_limit", "train.cpu_threads", "train.kernels", "train.compile",
             "train.compile_backend", "train.tf32", "wandb.mode", "wandb.log_model", "wandb.log_checkpoints")
ALWAYS_GIVEN = ("train.resume", "output_dir")  # the resume command's own: where the run is, and how to continue it


def config_diff(a: dict, b: dict) -> list[str]:
    fa, fb = flatten_config(a), flatten_config(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def check_output_dir(cfg: RunConfig) -> None:
    """Never overwrite a run: a finished run, or an unfinished one that has checkpoints, is only continued
    (train.resume), never restarted in place."""
    run_dir = RunDir.of(cfg)
    out = run_dir.path
    if cfg.train.resume is not None:
        return  # continuing; the checkpoint's config is checked against this one (check_resume_config)
    summary = run_dir.read_summary()
    status = summary.get("status") if summary is not None else None
    if status == "completed":
        try:
            previous = saved_config_raw(run_dir.config_file)[0]
        except (ConfigError, OSError):
            previous = None
        diff = [k for k in config_diff(previous, cfg) if k != "train.resume"] if previous else []
        what = f"a different config (differs in: {', '.join(diff[:6])})" if diff else "this config"
        raise ConfigError(
            f"output_dir={out} already holds a finished run of {what} ({summary.get('step')} steps), which is never "
            f"overwritten; for a new run pick another output_dir (e.g. output_dir={out}-2) or delete {out}; to train "
            f"this one further: {resume_command(out)} with a larger train.max_steps or train.epochs")
    if summary is not None or list_checkpoints(out):
        what = f"status {status}" if status else "checkpoints"
        raise ConfigError(
            f"output_dir={out} already holds an unfinished run ({what}); continue it with {resume_command(out)}, "
            f"or pick another output_dir")


def check_resume_config(cfg: RunConfig, ckpt_cfg: dict, path: Path) -> None:
    """ConfigError when the checkpoint was trained with another model/data/batch setup (a config.yaml edited by
    hand, or a checkpoint of another run). A run key the checkpoint's config lacks was added to NormLab since it was
    written, with a default that keeps what the run did: not a difference (a model key it lacks had
    NormLabConfig's default, and is one)."""
    saved = flatten_config(ckpt_cfg)
    fatal = [k for k in config_diff(ckpt_cfg, cfg)
             if k not in RESUMABLE + ALWAYS_GIVEN and (k in saved or k.startswith("model."))]
    if fatal:
        shown = ", ".join(f"{k}={flatten_config(ckpt_cfg).get(k)!r}" for k in fatal[:4])
        raise ConfigError(
            f"checkpoint {path} was trained with {shown}; resume with the same values (or start a new output_dir)")


def _config_id(config_file) -> str | None:
    """A --config file as run.json records it: relative to the repository when inside it (a moved clone still
    matches), else absolute; None for the defaults alone."""
    path = resolve_config_file(str(config_file)).resolve() if config_file else DEFAULT_CONFIG
    if path == DEFAULT_CONFIG:
        return None
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def saved_run_config(run_dir: RunDir, resume: str) -> tuple[dict, str] | None:
    """(the saved config of the run to resume, where it was read): <output_dir>/config.yaml, else the config in
    the checkpoint to resume from; None when there is no run to resume (a fresh start)."""
    if run_dir.config_file.is_file():
        try:
            return saved_config_raw(run_dir.config_file)
        except ConfigError as e:
            raise ConfigError(f"{e}; it is the run's saved config: restore it, or delete it to resume with the "
                              f"config saved in the checkpoint") from None
    checkpoint, _ = resolve_resume(resume, run_dir.path)
    return (validate_checkpoint(checkpoint)["config"], f"in {checkpoint / TRAINER_STATE}") if checkpoint else None


def _check_variant(config_file, record: dict, saved: RunConfig, run_dir: RunDir) -> None:
    """A --config given on resume must be the run's own (run.json), or, for a run directory from before run.json,
    agree with the saved config on every key it sets."""
    out = run_dir.path
    again = f"resume without --config ({resume_command(out)}) to use the run's own config, or start a new output_dir"
    if "config_file" in record:
        if _config_id(config_file) != record["config_file"]:
            own = f"--config {record['config_file']}" if record["config_file"] else "no --config"
            raise ConfigError(f"--config {config_file} differs from the run's own ({own}, in "
                              f"{run_dir.run_record_file}); {again}")
        return
    keys = flatten_config(load_yaml_mapping(resolve_config_file(str(config_file))))
    variant, run = flatten_config(load_config(config_file)), flatten_config(saved)
    differ = [k for k in keys if k not in ALWAYS_GIVEN and variant.get(k) != run.get(k)]
    if differ:
        k = differ[0]
        raise ConfigError(f"--config {config_file} sets {k}={variant.get(k)!r} but the run in {out} has "
                          f"{k}={run.get(k)!r}; {again}")


def run_config(config_file, overrides) -> tuple[RunConfig, dict, list[str]]:
    """The config of a train.py command -> (config, what run.json keeps of it: {"config_file": the --config file},
    or {} for a resumed run from before run.json resumed without --config; notices). A resume
    (train.resume set, and a run to resume in output_dir) restores the run's saved config; the command's overrides
    may change only RESUMABLE keys (a ConfigError names any other), and each change is stated in one notice."""
    cfg = load_config(config_file, overrides)
    run_dir, resume = RunDir.of(cfg), cfg.train.resume
    out = run_dir.path
    saved = saved_run_config(run_dir, resume) if resume is not None else None
    if saved is None:
        return cfg, {"config_file": _config_id(config_file)}, []
    record = run_dir.read_run_record()
    before = load_config(saved=saved)
    if config_file is not None:
        _check_variant(config_file, record, before, run_dir)
    resumed = replace_keys(load_config(overrides=overrides, saved=saved),  # the command's, as ALWAYS_GIVEN
                           {"output_dir": cfg.output_dir, "train.resume": resume})
    old, new = flatten_config(before), flatten_config(resumed)
    changed = [k for k in config_diff(before, resumed) if k not in ALWAYS_GIVEN]
    refused = [k for k in changed if k not in RESUMABLE]
    if refused:
        k = refused[0]
        raise ConfigError(f"{k}={new.get(k)!r} cannot change when resuming {out} (the run has {k}={old.get(k)!r}); "
                          f"a resume may change only {', '.join(RESUMABLE)}; for another {k} start a new output_dir")
    notices = [f"resuming {out} with its saved config, changing " + ", ".join(
        f"{k}={new[k]!r} (was {old.get(k)!r})" for k in changed)] if changed else []
    if "config_file" in record or config_file is not None:
        return resumed, {"config_file": record.get("config_file", _config_id(config_file))}, notices
    return resumed, {}, notices


def resolve_trackers(w) -> tuple[list[str], str]:
    """accelerate tracker names and the wandb mode (online | offline | disabled) of the config's `wandb` section;
    never prompts."""
    mode = wandb_run.resolve_mode(w.mode)
    report_to = w.report_to
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if "all" in names:
        names = ["wandb", "tensorboard"]
    names = [n for n in names if n != "none" and not (n == "wandb" and mode == "disabled")]
    return names, mode


def restart_notice(run_dir: RunDir, wandb_on: bool) -> list[str]:
    """What train.resume=auto says when the run directory holds an earlier attempt but no checkpoint (it stopped
    before its first save): the run starts over, and under a new W&B run id, since W&B cannot log a step again."""
    summary, old_id = run_dir.read_summary(), run_dir.read_run_record().get("wandb_run_id")
    if summary is None and not run_dir.run_record_file.is_file():
        return []  # a fresh run directory: nothing to say
    stopped = f" (the earlier attempt stopped at step {summary['step']})" if summary and "step" in summary else ""
    w_and_b = (f"; it is a new W&B run: the earlier attempt's, {old_id}, stays in {run_dir.wandb_dir}"
               if wandb_on and old_id else "")
    return [f"no checkpoint in {run_dir.path} yet: the run starts again from step 0{stopped} and writes its "
            f"metrics.jsonl anew{w_and_b}"]


def preflight(cfg: RunConfig) -> tuple[Path | None, list[str], list[str], str]:
    """Before loading anything: the checkpoint to resume from, whether the run directory is ours to write, and
    the trackers. -> (resume path, notices, tracker names, wandb mode)."""
    t, run_dir = cfg.train, RunDir.of(cfg)
    if not isinstance(t.save_total_limit, int) or t.save_total_limit < 1:
        raise ConfigError(f"train.save_total_limit={t.save_total_limit!r} must be an integer >= 1")
    check_writable_dir(run_dir.path)
    check_output_dir(cfg)
    resume_path, notices = resolve_resume(t.resume, run_dir.path)
    if resume_path is not None:
        check_resume_config(cfg, validate_checkpoint(resume_path)["config"], resume_path)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError(
            "train.py does not run under DeepSpeed (its per-step stability metrics read every parameter's gradient "
            "and update, which ZeRO partitions and applies inside backward); use configs/accelerate/fsdp.yaml or "
            "multi_gpu.yaml, or configs/accelerate/deepspeed_zero2.yaml with a transformers Trainer script")
    trackers, wandb_mode = resolve_trackers(cfg.wandb)
    if resume_path is None and t.resume == "auto":
        notices += restart_notice(run_dir, "wandb" in trackers)
    os.environ.setdefault("WANDB_SILENT", "true")
    if "wandb" in trackers:
        os.environ["WANDB_MODE"] = wandb_mode  # offline: wandb never touches the network
        if wandb_mode == "offline":
            wandb_run.keep_offline_files_in(run_dir)
    return resume_path, notices, trackers, wandb_mode

