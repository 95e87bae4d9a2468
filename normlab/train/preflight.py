"""Checks that run before a run loads anything: the config of a resumed run (the run's own, saved in its
directory), whether the run directory is ours to write (a finished or unfinished run there is never overwritten),
whether a checkpoint to resume from fits this config, and which trackers the run reports to."""

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from normlab.config.loader import (
    DEFAULT_CONFIG,
    ConfigError,
    RunConfig,
    flatten_config,
    load_config,
    load_resumed,
    replace_keys,
    resolve_config_file,
)
from normlab.files.formats import load_yaml_mapping
from normlab.files.writes import check_writable_dir
from normlab.paths import REPO_ROOT
from normlab.run_dir import RunDir, saved_config_raw
from normlab.tracking import wandb_run
from normlab.train.checkpointing import TRAINER_STATE, list_checkpoints, resolve_resume, validate_checkpoint
from normlab.train.run_summary import resume_command

# What a resumed run may change (docs/training.md, "Resuming a run"): how long it trains, how often it logs,
# evaluates and saves, how it runs (threads, kernels, compilation) and what it reports to W&B; nothing that changes
# what is trained. Any other difference from the run's saved config is refused.
RESUMABLE = ("train.max_steps", "train.epochs", "train.eval_steps", "train.eval_count", "train.precise_bn_batches",
             "train.save_steps", "train.log_steps", "train.save_total_limit", "train.cpu_threads", "train.kernels",
             "train.compile", "train.compile_backend", "train.tf32", "wandb.mode", "wandb.log_model",
             "wandb.log_checkpoints")
ALWAYS_GIVEN = ("train.resume", "output_dir")  # the resume command's own: where the run is, and how to continue it


def config_diff(a: dict, b: dict) -> list[str]:
    return flat_diff(flatten_config(a), flatten_config(b))


def flat_diff(fa: dict, fb: dict) -> list[str]:
    """The dotted keys whose values differ between two flattened configs (a key one lacks reads as None)."""
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
    fatal = [k for k in flat_diff(saved, flatten_config(cfg))
             if k not in RESUMABLE + ALWAYS_GIVEN and (k in saved or k.startswith("model."))]
    if fatal:
        shown = ", ".join(f"{k}={saved.get(k)!r}" for k in fatal[:4])
        raise ConfigError(
            f"checkpoint {path} was trained with {shown}; resume with the same values (or start a new output_dir)")


def _config_id(config_file) -> str | None:
    """A --config file as run.json records it: relative to the repository when inside it (a moved clone still
    matches), else absolute; None for the defaults alone."""
    path = resolve_config_file(str(config_file)).resolve() if config_file else DEFAULT_CONFIG
    if path == DEFAULT_CONFIG:
        return None
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


@dataclass(frozen=True)
class Resume:
    """What a resumed run continues, found once and handed along: the checkpoint and its checked trainer state
    (None, None: the run stopped before its first checkpoint and starts again from step 0), and a notice per
    damaged newer checkpoint skipped."""

    checkpoint: Path | None
    state: dict | None
    skipped: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunStart:
    """What a train.py command starts: the run config, what run.json keeps of the command ({"config_file": the
    --config file}, or {} for a run from before run.json resumed without --config), what resolving it had to say,
    and for a resume (train.resume set) what it continues."""

    cfg: RunConfig
    record: dict
    notices: tuple[str, ...] = ()
    resume: Resume | None = None


def holds_run(run_dir: RunDir) -> bool:
    """Whether a run was set up or started in `run_dir`: its config.yaml (which a study writes before launching
    it), run.json, summary.json or a checkpoint."""
    files = (run_dir.config_file, run_dir.run_record_file, run_dir.summary_file)
    return any(f.is_file() for f in files) or bool(list_checkpoints(run_dir.path))


def runs_beside(path: Path, n: int = 5) -> list[Path]:
    """The run directories next to `path` (holds_run), the `n` closest names first: what a typo'd output_dir
    meant."""
    if not path.parent.is_dir():
        return []
    names = [p.name for p in path.parent.iterdir() if p != path and p.is_dir() and holds_run(RunDir(p))]
    return [path.parent / name for name in difflib.get_close_matches(path.name, names, n=n, cutoff=0)]


def nothing_to_resume(run_dir: RunDir) -> str:
    """What train.resume=auto says where no run is, naming the run directories beside it."""
    out, near = run_dir.path, runs_beside(run_dir.path)
    here = "it does not exist" if not out.exists() else "no checkpoint, config.yaml or summary.json there"
    nearby = (f"run directories nearby: {', '.join(map(str, near))}" if near
              else f"no run directory beside it in {out.parent}")
    return (f"train.resume=auto: nothing to resume in output_dir={out} ({here}); {nearby}; to start a new run "
            f"there, leave train.resume out (or give train.resume=null)")


def find_resume(run_dir: RunDir, resume: str) -> Resume:
    """The checkpoint train.resume (auto, a checkpoint, or a run directory) names, checked once; auto where no run
    is set up or started (holds_run) is a ConfigError: never a new run in its place."""
    checkpoint, skipped = resolve_resume(resume, run_dir.path)
    if checkpoint is None and resume == "auto" and not holds_run(run_dir):
        raise ConfigError(nothing_to_resume(run_dir))
    return Resume(checkpoint, validate_checkpoint(checkpoint) if checkpoint else None, tuple(skipped))


