"""Train a NormLab encoder: `accelerate launch train.py [--config FILE] [--debug] [key=value ...]`.

    accelerate launch train.py                                   # the default run (configs/default.yaml)
    accelerate launch train.py --config post_ln model.norm=rmsnorm train.lr=1e-3
    python train.py output_dir=runs/x train.resume=auto          # continue a run from its newest checkpoint

Reads top to bottom: config -> run directory checks -> accelerator -> data -> model, optimizer, schedule ->
resume -> the loop (stability logging, evaluation, checkpoints, divergence and signal handling) -> final/.

The run directory (README): config.yaml, metrics.jsonl, summary.json, checkpoints/step_N/, final/, wandb/.

Exit codes: 0 when the run ended with a summary.json (status completed, diverged, or interrupted by
SIGTERM/SIGINT after saving a checkpoint: a diverged run is a result, not a crash); 2 for bad input (config, data,
checkpoint, run directory: one line on stderr, nothing deleted; `--debug` shows the traceback); 1 for a crash.
"""

import math
import os
import signal
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from common import wandb_run
from common.checkpointing import (
    CheckpointError,
    atomic_write_json,
    atomic_write_text,
    capture_rng_state,
    list_checkpoints,
    load_checkpoint,
    read_json,
    replace_dir,
    resolve_resume,
    restore_rng_state,
    save_checkpoint,
    validate_checkpoint,
)
from common.config import ConfigError, flatten_config, load_config, model_config_from, parse_cli, save_config
from common.metrics import MetricsWriter, StabilityProbe, StepCounters, clip_coefficient, gather_row
from common.optim import adamw
from common.stability import LossSpikeDetector

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT = 0, 1, 2
# Keys that may change when a run is resumed; any other difference from the checkpoint's config is an error.
RESUMABLE_CHANGES = ("train.resume", "train.max_steps", "train.epochs", "train.eval_steps", "train.save_steps",
                     "train.log_steps", "train.save_total_limit", "train.compile", "train.cpu_threads",
                     "train.tf32", "train.kernels", "wandb.")


def main(argv=None) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        config_file, overrides, debug = parse_cli(argv)
        cfg = load_config(config_file, overrides)
        return train(cfg, variant=Path(config_file).stem if config_file else None)
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
            f"output_dir={out} already holds a finished run of {what}; pick another output_dir "
            f"(a finished run is never overwritten), or pass train.resume=auto to continue it"
        )
    if summary is not None or list_checkpoints(out):
        what = f"status {status}" if status else "checkpoints"
        raise ConfigError(
            f"output_dir={out} already holds an unfinished run ({what}); pass train.resume=auto to continue it, "
            f"or pick another output_dir"
        )


def read_yaml(path):
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None


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
# building blocks of the loop


@torch.no_grad()
def evaluate(accelerator, model, loader, task: str, seed: int) -> dict:
    """Loss and accuracy over the whole eval split (classification: per example; mlm: per masked token).
    Per-example sums are gathered with gather_for_metrics, which drops the duplicates that pad the last batch
    across processes. Runs under a forked RNG seeded with `seed`: MLM masks are the same at every evaluation,
    and the training RNG stream (dropout) is left untouched, so evaluating never changes training."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, targets, correct
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for batch in loader:
            labels = batch["labels"]
            inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
            logits = model(**inputs).logits.float()
            if task == "mlm":  # logits (B, L, V), labels (B, L) with -100 off the masked positions
                target = labels != -100
                tok_loss = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")  # (B, L)
                loss = (tok_loss * target).sum(1)
                count = target.sum(1).float()
                correct = ((logits.argmax(-1) == labels) & target).sum(1).float()
            else:  # logits (B, C), labels (B,)
                loss = F.cross_entropy(logits, labels, reduction="none")
                count = torch.ones_like(loss)
                correct = (logits.argmax(-1) == labels).float()
            per_example = torch.stack([loss, count, correct], dim=1)  # (B, 3)
            totals += accelerator.gather_for_metrics(per_example).sum(0).double().cpu()
    model.train(was_training)
    loss_sum, n, correct = totals.tolist()
    return {"eval/loss": loss_sum / max(n, 1), "eval/accuracy": correct / max(n, 1)}


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


def model_card(cfg: dict, summary: dict) -> str:
    import yaml

    m = cfg["model"]
    results = "\n".join(f"| {k} | {v:.4f} |" for k, v in (summary.get("final") or {}).items()
                        if isinstance(v, float))
    return f"""---
