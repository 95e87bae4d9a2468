"""Train a NormLab encoder: `accelerate launch train.py [--config FILE] [--debug] [key=value ...]`.

    accelerate launch train.py                                   # the default run (configs/default.yaml)
    accelerate launch train.py --config post_ln model.norm=rmsnorm train.lr=1e-3
    python train.py output_dir=runs/x train.resume=auto          # continue a run from its newest checkpoint

Reads top to bottom: config -> run directory checks -> accelerator -> data -> model, optimizer, schedule ->
resume -> the loop (stability logging, evaluation, checkpoints, divergence and signal handling) -> final/.

The run directory (docs/training.md): config.yaml, metrics.jsonl, summary.json, checkpoints/step_N/, final/, wandb/.

Exit codes: 0 when the run ended with a summary.json (status completed, diverged, or interrupted by
SIGTERM/SIGINT after saving a checkpoint: a diverged run is a result, not a crash); 2 for bad input (config, data,
checkpoint, run directory: one line on stderr, nothing deleted; `--debug` shows the traceback); 3 for a write the
filesystem refused (full disk, no permission, read-only: one line saying what, where, why and what to do; the last
complete checkpoint is intact and `train.resume=auto` continues once the cause is fixed); 1 for a crash.
Under `accelerate launch` every non-zero exit becomes the launcher's 1, after its own traceback (`-q` drops it).
"""

import math
import os
import signal
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import get_scheduler

from common import wandb_run
from common.checkpointing import (
    CheckpointError,
    atomic_dir,
    list_checkpoints,
    load_checkpoint,
    mid_epoch_rng,
    record_write_failure,
    resolve_resume,
    restore_after_first,
    save_checkpoint,
    validate_checkpoint,
)
from common.config import ConfigError, flatten_config, load_config, model_config_from, parse_cli, save_config
from common.data import build_dataloaders, label_names, load_tokenized
from common.evaluation import evaluate
from common.io import atomic_write_json, atomic_write_text, read_json, read_yaml
from common.metrics import MetricsWriter, StabilityProbe
from common.model_card import RUN_CONFIG_FILE, model_card
from common.optim import adamw
from common.run_summary import format_summary
from common.stability import LossSpikeDetector
from common.step import train_step
from common.writes import WriteError, check_writable_dir, guarded_write
from model import NormLabForMaskedLM, NormLabForSequenceClassification
from model.norms import BatchStatNorm

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_WRITE_FAILED = 0, 1, 2, 3
# Keys that may change when a run is resumed; any other difference from the checkpoint's config is an error.
RESUMABLE_CHANGES = ("train.resume", "train.max_steps", "train.epochs", "train.eval_steps", "train.save_steps",
                     "train.log_steps", "train.save_total_limit", "train.compile", "train.cpu_threads",
                     "train.tf32", "train.kernels", "data.label_names", "wandb.")


def main(argv=None) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        config_file, overrides, debug = parse_cli(argv)
        cfg = load_config(config_file, overrides)
        return train(cfg, variant=Path(config_file).stem if config_file else None)
    except WriteError as e:  # a full disk, no permission: what, where, why, and what to do
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except ValueError as e:  # ConfigError, DataError, CheckpointError and the model's own ValueErrors
        if debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT


# ----------------------------------------------------------------------------------------------------------
# checks that run before anything is loaded


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
            f"this one further pass train.resume=auto with a larger train.max_steps or train.epochs"
        )
    if summary is not None or list_checkpoints(out):
        what = f"status {status}" if status else "checkpoints"
        raise ConfigError(
            f"output_dir={out} already holds an unfinished run ({what}); pass train.resume=auto to continue it, "
            f"or pick another output_dir"
        )