def saved_run_config(run_dir: RunDir, resume: Resume) -> tuple[dict, str] | None:
    """(the saved config of the run to resume, where it was read): <output_dir>/config.yaml, else the config in
    the checkpoint to resume from; None when there is neither (an attempt that stopped before writing them: it
    starts again with the command's config)."""
    if run_dir.config_file.is_file():
        try:
            return saved_config_raw(run_dir.config_file)
        except ConfigError as e:
            raise ConfigError(f"{e}; it is the run's saved config: restore it, or delete it to resume with the "
                              f"config saved in the checkpoint") from None
    if resume.checkpoint is None:
        return None
    return resume.state["config"], f"in {resume.checkpoint / TRAINER_STATE}"


def _check_variant(config_file, record: dict, run: dict, run_dir: RunDir) -> None:
    """A --config given on resume must be the run's own (run.json), or, for a run directory from before run.json,
    agree with the run's saved config (`run`, flattened) on every key it sets."""
    out = run_dir.path
    again = f"resume without --config ({resume_command(out)}) to use the run's own config, or start a new output_dir"
    if "config_file" in record:
        if _config_id(config_file) != record["config_file"]:
            own = f"--config {record['config_file']}" if record["config_file"] else "no --config"
            raise ConfigError(f"--config {config_file} differs from the run's own ({own}, in "
                              f"{run_dir.run_record_file}); {again}")
        return
    keys = flatten_config(load_yaml_mapping(resolve_config_file(str(config_file))))
    variant = flatten_config(load_config(config_file))
    differ = [k for k in keys if k not in ALWAYS_GIVEN and variant.get(k) != run.get(k)]
    if differ:
        k = differ[0]
        raise ConfigError(f"--config {config_file} sets {k}={variant.get(k)!r} but the run in {out} has "
                          f"{k}={run.get(k)!r}; {again}")


def run_config(config_file, overrides) -> RunStart:
    """What a train.py command starts. A resume (train.resume set) finds its checkpoint once (find_resume: auto
    where no run is is refused) and restores the run's saved config, loaded once; the command's overrides may
    change only RESUMABLE keys (a ConfigError names any other), and each change is stated in one notice. The saved
    config is read, checked (with the overrides on it) and flattened once."""
    cfg = load_config(config_file, overrides)
    run_dir, resume = RunDir.of(cfg), cfg.train.resume
    out = run_dir.path
    found = find_resume(run_dir, resume) if resume is not None else None
    saved = saved_run_config(run_dir, found) if found is not None else None
    if saved is None:
        return RunStart(cfg, {"config_file": _config_id(config_file)}, resume=found)
    record = run_dir.read_run_record()
    old, resumed = load_resumed(saved, overrides)
    if config_file is not None:
        _check_variant(config_file, record, old, run_dir)
    resumed = replace_keys(resumed, {"output_dir": cfg.output_dir, "train.resume": resume})  # the command's
    new = flatten_config(resumed)
    changed = [k for k in flat_diff(old, new) if k not in ALWAYS_GIVEN]
    refused = [k for k in changed if k not in RESUMABLE]
    if refused:
        k = refused[0]
        raise ConfigError(f"{k}={new.get(k)!r} cannot change when resuming {out} (the run has {k}={old.get(k)!r}); "
                          f"a resume may change only {', '.join(RESUMABLE)}; for another {k} start a new output_dir")
    notices = (f"resuming {out} with its saved config, changing " + ", ".join(
        f"{k}={new[k]!r} (was {old.get(k)!r})" for k in changed),) if changed else ()
    if "config_file" in record or config_file is not None:
        return RunStart(resumed, {"config_file": record.get("config_file", _config_id(config_file))}, notices, found)
    return RunStart(resumed, {}, notices, found)


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


def preflight(cfg: RunConfig, resume: Resume | None) -> tuple[list[str], list[str], str]:
    """Before loading anything: whether the run directory is ours to write, whether the checkpoint to resume from
    (run_config's) fits the config, and the trackers. -> (notices, tracker names, wandb mode)."""
    t, run_dir = cfg.train, RunDir.of(cfg)
    if not isinstance(t.save_total_limit, int) or t.save_total_limit < 1:
        raise ConfigError(f"train.save_total_limit={t.save_total_limit!r} must be an integer >= 1")
    check_writable_dir(run_dir.path)
    check_output_dir(cfg)
    notices = list(resume.skipped) if resume is not None else []
    if resume is not None and resume.checkpoint is not None:
        check_resume_config(cfg, resume.state["config"], resume.checkpoint)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError(
            "train.py does not run under DeepSpeed (its per-step stability metrics read every parameter's gradient "
            "and update, which ZeRO partitions and applies inside backward); use configs/accelerate/fsdp.yaml or "
            "multi_gpu.yaml, or configs/accelerate/deepspeed_zero2.yaml with a transformers Trainer script")
    trackers, wandb_mode = resolve_trackers(cfg.wandb)
    if resume is not None and resume.checkpoint is None:
        notices += restart_notice(run_dir, "wandb" in trackers)
    os.environ.setdefault("WANDB_SILENT", "true")
    if "wandb" in trackers:
        os.environ["WANDB_MODE"] = wandb_mode  # offline: wandb never touches the network
        if wandb_mode == "offline":
            wandb_run.keep_offline_files_in(run_dir)
    return notices, trackers, wandb_mode

