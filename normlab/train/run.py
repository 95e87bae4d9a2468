"""Train a NormLab encoder: `normlab-train [--config FILE] [--debug] [key=value ...]`, or from the checkout
`python train.py ...` and `accelerate launch train.py ...` (train.py at the repo root runs this module's main).

    accelerate launch train.py                                   # the default run (configs/default.yaml)
    accelerate launch train.py --config post_ln model.norm=rmsnorm train.lr=1e-3
    python train.py output_dir=runs/x train.resume=auto          # continue a run (its own config comes back)
    normlab-train train.max_steps=200 output_dir=runs/short      # the same, from any directory

`train` sets the run up and hands over to `train_loop`, one loop whose body is the step (normlab.train.step.train_step),
the logged metrics, the evaluations and the checkpoints; `finish` writes final/ and summary.json. What they call
follows them. The run directory and the exit codes (0 ok, 1 crash, 2 bad input, 3 a refused write):
docs/training.md.
"""

from normlab.train.cpu_share import prefer_passive_openmp  # first: OpenMP reads its wait policy once, as torch loads

prefer_passive_openmp()

import math  # noqa: E402 - (every import from here on: after the wait policy)
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import get_scheduler

import normlab.kernels
from model import NormLabForMaskedLM, NormLabForSequenceClassification
from normlab.config.loader import RunConfig, model_config_from, parse_cli
from normlab.config.run_length import eval_interval, norm_warmup_notices, warmup_steps
from normlab.data.batching import build_dataloaders
from normlab.data.sources import label_names
from normlab.data.tokenizer import load_tokenized
from normlab.files.formats import atomic_write_text
from normlab.files.writes import WriteError
from normlab.kernels.build_progress import seconds_building
from normlab.run_dir import RunDir
from normlab.tracking import wandb_run
from normlab.tracking.model_card import model_card
from normlab.train.accelerator import make_accelerator
from normlab.train.checkpointing import (
    CheckpointError,
    atomic_dir,
    list_checkpoints,
    record_write_failure,
)
from normlab.train.cpu_share import StarvationWatch
from normlab.train.evaluation import evaluate, precise_bn, precise_bn_batches
from normlab.train.optim import adamw
from normlab.train.preflight import RunStart, preflight, run_config
from normlab.train.probes import StabilityProbe, bn_by_block
from normlab.train.progress_bars import bars_on
from normlab.train.run_summary import best_key, format_summary
from normlab.train.run_writer import RunWriter, save_model_files
from normlab.train.step import StepClock, train_step
from normlab.train.stop_signal import StopSignal
from normlab.train.trainer_state import micro_batches, resume_state

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_WRITE_FAILED = 0, 1, 2, 3
BN_SPREAD = "bn_running_stats_max_diff_across_processes"  # summary.json: do the BN family's statistics agree?


def main(argv=None) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        config_file, overrides, debug = parse_cli(argv)
        return train(run_config(config_file, overrides))  # a resume: the run's own saved config, its checkpoint
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
# the run: setup, then the loop with its logging, evaluation and checkpoints, then the end


