"""What a training run writes into its run directory as it goes (`RunWriter`): config.yaml, run.json, metrics.jsonl,
the trackers (wandb), the progress bar and the checkpoints; and what makes a folder a model directory
(`save_model_files`: final/ and every checkpoint).
"""

import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from transformers.dynamic_module_utils import custom_object_save

from normlab.config.loader import RunConfig, flatten_config, save_config
from normlab.paths import REPO_ROOT
from normlab.run_dir import MODEL_DIR_CONFIG, RunDir
from normlab.tracking import wandb_run
from normlab.tracking.metrics_jsonl import MetricsWriter
from normlab.train.checkpointing import save_checkpoint
from normlab.train.progress_bars import step_progress
from normlab.train.trainer_state import TrainerState


class RunWriter:
    """What the run writes into its run directory (`dir`, a normlab.run_dir.RunDir) as it goes: config.yaml, run.json
    and metrics.jsonl (main process), the trackers' rows, the progress bar, and its checkpoints (each a model
    directory too); `wb` is the wandb run (main process, wandb on)."""

    def __init__(self, cfg, accelerator, model, tokenizer, state: TrainerState, resumed: bool, wandb_mode: str,
                 record: dict, total_steps: int, wall_start: float):
        self.dir = RunDir.of(cfg)
        self.cfg, self.accelerator, self.tokenizer, self.wall_start = cfg, accelerator, tokenizer, wall_start
        self.model = accelerator.unwrap_model(model)
        self.writer = self.wb = None
        if accelerator.is_main_process:
            self.dir.save_config(cfg)
            # what a resume needs besides config.yaml: the --config to check a given one against, the W&B run
            self.dir.write_run_record({**record, "wandb_run_id": state.wandb_run_id})
            self.writer = MetricsWriter(self.dir.metrics_file, resume_step=state.step if resumed else None)
        variant = Path(record["config_file"]).stem if record.get("config_file") else None
        if variant is not None and (REPO_ROOT / record["config_file"]).resolve() == self.dir.config_file.resolve():
            variant = None  # launched with its own resolved config (a study's run): no variant file to tag
        self.wandb_on = _init_trackers(accelerator, cfg, wandb_mode, state.wandb_run_id, variant, total_steps)
        if self.wandb_on and accelerator.is_main_process:
            self.wb = accelerator.get_tracker("wandb", unwrap=True)
        self.progress = step_progress(total_steps, state.step, accelerator.is_local_main_process)

    def log(self, row: dict) -> None:
        if self.writer is not None:
            self.writer.write(row)
        with self.wandb_calls():
            self.accelerator.log(row, step=row["step"])  # `step` too: every wandb panel's x-axis (define_metrics)

    @contextmanager
    def wandb_calls(self):
        """Around calls that reach W&B. accelerate launch answers a stop signal by signalling every process under it,
        W&B's service process too, which ends at once: W&B's next call raises ConnectionError. Then the run says so
        once and goes on to its checkpoint and summary.json without W&B (metrics.jsonl has every step)."""
        try:
            yield
        except ConnectionError as err:
            if self.wb is None:  # not W&B's
                raise
            print(f"note: W&B's service process is gone ({err}): W&B logging ends here, metrics.jsonl has every "
                  f"step", file=sys.stderr)
            self.accelerator.trackers = [t for t in self.accelerator.trackers if t.name != "wandb"]
            self.wb = None
            import wandb

            with suppress(ConnectionError):
                wandb.teardown()  # frees what is left, and its exit hook that would raise the same error again

    def wall_time_s(self, state: TrainerState) -> float:
        """The run's wall time so far: its earlier processes' (resumed runs) and this one's."""
        return state.wall_time_s + time.time() - self.wall_start

    def save_checkpoint(self, state: TrainerState) -> None:
        """A checkpoint of this step (collective), logged to wandb when asked."""
        cfg = self.cfg
        trainer_state = state.to_checkpoint(cfg, self.accelerator.num_processes, self.wall_time_s(state))
        path = save_checkpoint(self.accelerator, self.dir.path, state.step, trainer_state,
                               keep=cfg.train.save_total_limit, protect=state.best and state.best["step"],
                               model_files=lambda folder: save_model_files(self.model, folder, self.tokenizer, cfg))
        if self.wb is not None and cfg.wandb.log_checkpoints:
            with self.wandb_calls():
                wandb_run.log_checkpoint(self.wb, path, state.step)


def _init_trackers(accelerator, cfg: RunConfig, wandb_mode: str, run_id: str, variant: str | None,
                   total_steps: int) -> bool:
    """Start the trackers; True when wandb is among them."""
    if not accelerator.log_with:
        return False
    init_kwargs = {"wandb": wandb_run.init_kwargs(cfg, wandb_mode, run_id, variant, total_steps)}
    flat = {k: (", ".join(map(str, v)) if isinstance(v, list) else ("null" if v is None else v))
            for k, v in flatten_config(cfg).items()}  # flat scalars: what every tracker accepts
    accelerator.init_trackers(cfg.wandb.project, config=flat, init_kwargs=init_kwargs)
    wandb_on = any(tr.name == "wandb" for tr in accelerator.trackers)
    if wandb_on and accelerator.is_main_process:
        wandb_run.define_metrics(accelerator.get_tracker("wandb", unwrap=True))
    return wandb_on


def save_model_files(model, folder: Path, tokenizer, cfg: RunConfig, state_dict=None) -> None:
    """What makes `folder` a model directory that from_pretrained and scripts/evaluate.py open: config.json and the
    model code, the tokenizer, and the run config as data (MODEL_DIR_CONFIG); with `state_dict`, the weights too
    (final/). A checkpoint's weights are accelerate's model.safetensors, which from_pretrained reads as well."""
    if state_dict is not None:
        model.save_pretrained(folder, state_dict=state_dict)
    else:  # what save_pretrained writes besides the weights
        model.config.architectures, model.config.dtype = [type(model).__name__], str(model.dtype).split(".")[1]
        model.fill_auto_map()
        custom_object_save(model, folder, config=model.config)
        model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_config(cfg, folder / MODEL_DIR_CONFIG)
