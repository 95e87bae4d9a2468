"""Where a run is and what it has seen (`TrainerState`, what a checkpoint's trainer_state.json holds besides the
config), how a resumed run gets it back from its checkpoint, and the training micro-batches from that position on.
"""

import uuid
from dataclasses import dataclass, field

from normlab.config.loader import RunConfig
from normlab.train.checkpointing import CheckpointError, load_checkpoint, mid_epoch_rng, restore_after_first
from normlab.train.preflight import Resume
from normlab.train.spikes import LossSpikeDetector


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

    def to_checkpoint(self, cfg: RunConfig, num_processes: int, wall_time_s: float) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "num_processes": num_processes, "spike_detector": self.spikes.state_dict(), "best": self.best,
                "last_eval": self.last_eval, "wall_time_s": wall_time_s, "wandb_run_id": self.wandb_run_id,
                "config": cfg.to_dict()}

    @classmethod
    def from_checkpoint(cls, st: dict) -> "TrainerState":
        spikes = LossSpikeDetector()
        spikes.load_state_dict(st["spike_detector"])
        return cls(st["step"], st["epoch"], st["batches_in_epoch"], spikes, st["best"], st["last_eval"],
                   st["wall_time_s"], st["wandb_run_id"])


def resume_state(accelerator, resume: Resume | None, batches_per_epoch: int) -> tuple[TrainerState, dict | None]:
    """The trainer state to start from, after loading the checkpoint's weights, optimizer, schedule and RNG; and
    when resuming mid-epoch, the RNG state to restore after the first batch."""
    if resume is None or resume.checkpoint is None:
        return TrainerState(), None
    resume_path, st = resume.checkpoint, resume.state
    if st["num_processes"] != accelerator.num_processes:  # the data position and RNG files are per process
        raise CheckpointError(f"checkpoint {resume_path} was written by {st['num_processes']} processes; resume "
                              f"with the same number (accelerate launch --num_processes {st['num_processes']})")
    state = TrainerState.from_checkpoint(load_checkpoint(accelerator, resume_path))
    resume_rng = mid_epoch_rng(state.batches_in_epoch, batches_per_epoch)
    if state.batches_in_epoch >= batches_per_epoch:  # saved at the end of an epoch
        state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    return state, resume_rng


def micro_batches(accelerator, train_loader, batch_sampler, state: TrainerState, resume_rng: dict | None):
    """The training micro-batches from the state's data position on, epoch after epoch (each epoch reshuffled by
    its number through `batch_sampler`, the loader's own); keeps the state's epoch and batches_in_epoch current."""
    rng = resume_rng
    while True:
        batch_sampler.set_epoch(state.epoch)
        train_loader.set_epoch(state.epoch)
        loader = train_loader
        if state.batches_in_epoch:
            loader = accelerator.skip_first_batches(loader, state.batches_in_epoch)
        for batch in restore_after_first(loader, rng):
            state.batches_in_epoch += 1
            yield batch
        state.epoch, state.batches_in_epoch, rng = state.epoch + 1, 0, None