def train(start: RunStart) -> int:
    """One run of `start.cfg` (normlab.train.preflight.run_config): `start.record` is what run.json keeps of the
    command, its config_file naming the variant, a wandb tag; `start.notices` what resolving the config had to say;
    `start.resume` the checkpoint a resume continues."""
    cfg, resume_path = start.cfg, start.resume.checkpoint if start.resume else None
    more_notices, trackers, wandb_mode = preflight(cfg, start.resume)
    accelerator = make_accelerator(cfg, trackers)
    bars_on()  # off in a redirected log: before the data's and the weights' bars
    for message in [*start.notices, *more_notices]:
        accelerator.print(f"note: {message}", file=sys.stderr)
    set_seed(cfg.seed)  # same seed on every process: identical init (DDP also broadcasts it)
    wall_start, run = time.time(), None
    try:
        tokenizer, dsd, train_loader, eval_loaders = build_data(cfg, accelerator)
        batch_sampler = train_loader.batch_sampler  # ours (deterministic per (seed, epoch)), before prepare wraps it
        precise_batches = precise_bn_batches(train_loader, cfg.train.precise_bn_batches)
        building = seconds_building()
        model, optimizer, kernels = build_model(cfg, tokenizer, dsd, accelerator.device)
        building = seconds_building() - building  # the C++ build, if this run had to: not training time
        model, optimizer, train_loader, *prepared = accelerator.prepare(model, optimizer, train_loader,
                                                                        *eval_loaders.values())
        eval_loaders = dict(zip(eval_loaders, prepared))
        scheduler, total_steps = build_scheduler(cfg, accelerator, optimizer, len(train_loader))
        for message in norm_warmup_notices(model, total_steps * cfg.train.grad_accum_steps):
            accelerator.print(f"note: {message}", file=sys.stderr)
        state, resume_rng = resume_state(accelerator, start.resume, len(train_loader))
        if resume_path is not None and nothing_to_do(cfg, accelerator, state, total_steps, resume_path):
            return EXIT_OK  # nothing written: final/, summary.json and the W&B run stay as they are
        if resume_path is not None:
            accelerator.print(f"resumed from {resume_path} (step {state.step}, epoch {state.epoch})")
        run = RunWriter(cfg, accelerator, model, tokenizer, state, resume_path is not None, wandb_mode,
                        start.record, total_steps, wall_start)
        batches = micro_batches(accelerator, train_loader, batch_sampler, state, resume_rng)
        with StopSignal().installed() as stop:  # until summary.json: a launcher's late echo of a stop must not kill it
            status, facts = train_loop(cfg, accelerator, model, optimizer, scheduler, batches, eval_loaders,
                                       state, run, stop, total_steps, precise_batches)
            run.progress.close()
            summary = finish(cfg, accelerator, model, state, run, status,
                             {"total_steps": total_steps, "kernels": kernels, "kernel_build_s": building, **facts})
    except WriteError as err:  # summary.json says so if it still can; the error names the last complete checkpoint
        if run is not None:
            run.progress.close()
        if accelerator.is_main_process:
            record_write_failure(cfg.output_dir, err, accelerator.num_processes,
                                 **({"step": state.step} if run else {}))
        raise
    finally:
        with run.wandb_calls() if run is not None else nullcontext():
            accelerator.end_training()  # closes the offline W&B run: its folder is complete before it is named
    wandb_url = getattr(run.wb, "url", None) if wandb_mode == "online" else None
    accelerator.print(format_summary(summary, cfg.output_dir, cfg.data.eval_split, wandb_mode, wandb_url))
    return EXIT_OK


def train_loop(cfg, accelerator, model, optimizer, scheduler, batches, eval_loaders, state, run, stop,
               total_steps, precise_batches=()) -> tuple[str, dict]:
    """One iteration per micro-batch, an optimizer step every grad_accum_steps of them; `precise_batches`: the
    training batches precise BN recomputes the statistics over at each evaluation (none: off). -> (the run's status:
    completed, diverged (a non-finite loss or gradient) or interrupted (SIGTERM/SIGINT, after a checkpoint); the
    summary's measurements of the loop: step time, and for the BN family the running statistics' spread)."""
    t, unwrapped, facts = cfg.train, accelerator.unwrap_model(model), {}
    probe = StabilityProbe(unwrapped)  # before the first forward: its hooks must be traced too
    clock, status, eval_every = StepClock(), "completed", eval_interval(t, total_steps)
    watch = None  # a CPU run's first local process says once when other processes starve it
    if accelerator.device.type == "cpu" and accelerator.is_local_main_process:
        watch = StarvationWatch(torch.get_num_threads(), say=lambda text: run.progress.write(text, sys.stderr))
    model.train()
    while state.step < total_steps:
        batch = next(batches)
        clock.micro_batch()
        logging_step = (state.step + 1) % t.log_steps == 0
        done = train_step(accelerator, model, optimizer, batch, t.max_grad_norm, probe=probe, log=logging_step,
                          stop=stop)
        if done is None:
            continue  # on to the next micro-batch of this optimizer step
        if done.nonfinite:  # the update was not applied; the last checkpoint stays as it is
            log_divergence(accelerator, probe, state, run, done.grad_norm, optimizer.param_groups[0]["lr"])
            status = "diverged"
            break
        state.step += 1
        if logging_step:  # the learning rate this step used, read before the schedule moves on
            row = log_step(accelerator, probe, state, run, done.grad_norm, optimizer.param_groups[0]["lr"])
            if watch is not None:
                watch.update(row["train/tokens_per_s"])
        scheduler.step()
        clock.step_done()
        run.progress.update(1)

        last = state.step == total_steps
        if last and unwrapped.batch_statistics_norms():  # before evaluation, whose forward may re-sync buffers
            facts[BN_SPREAD] = bn_stats_spread(accelerator, unwrapped)
        if state.step % eval_every == 0 or last:
            run_eval(cfg, accelerator, model, eval_loaders, state, run, precise_batches)
        # a finished run ends with a checkpoint; the rotation keeps the one at the best evaluation's step, if saved
        # (as HF's Trainer, no extra saves: a study evaluating every 32 steps would checkpoint at every gain)
        if state.step % t.save_steps == 0 or last or done.interrupted:
            run.save_checkpoint(state)
        if done.interrupted:
            status = "interrupted"
            break
    return status, {"step_time_s": clock.mean_s(), **facts}