def check_resume_config(cfg: dict, ckpt_cfg: dict, path: Path) -> list[str]:
    """ConfigError when the checkpoint was trained with another model/data/batch setup; the harmless
    differences (more steps, other logging...) are returned for a notice."""
    diff = config_diff(ckpt_cfg, cfg)
    fatal = [k for k in diff if not k.startswith(RESUMABLE_CHANGES) and k != "output_dir"]
    if fatal:
        shown = ", ".join(f"{k}={flatten_config(ckpt_cfg).get(k)!r}" for k in fatal[:4])
        raise ConfigError(
            f"checkpoint {path} was trained with {shown}; resume with the same values (or start a new output_dir)"
        )
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


# ----------------------------------------------------------------------------------------------------------
# building blocks of the run


def bn_stats_spread(accelerator, model, batch_stat_norm_cls) -> float:
    """Largest difference of the BN-family running statistics between processes (0.0 when they are kept in
    sync; always 0.0 on one process)."""
    buffers = [b.float().flatten() for m in model.modules() if isinstance(m, batch_stat_norm_cls)
               for name, b in m.named_buffers(recurse=False) if name != "num_batches_tracked"]
    if not buffers or accelerator.num_processes == 1:
        return 0.0
    local = torch.cat(buffers).to(accelerator.device)
    everyone = accelerator.gather(local.unsqueeze(0))  # (P, K)
    return (everyone - everyone[0]).abs().max().item()


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next step boundary and exits. A second
    signal gets the default behaviour (abort at once)."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        self.signum = signum
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this step "
              f"(send it again to abort)", file=sys.stderr, flush=True)
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @contextmanager
    def installed(self):
        try:
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread (a notebook runner): no handlers, Ctrl-C raises as usual
            self._previous = {}
        try:
            yield self
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)


def save_final(accelerator, model, tokenizer, cfg: dict, summary: dict) -> Path:
    """output_dir/final: an HF directory (config, safetensors, tokenizer, model card, run config), written to a
    temporary folder and renamed, so `final` only ever exists complete. Collective (get_state_dict gathers under
    FSDP)."""
    out = Path(cfg["output_dir"])
    final = out / "final"
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with atomic_dir(final, "the final model") as tmp:
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            id2label = accelerator.unwrap_model(model).config.id2label if cfg["task"] == "classification" else None
            atomic_write_text(tmp / "README.md", model_card(cfg, summary, id2label))
            save_config(cfg, tmp / RUN_CONFIG_FILE)  # the run config as data, for scripts/evaluate.py
    accelerator.wait_for_everyone()
    return final


def write_summary(accelerator, cfg: dict, summary: dict, wandb_on: bool) -> None:
    if not accelerator.is_main_process:
        return
    path = Path(cfg["output_dir"]) / "summary.json"
    with guarded_write("summary.json", path):
        atomic_write_json(path, summary)
    if wandb_on:
        wandb_run.write_summary(accelerator.get_tracker("wandb", unwrap=True), summary)


# ----------------------------------------------------------------------------------------------------------
# processes and threads


