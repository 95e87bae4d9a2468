"""A run directory (a run's output_dir), the one contract between train.py, scripts/evaluate.py, the study,
scripts/wandb_charts.py and the GPU check: its layout, named here and nowhere else, and its small files read and
written through one object (docs/training.md, "The run directory").

    config.yaml     the resolved run config          summary.json   how the run ended (or which write failed)
    run.json        its --config file and W&B run id  metrics.jsonl  one row per logged step and evaluation
    checkpoints/    step_N/ (a model directory too)   final/         the finished model (run config: normlab_run.yaml)
    wandb/          the offline W&B run
"""

from pathlib import Path

from normlab.errors import ConfigError
from normlab.files.formats import atomic_write_json, load_yaml_mapping, read_json
from normlab.files.writes import guarded_write

# normlab.config.loader is imported where it is used: reading a run directory (wandb_charts.py, the GPU check's summary)
# needs neither the model nor the kernels that it imports

CONFIG = "config.yaml"
RUN_RECORD = "run.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
FINISHED = ("completed", "diverged")  # a run that ended so is a result: never trained again (failed ones are)
FINAL = "final"
WANDB = "wandb"
MODEL_DIR_CONFIG = "normlab_run.yaml"  # a model directory's copy of the run config (final/, each checkpoint)


class RunDir:
    """The run directory at `path`."""

    def __init__(self, path):
        self.path = Path(path)

    @classmethod
    def of(cls, cfg) -> "RunDir":
        """The run directory of a run config (its output_dir)."""
        return cls(cfg.output_dir)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    config_file = property(lambda self: self.path / CONFIG)
    run_record_file = property(lambda self: self.path / RUN_RECORD)
    metrics_file = property(lambda self: self.path / METRICS)
    summary_file = property(lambda self: self.path / SUMMARY)
    checkpoints = property(lambda self: self.path / CHECKPOINTS)
    final = property(lambda self: self.path / FINAL)
    wandb_dir = property(lambda self: self.path / WANDB)

    def has_final(self) -> bool:
        return self.final.is_dir()

    # ---- summary.json

    def read_summary(self) -> dict | None:
        """summary.json, or None when there is none (a run still going, or not started) or it is unreadable."""
        summary = read_json(self.summary_file)
        return summary if isinstance(summary, dict) else None

    def status(self) -> str | None:
        """summary.json's status (completed, diverged, interrupted, failed), or None."""
        return (self.read_summary() or {}).get("status")

    def write_summary(self, summary: dict) -> None:
        """summary.json, atomically; a refused write raises WriteError naming it."""
        with guarded_write(SUMMARY, self.summary_file):
            atomic_write_json(self.summary_file, summary)

    # ---- the config

    def save_config(self, cfg) -> None:
        """config.yaml: the resolved config (refused writes raise WriteError)."""
        from normlab.config.loader import save_config

        with guarded_write(CONFIG, self.config_file):
            self.path.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.config_file)

    def read_config(self):
        """The run's saved config (config.yaml), validated by the loader as a RunConfig; None when the directory
        has none. A damaged or invalid file raises ConfigError naming it."""
        return read_saved_config(self.config_file)

    def read_run_record(self) -> dict:
        """run.json (the --config file and W&B run id), or {} (a run directory from before run.json)."""
        record = read_json(self.run_record_file, {})
        return record if isinstance(record, dict) else {}

    def write_run_record(self, record: dict) -> None:
        with guarded_write(RUN_RECORD, self.run_record_file):
            atomic_write_json(self.run_record_file, record)


def saved_config_raw(path) -> tuple[dict, str]:
    """(a saved config file's keys, where they were read) as load_config's `saved` takes them; ConfigError for a
    file that is not YAML or not a mapping."""
    try:
        return load_yaml_mapping(path), f"in {path}"
    except ValueError as e:
        raise ConfigError(str(e)) from None


def read_saved_config(path):
    """A saved run config (a run's config.yaml, a model directory's normlab_run.yaml) validated by the loader, or
    None when the file does not exist."""
    from normlab.config.loader import load_config

    path = Path(path)
    return load_config(saved=saved_config_raw(path)) if path.is_file() else None