# ----------------------------------------------------------------------------------------------------------
# what the loop calls


def log_step(accelerator, probe, state, run, grad_norm: float, lr: float) -> dict:
    """Log the step's metrics; returns the probe's row."""
    row = probe.collect(accelerator, grad_norm, lr)
    spike = state.spikes.update(row["train/loss"])
    run.log({"step": state.step, "epoch": state.epoch, **row, "events/loss_spike": int(spike),
             "events/nonfinite": 0})
    run.progress.set_postfix(loss=f"{row['train/loss']:.4f}", refresh=False)
    return row


def log_divergence(accelerator, probe, state, run, grad_norm: float, lr: float) -> None:
    row = probe.collect(accelerator, grad_norm, lr, measured=False)
    step = state.step + 1
    run.log({"step": step, "epoch": state.epoch, **row, "events/loss_spike": 0, "events/nonfinite": 1})
    accelerator.print(f"\nstep {step}: non-finite loss or gradient (loss {row['train/loss']}, grad norm "
                      f"{grad_norm}); stopping, status diverged", file=sys.stderr)


def run_eval(cfg, accelerator, model, eval_loaders, state, run, precise_batches=()) -> None:
    """Evaluate eval_split (eval/*) and the dev rows if held out (dev/*), keep the best, log; the BN family also
    with the batches' own statistics (its train/eval gap) and, given `precise_batches`, with statistics recomputed
    over them (precise BN: the running statistics' own error). With dev rows the best evaluation is chosen on them,
    so that the best checkpoint's eval/accuracy is not picked on the split it reports."""
    acc, st, task, seed = accelerator, state, cfg.task, cfg.seed
    unwrapped = acc.unwrap_model(model)
    metrics, noise = {}, {}  # the noise is logged, not an evaluation the best checkpoint is chosen by
    for prefix, loader in eval_loaders.items():
        metrics.update(evaluate(acc, model, loader, task, seed, prefix=prefix))
    if unwrapped.batch_statistics_norms():
        metrics["eval/accuracy_batch_stats"] = evaluate(acc, model, eval_loaders["eval"], task, seed,
                                                        batch_stats=True)["eval/accuracy"]
        if precise_batches:
            with precise_bn(acc, model, precise_batches):
                metrics["eval/accuracy_precise_bn"] = evaluate(acc, model, eval_loaders["eval"], task,
                                                               seed)["eval/accuracy"]
            noise = stat_noise(unwrapped)
    key = best_key(metrics)
    if st.best is None or metrics[key] > st.best[key]:
        st.best = {"step": st.step, **metrics}
    st.last_eval = metrics
    run.log({"step": st.step, "epoch": st.epoch, **metrics, **noise})
    if run.wb is not None:
        with run.wandb_calls():
            wandb_run.log_depth_charts(run.wb, run.writer.path)
    if acc.is_main_process:
        run.progress.write(f"step {st.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def stat_noise(model) -> dict:
    """{bn/{i}/stat_noise: block i's mean over its batch-statistics norms}: how far the statistics that precise BN's
    training-mode forwards normalized with (each batch's, or each ghost group's) lie from the population statistics
    of the same weights (model/batch_norms.py `stat_distance`), so without the running statistics' lag that
    `stat_drift` carries. This process's batches only."""
    return {f"bn/{i}/stat_noise": sum(m.stat_noise for m in norms) / len(norms)
            for i, norms in enumerate(bn_by_block(model)) if norms and all(m.stat_noise is not None for m in norms)}


def bn_stats_spread(accelerator, model) -> float:
    """Largest difference of the BN-family running statistics between processes (0.0 when they are kept in
    sync; always 0.0 on one process)."""
    buffers = [b.float().flatten() for m in model.batch_statistics_norms().values()
               for name, b in m.named_buffers(recurse=False) if name != "num_batches_tracked"]
    if not buffers or accelerator.num_processes == 1:
        return 0.0
    local = torch.cat(buffers).to(accelerator.device)
    everyone = accelerator.gather(local.unsqueeze(0))  # (P, K)
    return (everyone - everyone[0]).abs().max().item()


# ----------------------------------------------------------------------------------------------------------
# the end of a run


def finish(cfg, accelerator, model, state, run, status: str, facts: dict) -> dict:
    """The end: final/ (completed runs only) and summary.json; returns the summary. `facts`: what train() and the
    loop know of the run (total_steps, kernels, kernel_build_s, step_time_s, and for the BN family its running
    statistics' spread across processes)."""
    checkpoints = list_checkpoints(run.dir.path)
    summary = {
        "status": status, "step": state.step, "total_steps": facts["total_steps"], "epoch": state.epoch,
        "final": state.last_eval, "best": state.best, "loss_spikes": state.spikes.spikes,
        "wall_time_s": round(run.wall_time_s(state), 2),
        "kernel_build_s": round(facts["kernel_build_s"], 2),  # part of wall_time_s
        "step_time_s": facts["step_time_s"],
        "num_processes": accelerator.num_processes,
        "cpu_threads": torch.get_num_threads() if accelerator.device.type == "cpu" else None,  # per process
        "kernels": facts["kernels"],
        "final_model": None,
        "last_checkpoint": str(checkpoints[-1][1]) if checkpoints else None,
        "best_checkpoint": next((str(p) for s, p in checkpoints if state.best and s == state.best["step"]), None),
        "wandb_run_id": state.wandb_run_id if run.wandb_on else None,
    }
    if BN_SPREAD in facts:
        summary[BN_SPREAD] = facts[BN_SPREAD]
    if status == "completed":
        summary["final_model"] = str(save_final(accelerator, model, run.tokenizer, cfg, summary))
    if run.wb is not None:
        with run.wandb_calls():
            if status != "completed":  # no final evaluation drew the depth charts up to the end
                wandb_run.log_depth_charts(run.wb, run.writer.path)
            if status == "completed" and cfg.wandb.log_model:
                wandb_run.log_model(run.wb, summary["final_model"], cfg, summary)
    if accelerator.is_main_process:
        run.dir.write_summary(summary)
        if run.wb is not None:
            with run.wandb_calls():
                wandb_run.write_summary(run.wb, summary)
    if run.writer is not None:
        run.writer.close()
    return summary


def save_final(accelerator, model, tokenizer, cfg: RunConfig, summary: dict) -> Path:
    """output_dir/final: an HF directory (config, safetensors, tokenizer, model card, run config), written to a
    temporary folder and renamed, so `final` only ever exists complete. Collective (get_state_dict gathers under
    FSDP)."""
    final = RunDir.of(cfg).final
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with atomic_dir(final, "the final model") as tmp:
            unwrapped = accelerator.unwrap_model(model)
            save_model_files(unwrapped, tmp, tokenizer, cfg, state_dict)
            id2label = unwrapped.config.id2label if cfg.task == "classification" else None
            atomic_write_text(tmp / "README.md", model_card(cfg, summary, id2label))
    accelerator.wait_for_everyone()
    return final


def nothing_to_do(cfg: RunConfig, accelerator, state, total_steps: int, resume_path: Path) -> bool:
    """A resumed run that has no step left: True, after one line, for a completed run (nothing is changed);
    ConfigError for a checkpoint beyond this config's steps."""
    if state.step < total_steps:
        return False
    done = RunDir.of(cfg).read_summary()
    if state.step == total_steps and done is not None and done.get("status") == "completed" \
            and done.get("step") == state.step:
        accelerator.print(f"{cfg.output_dir}: the run is complete ({state.step} of {total_steps} steps); nothing "
                          f"to do (to train it further, add a larger train.max_steps or train.epochs)")
        return True
    if state.step > total_steps:
        raise CheckpointError(f"checkpoint {resume_path} is at step {state.step}, beyond this config's {total_steps} "
                              f"steps; give a larger train.max_steps or train.epochs to resume it")
    return False  # its last checkpoint is written, final/ and summary.json are not yet: finish() writes them


# ----------------------------------------------------------------------------------------------------------
# setup: data, model, schedule, the resumed state, the run directory


def build_data(cfg: RunConfig, accelerator):
    """(tokenizer, raw DatasetDict, train loader, {metric prefix: eval loader}). The main process builds (and
    caches) the tokenizer and tokenized splits first, then the others load them."""
    with accelerator.main_process_first():
        dsd, tokenizer, tokenized = load_tokenized(cfg)
    low_precision = accelerator.mixed_precision in ("bf16", "fp16")
    train_loader, eval_loaders = build_dataloaders(cfg, tokenizer, tokenized,
                                                   pad_to_multiple_of=8 if low_precision else None)
    return tokenizer, dsd, train_loader, eval_loaders


def build_model(cfg: RunConfig, tokenizer, dsd, device):
    """(the model for cfg's task, sized to the tokenizer and labels; its AdamW; {operator: backend}: the
    implementations of NormLab's operators that train.kernels chose, registered for `device`)."""
    extra = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if cfg.task == "classification":
        names = label_names(dsd, cfg.data)
        extra.update(num_labels=len(names), id2label=dict(enumerate(names)),
                     label2id={name: i for i, name in enumerate(names)},
                     problem_type="single_label_classification")  # HF infers it at the first loss otherwise
                                                                  # (a config change: a torch.compile recompile)
    model_config = model_config_from(cfg, **extra)
    model = (NormLabForMaskedLM if cfg.task == "mlm" else NormLabForSequenceClassification)(model_config)
    # normlab.kernels: C++ on CPU, Triton on CUDA, or the reference PyTorch math. Registered once the model exists
    # (its construction runs no operator), before compiling; a C++ build leaves the RNG as it found it.
    t = cfg.train
    kernels = normlab.kernels.use(model, t.kernels, device)
    if t.compile:
        # In place: parameter names, state dicts and attribute access stay those of the model. dynamic: padded
        # batches change length every step; one graph with symbolic shapes instead of a recompile per length.
        model.compile(backend=t.compile_backend or "inductor", dynamic=True)
    return model, adamw(model, t), kernels


def build_scheduler(cfg: RunConfig, accelerator, optimizer, batches_per_epoch: int):
    """(the prepared schedule, the run's number of optimizer steps)."""
    t, P = cfg.train, accelerator.num_processes
    total_steps = t.max_steps or t.epochs * math.ceil(batches_per_epoch / t.grad_accum_steps)
    # The prepared scheduler steps once per process per optimizer step, hence the factor.
    scheduler = accelerator.prepare(get_scheduler(
        t.scheduler, optimizer, num_warmup_steps=warmup_steps(t, total_steps) * P, num_training_steps=total_steps * P))
    return scheduler, total_steps


if __name__ == "__main__":
    sys.exit(main())