def cpu_threads(setting, device_type: str, local_processes: int, env=os.environ):
    """Intra-op threads per process of a CPU run (None off CPU: torch's default stands):
      1. `setting` (train.cpu_threads) if given;
      2. else OMP_NUM_THREADS as the user set it -- except a 1 under `accelerate launch`, which exports
         OMP_NUM_THREADS=1 on a machine without GPUs unless told otherwise, leaving all but one core idle
         (docs/architecture.md has the measurement);
      3. else the physical cores this process may use, split between the machine's processes: what
         `accelerate launch --cpu` picks."""
    if device_type != "cpu":
        return None
    if setting is not None:
        return setting
    omp = env.get("OMP_NUM_THREADS", "").strip()
    launched = "ACCELERATE_MIXED_PRECISION" in env  # set by every `accelerate launch`
    if omp.isdigit() and int(omp) >= 1 and (int(omp) > 1 or not launched):
        return int(omp)
    import psutil  # (accelerate's dependency)

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):  # a container or taskset may allow fewer
        cores = min(cores, len(os.sched_getaffinity(0)))
    return max(1, cores // max(1, local_processes))


def fsdp_float32_buffers(accelerator) -> None:
    """FSDP (version 1) with bf16/fp16 casts every buffer to its policy's buffer_dtype, which accelerate sets to the
    compute dtype. The only floating buffers of NormLab are the BN family's running statistics, float32
    accumulators that round away most of their small updates in half precision: keep buffers float32."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if getattr(policy, "buffer_dtype", None) not in (None, torch.float32):
        import dataclasses

        plugin.mixed_precision_policy = dataclasses.replace(policy, buffer_dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# the run: setup, the loop, evaluation, checkpoints, the end


def train(cfg: dict, variant: str | None = None) -> int:
    """One run of `cfg`; `variant` (the --config file's name) becomes a wandb tag."""
    resume_path, notices, trackers, wandb_mode = preflight(cfg)
    accelerator = make_accelerator(cfg, trackers)
    for message in notices:
        accelerator.print(f"note: {message}", file=sys.stderr)
    # The operators' implementations (normlab_kernels: C++ on CPU, Triton on CUDA, or the reference PyTorch math),
    # chosen, built and registered before seeding: a build never runs inside the loop or touches its RNG.
    import normlab_kernels

    kernels = normlab_kernels.enable(cfg["train"]["kernels"], accelerator.device)
    set_seed(cfg["seed"])  # same seed on every process: identical init (DDP also broadcasts it)
    run = None
    try:
        run = setup(cfg, accelerator, resume_path, wandb_mode, variant, kernels)
        with StopSignal().installed() as stop:
            status = train_loop(run, stop)
        run.progress.close()
        summary = finish(run, status)
        wandb_url = getattr(run.wb, "url", None) if wandb_mode == "online" else None
    except WriteError as err:  # summary.json says so if it still can; the error names the last complete checkpoint
        if run is not None:
            run.progress.close()
        if accelerator.is_main_process:
            record_write_failure(cfg["output_dir"], err, **({"step": run.state.step} if run else {}))
        raise
    finally:
        accelerator.end_training()  # closes the offline W&B run: its folder is complete before it is named
    accelerator.print(format_summary(summary, cfg["output_dir"], cfg["data"]["eval_split"], wandb_mode, wandb_url))
    return EXIT_OK


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
            "multi_gpu.yaml, or configs/accelerate/deepspeed_zero2.yaml with a transformers Trainer script"
        )
    trackers, wandb_mode = resolve_trackers(cfg)
    os.environ.setdefault("WANDB_SILENT", "true")
    if "wandb" in trackers:
        os.environ["WANDB_MODE"] = wandb_mode  # offline: wandb never touches the network
        if wandb_mode == "offline":
            wandb_run.keep_offline_files_in(out)
    return resume_path, notices, trackers, wandb_mode


def make_accelerator(cfg: dict, trackers: list[str]):
    """The accelerator (processes, devices, mixed precision, gradient accumulation, trackers) and the threads."""
    t = cfg["train"]
    # Several processes on a machine without GPUs (configs/accelerate/cpu_2proc.yaml): CPU processes, gloo.
    cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()
    accelerator = Accelerator(
        cpu=cpu_processes,
        gradient_accumulation_steps=t["grad_accum_steps"],
        mixed_precision=t["mixed_precision"],  # None: what `accelerate launch` was given
        log_with=trackers or None,
        project_dir=cfg["output_dir"],
    )
    threads = cpu_threads(t["cpu_threads"], accelerator.device.type,
                          int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
    if threads is not None:
        torch.set_num_threads(threads)
    if accelerator.device.type == "cuda":
        torch.set_float32_matmul_precision("high" if t["tf32"] else "highest")  # high = TF32 matmuls
    fsdp_float32_buffers(accelerator)
    return accelerator


@dataclass
class TrainerState:
    """Where the run is and what it has seen: what a checkpoint's trainer_state.json holds besides the config."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` consumed (per process)
    spikes: LossSpikeDetector = field(default_factory=LossSpikeDetector)
    best: dict | None = None  # the eval metrics with the best accuracy so far, and their step
    last_eval: dict | None = None
    wall_time_s: float = 0.0  # spent by the earlier processes of this run (resumed runs)
    wandb_run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def to_checkpoint(self, cfg: dict, num_processes: int, wall_time_s: float) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "num_processes": num_processes, "spike_detector": self.spikes.state_dict(), "best": self.best,
                "last_eval": self.last_eval, "wall_time_s": wall_time_s, "wandb_run_id": self.wandb_run_id,
                "config": cfg}

    @classmethod
    def from_checkpoint(cls, st: dict) -> "TrainerState":
        spikes = LossSpikeDetector()
        spikes.load_state_dict(st["spike_detector"])
        return cls(st["step"], st["epoch"], st["batches_in_epoch"], spikes, st["best"], st["last_eval"],
                   st["wall_time_s"], st["wandb_run_id"])


@dataclass
class Run:
    """Everything the loop and its helpers use: what setup built, the trainer state, and the bookkeeping."""

    cfg: dict
    accelerator: object
    model: torch.nn.Module  # prepared (DDP/FSDP-wrapped, compiled) for forward and backward
    optimizer: object
    scheduler: object
    train_loader: object
    batch_sampler: object  # the train loader's own sampler, which set_epoch reshuffles
    eval_loader: object
    tokenizer: object
    total_steps: int
    state: TrainerState
    resumed: bool
    resume_rng: dict | None  # resuming mid-epoch: the RNG state to restore after the first batch
    kernels: dict  # operator -> the backend that runs it (train.kernels)
    wall_start: float
    probe: StabilityProbe | None = None
    writer: MetricsWriter | None = None  # metrics.jsonl (main process)
    wandb_on: bool = False
    wb: object = None  # the wandb run (main process): charts, artifacts, the summary
    progress: object = None
    evaluated_at: int = -1
    saved_at: int = -1
    train_time: float = 0.0  # seconds inside optimizer steps, and how many: summary.json's step_time_s
    steps_timed: int = 0
    bn_spread: float | None = None  # BN family: do the running statistics agree across processes at the end?

    @property
    def unwrapped(self):
        return self.accelerator.unwrap_model(self.model)

    @property
    def uses_bn(self) -> bool:
        return self.unwrapped.config.uses_batch_statistics


def setup(cfg, accelerator, resume_path, wandb_mode, variant, kernels) -> Run:
    """Data, model, optimizer and schedule; the resumed state; the run directory and trackers."""
    wall_start = time.time()
    tokenizer, dsd, train_loader, eval_loader = build_data(cfg, accelerator)
    batch_sampler = train_loader.batch_sampler  # ours (deterministic per (seed, epoch)), before prepare wraps it
    model, optimizer = build_model(cfg, tokenizer, dsd, kernels)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    t, P = cfg["train"], accelerator.num_processes
    steps_per_epoch = math.ceil(len(train_loader) / t["grad_accum_steps"])
    total_steps = t["max_steps"] or t["epochs"] * steps_per_epoch
    # The prepared scheduler steps once per process per optimizer step, hence the factor.
    scheduler = accelerator.prepare(get_scheduler(
        t["scheduler"], optimizer, num_warmup_steps=t["warmup_steps"] * P, num_training_steps=total_steps * P))
    state, resume_rng = TrainerState(), None
    if resume_path is not None:  # weights, optimizer, schedule and RNG; the data position from the state
        state = TrainerState.from_checkpoint(load_resume_checkpoint(accelerator, resume_path))
        resume_rng = mid_epoch_rng(state.batches_in_epoch, len(train_loader))
        accelerator.print(f"resumed from {resume_path} (step {state.step}, epoch {state.epoch}, "
                          f"{state.batches_in_epoch} batches into it)")
    if state.batches_in_epoch >= len(train_loader):  # saved at the end of an epoch
        state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    run = Run(cfg, accelerator, model, optimizer, scheduler, train_loader, batch_sampler, eval_loader, tokenizer,
              total_steps, state, resumed=resume_path is not None, resume_rng=resume_rng, kernels=kernels,
              wall_start=wall_start)
    open_run_dir(run, wandb_mode, variant)
    run.probe = StabilityProbe(run.unwrapped, BatchStatNorm if run.uses_bn else None)
    run.evaluated_at = run.saved_at = state.step if run.resumed else -1
    run.progress = _progress(accelerator, total_steps, state.step)
    return run


def build_data(cfg: dict, accelerator):
    """(tokenizer, raw DatasetDict, train loader, eval loader). The main process builds (and caches) the tokenizer
    and tokenized splits first, then the others load them."""
    with accelerator.main_process_first():
        dsd, tokenizer, tokenized = load_tokenized(cfg)
    low_precision = accelerator.mixed_precision in ("bf16", "fp16")
    train_loader, eval_loader = build_dataloaders(cfg, tokenizer, tokenized,
                                                  pad_to_multiple_of=8 if low_precision else None)
    return tokenizer, dsd, train_loader, eval_loader


def build_model(cfg: dict, tokenizer, dsd, kernels: dict):
    """The model for cfg's task, sized to the tokenizer and labels, and its AdamW; `kernels` ({operator: backend},
    normlab_kernels.enable's) decides its dropout and attention."""
    extra = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if cfg["task"] == "classification":
        names = label_names(dsd, cfg)
        extra.update(num_labels=len(names), id2label=dict(enumerate(names)),
                     label2id={name: i for i, name in enumerate(names)},
                     problem_type="single_label_classification")  # HF infers it at the first loss otherwise
                                                                  # (a config change: a torch.compile recompile)
    model_config = model_config_from(cfg, **extra)
    model = (NormLabForMaskedLM if cfg["task"] == "mlm" else NormLabForSequenceClassification)(model_config)
    import normlab_kernels  # model/ has nn.Dropout and SDPA; with the C++ CPU backend (kernels), its faster ones

    normlab_kernels.apply(model, kernels)
    if cfg["train"]["compile"]:
        # In place: parameter names, state dicts and attribute access stay those of the model. dynamic: padded
        # batches change length every step; one graph with symbolic shapes instead of a recompile per length.
        model.compile(backend=cfg["train"]["compile_backend"] or "inductor", dynamic=True)
    return model, adamw(model, cfg["train"])


def load_resume_checkpoint(accelerator, path: Path) -> dict:
    st = validate_checkpoint(path)
    if st["num_processes"] != accelerator.num_processes:  # the data position and RNG files are per process
        raise CheckpointError(f"checkpoint {path} was written by {st['num_processes']} processes; resume with the "
                              f"same number (accelerate launch --num_processes {st['num_processes']})")
    return load_checkpoint(accelerator, path)


def open_run_dir(run: Run, wandb_mode: str, variant: str | None) -> None:
    """config.yaml, metrics.jsonl (rewound to the checkpoint when resuming) and the trackers."""
    out, acc = Path(run.cfg["output_dir"]), run.accelerator
    if acc.is_main_process:
        with guarded_write("config.yaml", out / "config.yaml"):
            out.mkdir(parents=True, exist_ok=True)
            save_config(run.cfg, out / "config.yaml")
        run.writer = MetricsWriter(out / "metrics.jsonl", resume_step=run.state.step if run.resumed else None)
    run.wandb_on = _init_trackers(acc, run.cfg, wandb_mode, run.state.wandb_run_id, variant)
    if run.wandb_on and acc.is_main_process:
        run.wb = acc.get_tracker("wandb", unwrap=True)


def micro_batches(run: Run):
    """The training micro-batches from the run's data position on, epoch after epoch (each epoch reshuffled by
    its number); keeps run.state's epoch and batches_in_epoch current."""
    st, rng = run.state, run.resume_rng
    while True:
        run.batch_sampler.set_epoch(st.epoch)
        run.train_loader.set_epoch(st.epoch)
        loader = run.train_loader
        if st.batches_in_epoch:
            loader = run.accelerator.skip_first_batches(loader, st.batches_in_epoch)
        for batch in restore_after_first(loader, rng):
            st.batches_in_epoch += 1
            yield batch
        st.epoch, st.batches_in_epoch, rng = st.epoch + 1, 0, None


def train_loop(run: Run, stop: "StopSignal") -> str:
    """One iteration per micro-batch, an optimizer step every grad_accum_steps of them (forward, backward, clip,
    optimizer step: common.step.train_step). -> the run's status: completed, diverged (a non-finite loss or
    gradient) or interrupted (SIGTERM/SIGINT, after a checkpoint)."""
    st, t = run.state, run.cfg["train"]
    batches = micro_batches(run)
    window_start = None  # when the current optimizer step's first micro-batch started
    run.model.train()
    while st.step < run.total_steps:
        batch = next(batches)
        window_start = window_start or time.perf_counter()
        logging_step = (st.step + 1) % t["log_steps"] == 0
        out = train_step(run.accelerator, run.model, run.optimizer, run.scheduler, batch, t["max_grad_norm"],
                         probe=run.probe if logging_step else None, stop_requested=stop.requested)
        run.probe.count(out.loss, batch["attention_mask"])
        if not out.synced:
            continue  # on to the next micro-batch of this optimizer step
        if out.nonfinite:  # this step's update was not applied; the last checkpoint stays as it is
            log_divergence(run, out)
            return "diverged"
        st.step += 1
        if logging_step:
            log_train_row(run, out)
        run.train_time += time.perf_counter() - window_start
        run.steps_timed, window_start = run.steps_timed + 1, None
        run.progress.update(1)

        last = st.step == run.total_steps
        if last and run.uses_bn:  # before evaluation, whose forward may re-sync buffers (DDP)
            run.bn_spread = bn_stats_spread(run.accelerator, run.unwrapped, BatchStatNorm)
        if st.step % t["eval_steps"] == 0 or last:
            run_eval(run)
        if st.step % t["save_steps"] == 0 or last:  # a finished run ends with a checkpoint
            save(run)
        if out.interrupted:
            return "interrupted"
    return "completed"


def log(run: Run, row: dict) -> None:
    if run.writer is not None:
        run.writer.write(row)
    run.accelerator.log(row, step=row["step"])  # `step` too: every wandb panel's x-axis (define_metrics)


def log_train_row(run: Run, out) -> None:
    row = run.probe.collect(run.accelerator, out.grad_norm, out.lr)
    spike = run.state.spikes.update(row["train/loss"])
    log(run, {"step": run.state.step, "epoch": run.state.epoch, **row, "events/loss_spike": int(spike),
              "events/nonfinite": 0})
    run.progress.set_postfix(loss=f"{row['train/loss']:.4f}", refresh=False)


def log_divergence(run: Run, out) -> None:
    row = run.probe.collect(run.accelerator, out.grad_norm, out.lr, measured=False)
    step = run.state.step + 1
    log(run, {"step": step, "epoch": run.state.epoch, **row, "events/loss_spike": 0, "events/nonfinite": 1})
    run.accelerator.print(f"\nstep {step}: non-finite loss or gradient (loss {row['train/loss']}, grad norm "
                          f"{out.grad_norm}); stopping, status diverged", file=sys.stderr)


def run_eval(run: Run) -> None:
    """Evaluate, keep the best, log; the BN family also with the batches' own statistics (its train/eval gap)."""
    acc, st, task, seed = run.accelerator, run.state, run.cfg["task"], run.cfg["seed"]
    metrics = evaluate(acc, run.model, run.eval_loader, task, seed)
    if run.uses_bn:
        metrics["eval/accuracy_batch_stats"] = evaluate(acc, run.model, run.eval_loader, task, seed,
                                                        batch_stats=True)["eval/accuracy"]
    if st.best is None or metrics["eval/accuracy"] > st.best["eval/accuracy"]:
        st.best = {"step": st.step, **metrics}
    st.last_eval, run.evaluated_at = metrics, st.step
    log(run, {"step": st.step, "epoch": st.epoch, **metrics})
    if run.wb is not None:
        wandb_run.log_depth_charts(run.wb, run.writer.path)
    if acc.is_main_process:
        run.progress.write(f"step {st.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def save(run: Run) -> None:
    """A checkpoint of this step (collective), logged to wandb when asked."""
    st, cfg = run.state, run.cfg
    trainer_state = st.to_checkpoint(cfg, run.accelerator.num_processes, st.wall_time_s + time.time() - run.wall_start)
    path = save_checkpoint(run.accelerator, cfg["output_dir"], st.step, trainer_state,
                           keep=cfg["train"]["save_total_limit"], tokenizer=run.tokenizer)
    run.saved_at = st.step
    if run.wb is not None and cfg["wandb"]["log_checkpoints"]:
        wandb_run.log_checkpoint(run.wb, path, st.step)


def finish(run: Run, status: str) -> dict:
    """The end: evaluate and checkpoint what the loop did not, final/ (completed runs only), summary.json;
    returns the summary."""
    acc, st, cfg, out = run.accelerator, run.state, run.cfg, Path(run.cfg["output_dir"])
    if status == "completed" and run.evaluated_at != st.step:  # resumed a run that had already finished its steps
        run_eval(run)
    if status in ("completed", "interrupted") and run.saved_at != st.step:
        save(run)
    checkpoints = list_checkpoints(out)
    summary = {
        "status": status, "step": st.step, "total_steps": run.total_steps, "epoch": st.epoch,
        "final": st.last_eval, "best": st.best, "loss_spikes": st.spikes.spikes,
        "wall_time_s": round(st.wall_time_s + time.time() - run.wall_start, 2),
        "step_time_s": round(run.train_time / max(run.steps_timed, 1), 5),
        "num_processes": acc.num_processes,
        "cpu_threads": torch.get_num_threads() if acc.device.type == "cpu" else None,  # per process
        "kernels": run.kernels,
        "final_model": None,
        "last_checkpoint": str(checkpoints[-1][1]) if checkpoints else None,
        "wandb_run_id": st.wandb_run_id if run.wandb_on else None,
    }
    if run.bn_spread is not None:
        summary["bn_running_stats_max_diff_across_processes"] = run.bn_spread
    if status == "completed":
        summary["final_model"] = str(save_final(acc, run.model, run.tokenizer, cfg, summary))
    if run.wb is not None:
        if status != "completed":  # no final evaluation drew the depth charts up to the end
            wandb_run.log_depth_charts(run.wb, run.writer.path)
        if status == "completed" and cfg["wandb"]["log_model"]:
            wandb_run.log_model(run.wb, summary["final_model"], cfg, summary)
    write_summary(acc, cfg, summary, run.wandb_on)
    if run.writer is not None:
        run.writer.close()
    return summary


def _init_trackers(accelerator, cfg: dict, wandb_mode: str, run_id: str, variant: str | None) -> bool:
    """Start the trackers; True when wandb is among them."""
    if not accelerator.log_with:
        return False
    init_kwargs = {"wandb": wandb_run.init_kwargs(cfg, wandb_mode, run_id, variant)}
    flat = {k: (", ".join(map(str, v)) if isinstance(v, list) else ("null" if v is None else v))
            for k, v in flatten_config(cfg).items()}  # flat scalars: what every tracker accepts
    accelerator.init_trackers(cfg["wandb"]["project"], config=flat, init_kwargs=init_kwargs)
    wandb_on = any(tr.name == "wandb" for tr in accelerator.trackers)
    if wandb_on and accelerator.is_main_process:
        wandb_run.define_metrics(accelerator.get_tracker("wandb", unwrap=True))
    return wandb_on


def _progress(accelerator, total: int, done: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True,
                disable=not accelerator.is_local_main_process)


if __name__ == "__main__":
    sys.exit(main())