library_name: transformers
tags: [normlab, {m['norm']}, {m['norm_placement']}-norm]
datasets: [{cfg['data']['name'] or cfg['data']['path']}]
---
# NormLab encoder: `{m['norm']}`, {m['norm_placement']} placement

Trained from scratch with NormLab's `train.py` ({cfg['task']}) for {summary['step']} optimizer steps.
The model code travels with the weights:

```python
from transformers import AutoModelForSequenceClassification, AutoTokenizer
model = AutoModelForSequenceClassification.from_pretrained("PATH", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH", trust_remote_code=True)
```

## Results (eval split `{cfg['data']['eval_split']}`, final step)

| metric | value |
|---|---|
{results}

Best: {summary.get('best')}. Loss spikes during training: {summary.get('loss_spikes')}.

## Config

```yaml
{yaml.safe_dump(cfg, sort_keys=False).strip()}
```
"""


def save_final(accelerator, model, tokenizer, cfg: dict, summary: dict) -> Path:
    """output_dir/final: an HF directory (config, safetensors, tokenizer, model card), written to a temporary
    folder and renamed, so `final` only ever exists complete. Collective (get_state_dict gathers under FSDP)."""
    out = Path(cfg["output_dir"])
    final, tmp = out / "final", out / ".tmp-final"
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        atomic_write_text(tmp / "README.md", model_card(cfg, summary))
        replace_dir(tmp, final)
    accelerator.wait_for_everyone()
    return final


def write_summary(accelerator, cfg: dict, summary: dict, wandb_on: bool) -> None:
    if not accelerator.is_main_process:
        return
    atomic_write_json(Path(cfg["output_dir"]) / "summary.json", summary)
    if wandb_on:
        wandb_run.write_summary(accelerator.get_tracker("wandb", unwrap=True), summary)


# ----------------------------------------------------------------------------------------------------------
# the run


def cpu_threads(setting, device_type: str, local_processes: int, env=os.environ):
    """Intra-op threads per process of a CPU run (None off CPU: torch's default stands):
      1. `setting` (train.cpu_threads) if given;
      2. else OMP_NUM_THREADS as the user set it -- except a 1 under `accelerate launch`, which exports
         OMP_NUM_THREADS=1 on a machine without GPUs unless told otherwise (the default run took 2 min 52 s on one
         of two cores that way);
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


def train(cfg: dict, variant: str | None = None) -> int:
    """One run of `cfg`; `variant` (the --config file's name) becomes a wandb tag."""
    t, out = cfg["train"], Path(cfg["output_dir"])
    if not isinstance(t["save_total_limit"], int) or t["save_total_limit"] < 1:
        raise ConfigError(f"train.save_total_limit={t['save_total_limit']!r} must be an integer >= 1")

    # 1. Before loading anything: which checkpoint to resume from, and is the run directory ours to write?
    check_output_dir(cfg)
    resume_path, notices = resolve_resume(t["resume"], out)
    if resume_path is not None:
        changed = check_resume_config(cfg, validate_checkpoint(resume_path)["config"], resume_path)
        notices += [f"resuming with changed {k}" for k in changed if k != "train.resume"]
    trackers, wandb_mode = resolve_trackers(cfg)
    os.environ.setdefault("WANDB_SILENT", "true")
    if "wandb" in trackers:
        os.environ["WANDB_MODE"] = wandb_mode  # offline: wandb never touches the network

    # 2. The accelerator: processes, devices, mixed precision, gradient accumulation, trackers.
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError(
            "train.py does not run under DeepSpeed (its per-step stability metrics read every parameter's gradient "
            "and update, which ZeRO partitions and applies inside backward); use configs/accelerate/fsdp.yaml or "
            "multi_gpu.yaml, or configs/accelerate/deepspeed_zero2.yaml with a transformers Trainer script"
        )
    # Several processes on a machine without GPUs (configs/accelerate/cpu_2proc.yaml): CPU processes, gloo.
    cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()
    accelerator = Accelerator(
        cpu=cpu_processes,
        gradient_accumulation_steps=t["grad_accum_steps"],
        mixed_precision=t["mixed_precision"],  # None: what `accelerate launch` was given
        log_with=trackers or None,
        project_dir=str(out),
    )
    threads = cpu_threads(t["cpu_threads"], accelerator.device.type,
                          int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
    if threads is not None:
        torch.set_num_threads(threads)
    if accelerator.device.type == "cuda":
        torch.set_float32_matmul_precision("high" if t["tf32"] else "highest")  # high = TF32 matmuls
    fsdp_float32_buffers(accelerator)
    for message in notices:
        accelerator.print(f"note: {message}", file=sys.stderr)
    # The operators' implementations (normlab_kernels: C++ on CPU, Triton on CUDA, or the reference PyTorch math),
    # chosen, built and registered before seeding: a build never runs inside the loop or touches its RNG.
    import normlab_kernels

    kernels = normlab_kernels.enable(t["kernels"], accelerator.device)
    set_seed(cfg["seed"])  # same seed on every process: identical init (DDP also broadcasts it)
    try:
        return _train(cfg, accelerator, resume_path, wandb_mode, variant, kernels)
    finally:
        accelerator.end_training()


def _train(cfg, accelerator, resume_path, wandb_mode, variant=None, kernels: dict | None = None) -> int:
    from transformers import get_scheduler

    from common.data import build_dataloaders, get_tokenizer, label_names, resolve_dataset, tokenize_splits
    from model import NormLabForMaskedLM, NormLabForSequenceClassification
    from model.norms import BatchStatNorm, set_batch_stats_in_eval

    t, d, out, task = cfg["train"], cfg["data"], Path(cfg["output_dir"]), cfg["task"]
    wall_start = time.time()

    # 3. Data: the main process builds (and caches) the tokenizer and tokenized splits first, then the others.
    with accelerator.main_process_first():
        dsd = resolve_dataset(cfg)
        tokenizer = get_tokenizer(cfg, dsd[d["train_split"]][d["text_column"]])
        tokenized = tokenize_splits(dsd, tokenizer, cfg)
    low_precision = accelerator.mixed_precision in ("bf16", "fp16")
    train_loader, eval_loader = build_dataloaders(cfg, tokenizer, tokenized,
                                                  pad_to_multiple_of=8 if low_precision else None)
    batch_sampler = train_loader.batch_sampler  # ours (deterministic per (seed, epoch)); set_epoch it directly

    # 4. Model, optimizer, and a schedule in optimizer steps.
    extra = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if task == "classification":
        names = label_names(dsd, cfg)
        extra.update(num_labels=len(names), id2label=dict(enumerate(names)),
                     label2id={name: i for i, name in enumerate(names)},
                     problem_type="single_label_classification")  # HF infers it at the first loss otherwise
                                                                  # (a config change: a torch.compile recompile)
    model_config = model_config_from(cfg, **extra)
    model = (NormLabForMaskedLM if task == "mlm" else NormLabForSequenceClassification)(model_config)
    import normlab_kernels  # model/ has nn.Dropout; with the C++ CPU backend (kernels), its faster dropout instead

    normlab_kernels.apply(model, kernels or {})
    if t["compile"]:
        # In place: parameter names, state dicts and attribute access stay those of the model. dynamic: padded
        # batches change length every step; one graph with symbolic shapes instead of a recompile per length.
        model.compile(backend=t.get("compile_backend") or "inductor", dynamic=True)
    optimizer = adamw(model, t)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    steps_per_epoch = math.ceil(len(train_loader) / t["grad_accum_steps"])
    total_steps = t["max_steps"] or t["epochs"] * steps_per_epoch
    # The prepared scheduler steps once per process per optimizer step, hence the factor.
    P = accelerator.num_processes
    scheduler = accelerator.prepare(get_scheduler(
        t["scheduler"], optimizer, num_warmup_steps=t["warmup_steps"] * P, num_training_steps=total_steps * P))
    unwrapped = accelerator.unwrap_model(model)
    uses_bn = model_config.uses_batch_statistics

    # 5. Resume: weights, optimizer, schedule and RNG from the checkpoint; the data position from its state.
    step, epoch, batches_done = 0, 0, 0
    spikes = LossSpikeDetector()
    best, last_eval, wall_before = None, None, 0.0
    run_id = uuid.uuid4().hex[:8]
    if resume_path is not None:
        st = validate_checkpoint(resume_path)
        if st["num_processes"] != P:  # the data position (batches per process) and RNG files are per process
            raise CheckpointError(f"checkpoint {resume_path} was written by {st['num_processes']} processes; "
                                  f"resume with the same number (accelerate launch --num_processes {st['num_processes']})")
        st = load_checkpoint(accelerator, resume_path)
        step, epoch, batches_done = st["step"], st["epoch"], st["batches_in_epoch"]
        spikes.load_state_dict(st["spike_detector"])
        best, last_eval, wall_before, run_id = st["best"], st["last_eval"], st["wall_time_s"], st["wandb_run_id"]
        accelerator.print(f"resumed from {resume_path} (step {step}, epoch {epoch}, {batches_done} batches into it)")
    # Resuming mid-epoch: starting the skipping data loader draws from the global RNG (the DataLoader's base
    # seed), which the uninterrupted run drew before this checkpoint. Put the restored state back after that.
    rng_after_first_batch = capture_rng_state() if 0 < batches_done < len(train_loader) else None
    if batches_done >= len(train_loader):
        epoch, batches_done = epoch + 1, 0

    # 6. The run directory and trackers.
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    writer = MetricsWriter(out / "metrics.jsonl", resume_step=step if resume_path else None) \
        if accelerator.is_main_process else None
    wandb_on = _init_trackers(accelerator, cfg, wandb_mode, run_id, variant)
    # the wandb run (main process only): charts, artifacts and the summary beyond accelerator.log's scalars
    wb = accelerator.get_tracker("wandb", unwrap=True) if wandb_on and accelerator.is_main_process else None

    # 7. The loop. One iteration = one micro-batch; an optimizer step every grad_accum_steps micro-batches.
    probe = StabilityProbe(unwrapped, BatchStatNorm if uses_bn else None)
    counters = StepCounters(accelerator.device)
    status, stop = "completed", StopSignal()
    train_time, steps_timed = 0.0, 0
    bn_spread = None  # BN family, several processes: do the running statistics agree after the last step?
    evaluated_at = saved_at = step if resume_path else -1
    progress = _progress(accelerator, total_steps, step)

    def trainer_state():
        return {"step": step, "epoch": epoch, "batches_in_epoch": batches_done, "num_processes": P,
                "spike_detector": spikes.state_dict(), "best": best, "last_eval": last_eval,
                "wall_time_s": wall_before + time.time() - wall_start, "wandb_run_id": run_id, "config": cfg}

    def run_eval():
        nonlocal best, last_eval, evaluated_at
        metrics = evaluate(accelerator, model, eval_loader, task, cfg["seed"])
        if uses_bn:  # the train/eval gap of the BN family: the same eval with the batches' own statistics
            set_batch_stats_in_eval(unwrapped, True)
            metrics["eval/accuracy_batch_stats"] = evaluate(accelerator, model, eval_loader, task, cfg["seed"])["eval/accuracy"]
            set_batch_stats_in_eval(unwrapped, False)
        key = "eval/accuracy"
        if best is None or metrics[key] > best[key]:
            best = {"step": step, **metrics}
        last_eval, evaluated_at = metrics, step
        log({"step": step, "epoch": epoch, **metrics})
        if wb is not None:
            wandb_run.log_depth_charts(wb, writer.path)
        if accelerator.is_main_process:
            progress.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def log(row):
        if writer is not None:
            writer.write(row)
        accelerator.log(row, step=row["step"])  # `step` too: every wandb panel's x-axis (define_metrics)

    def checkpoint():
        nonlocal saved_at
        path = save_checkpoint(accelerator, out, step, trainer_state(), keep=t["save_total_limit"],
                               tokenizer=tokenizer)
        saved_at = step
        if wb is not None and cfg["wandb"]["log_checkpoints"]:
            wandb_run.log_checkpoint(wb, path, step)

    model.train()
    window_start = None  # when the current optimizer step's first micro-batch started (step-time measurement)
    with stop.installed():
        while step < total_steps and status == "completed":
            if hasattr(batch_sampler, "set_epoch"):
                batch_sampler.set_epoch(epoch)
            train_loader.set_epoch(epoch)
            loader = accelerator.skip_first_batches(train_loader, batches_done) if batches_done else train_loader
            for batch in loader:
                if rng_after_first_batch is not None:
                    restore_rng_state(rng_after_first_batch)
                    rng_after_first_batch = None
                window_start = window_start or time.perf_counter()
                batches_done += 1
                logging_step = (step + 1) % t["log_steps"] == 0
                with accelerator.accumulate(model):  # decides sync_gradients: is this the window's last batch?
                    probing = logging_step and accelerator.sync_gradients
                    if probing:
                        probe.arm()
                    outputs = model(**model_inputs(batch))
                    if probing:
                        probe.read_forward(batch["attention_mask"])
                    counters.add(outputs.loss, batch["attention_mask"])
                    accelerator.backward(outputs.loss)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), t["max_grad_norm"])  # pre-clip
                        nonfinite, interrupted = step_flags(accelerator, outputs.loss, grad_norm, stop)
                        grad_norm = grad_norm.item()
                        if not nonfinite:
                            if probing:
                                probe.read_grads(clip_coefficient(grad_norm, t["max_grad_norm"]))
                                probe.snapshot()
                            lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
                            optimizer.step()
                            scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue  # on to the next micro-batch of this optimizer step

                if nonfinite:  # diverged: this step's update was not applied, the last checkpoint stays as it is
                    row = gather_row(accelerator, counters, None, grad_norm, optimizer.param_groups[0]["lr"])
                    log({"step": step + 1, "epoch": epoch, **row, "events/loss_spike": 0, "events/nonfinite": 1})
                    accelerator.print(f"\nstep {step + 1}: non-finite loss or gradient (loss {row['train/loss']}, "
                                      f"grad norm {grad_norm}); stopping, status diverged", file=sys.stderr)
                    status = "diverged"
                    break
                step += 1
                if probing:
                    probe.read_update()
                    row = gather_row(accelerator, counters, probe, grad_norm, lr)
                    spike = spikes.update(row["train/loss"])
                    log({"step": step, "epoch": epoch, **row, "events/loss_spike": int(spike), "events/nonfinite": 0})
                    progress.set_postfix(loss=f"{row['train/loss']:.4f}", refresh=False)
                    counters.reset()
                train_time += time.perf_counter() - window_start
                steps_timed, window_start = steps_timed + 1, None
                progress.update(1)

                if step == total_steps and uses_bn:  # before evaluation, whose forward may re-sync buffers (DDP)
                    bn_spread = bn_stats_spread(accelerator, unwrapped, BatchStatNorm)
                if step % t["eval_steps"] == 0 or step == total_steps:
                    run_eval()
                if step % t["save_steps"] == 0 or step == total_steps:  # a finished run ends with a checkpoint
                    checkpoint()
                if interrupted:
                    status = "interrupted"
                    break
                if step >= total_steps:
                    break
            else:  # the epoch ran out
                epoch, batches_done = epoch + 1, 0
    progress.close()

    # 8. The end: evaluate, checkpoint, final/ (completed runs only), summary.json.
    if status == "completed" and evaluated_at != step:  # resumed a run that had already finished its steps
        run_eval()
    if status in ("completed", "interrupted") and saved_at != step:
        checkpoint()
    summary = {
        "status": status, "step": step, "total_steps": total_steps, "epoch": epoch,
        "final": last_eval, "best": best, "loss_spikes": spikes.spikes,
        "wall_time_s": round(wall_before + time.time() - wall_start, 2),
        "step_time_s": round(train_time / max(steps_timed, 1), 5),
        "num_processes": P,
        "cpu_threads": torch.get_num_threads() if accelerator.device.type == "cpu" else None,  # per process
        "kernels": kernels,  # operator -> the backend that ran it (train.kernels)
        "final_model": None,
        "last_checkpoint": str(list_checkpoints(out)[-1][1]) if list_checkpoints(out) else None,
        "wandb_run_id": run_id if wandb_on else None,
    }
    if bn_spread is not None:
        summary["bn_running_stats_max_diff_across_processes"] = bn_spread
    if status == "completed":
        summary["final_model"] = str(save_final(accelerator, model, tokenizer, cfg, summary))
    if wb is not None:
        if status != "completed":  # no final evaluation drew the depth charts up to the end
            wandb_run.log_depth_charts(wb, writer.path)
        if status == "completed" and cfg["wandb"]["log_model"]:
            wandb_run.log_model(wb, summary["final_model"], cfg, summary)
    write_summary(accelerator, cfg, summary, wandb_on)
    if writer is not None:
        writer.close()
    if status != "completed":
        accelerator.print(f"run {status} at step {step}; state kept in {summary['last_checkpoint']}", file=sys.stderr)
    return EXIT_OK


MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def model_inputs(batch) -> dict:
    """The batch without the collator's extras (e.g. `length`)."""
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS}


def step_flags(accelerator, loss, grad_norm, stop: StopSignal) -> tuple[bool, bool]:
    """(non-finite loss or gradient, stop signal) on any process: one tiny all-reduce per optimizer step keeps
    every process stopping at the same step. Under fp16 the grad scaler owns inf gradients (it skips the step
    and lowers the scale), so there only the loss counts."""
    bad = ~torch.isfinite(loss.detach().float())
    if accelerator.mixed_precision != "fp16":
        bad = bad | ~torch.isfinite(grad_norm.to(bad.device))
    flags = torch.stack([bad.float(), torch.tensor(float(stop.signum is not None), device=bad.device)])
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, "sum")
    nonfinite, interrupted = (flags > 0).tolist()
    return nonfinite, interrupted


def _init_trackers(accelerator, cfg: dict, wandb_mode: str, run_id: str, variant: str | None) -> bool:
    """Start the trackers; True when wandb is among them."""
    if not accelerator.log_with:
        return False
    init_kwargs = {"wandb": wandb_run.init_kwargs(cfg, wandb_mode, run_id, variant)}
    flat = {k: (", ".join(map(str, v)) if isinstance(v, list) else ("null" if v is None else v))
            for k, v in flatten_config(cfg).items()}  # flat scalars: what every tracker accepts
    accelerator.init_trackers(cfg["wandb"]["project"], config=flat, init_kwargs=init_kwargs)
    wandb_on = any(getattr(tr, "name", None) == "wandb" for tr in accelerator.trackers)
    if wandb_on and accelerator.is_main_process:
        wandb_run.define_metrics(accelerator.get_tracker("wandb", unwrap=True))
    return wandb_on


def _progress(accelerator, total: int, done: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True,
                disable=not accelerator.is_local_main_process)


if __name__ == "__main__":
    sys.exit(main())
