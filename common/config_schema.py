"""The run config's schema: each key's type, and in its metadata the choices or bounds its value must keep
(configs/default.yaml holds the values; `model.*` is read off NormLabConfig's fields)."""

import dataclasses
import inspect
import typing

from omegaconf import MISSING
from transformers import SchedulerType

from model.configuration_normlab import HIDDEN_ACTS, NORM_PLACEMENTS, NORM_TYPES, POOLINGS, NormLabConfig
from model.ops import KERNEL_MODES

TASKS = ("classification", "mlm")
WANDB_MODES = ("auto", "online", "offline", "disabled")
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
# accelerate's tracker names (accelerate.utils.LoggerType) plus "all"; kept literal so the config loads fast.
TRACKERS = ("all", "wandb", "tensorboard", "trackio", "comet_ml", "mlflow", "aim", "clearml", "dvclive", "swanlab")


def _key(**checks):
    """A schema key without a default (configs/default.yaml holds the values); `checks` (choices=, ge=, gt=, lt=,
    nonempty=True) apply to the merged config."""
    return dataclasses.field(default=MISSING, metadata=checks)


def _model_section():
    """Every NormLabConfig field as an optional key (`float | int` read as float), with the model's choices."""
    choices = {"norm": NORM_TYPES, "norm_placement": NORM_PLACEMENTS, "pooling": POOLINGS, "hidden_act": HIDDEN_ACTS}
    fields = []
    for name, annotation in inspect.get_annotations(NormLabConfig).items():
        kinds = typing.get_args(annotation) or (annotation,)
        kind = float if float in kinds else next(k for k in kinds if k is not type(None))
        kind = typing.Optional[kind] if type(None) in kinds else kind
        fields.append((name, kind, _key(choices=choices[name]) if name in choices else _key()))
    return dataclasses.make_dataclass("ModelSection", fields)


ModelSection = _model_section()


@dataclasses.dataclass
class DataSection:
    name: str = _key()
    path: typing.Optional[str] = _key()
    text_column: str = _key(nonempty=True)
    label_column: str = _key(nonempty=True)
    num_labels: typing.Optional[int] = _key(ge=2)
    label_names: typing.Optional[typing.List[str]] = _key()
    train_split: str = _key(nonempty=True)
    eval_split: str = _key(nonempty=True)
    max_length: int = _key(ge=1)
    max_train_samples: typing.Optional[int] = _key(ge=1)
    max_eval_samples: typing.Optional[int] = _key(ge=1)
    group_by_length: bool = _key()
    tokenizer: typing.Optional[str] = _key()


@dataclasses.dataclass
class TrainSection:
    lr: float = _key(gt=0)
    weight_decay: float = _key(ge=0)
    adam_beta1: float = _key(ge=0, lt=1)
    adam_beta2: float = _key(ge=0, lt=1)
    batch_size: int = _key(ge=1)
    grad_accum_steps: int = _key(ge=1)
    epochs: int = _key(ge=1)
    max_steps: typing.Optional[int] = _key(ge=1)
    warmup_steps: int = _key(ge=0)
    scheduler: str = _key(choices=tuple(s.value for s in SchedulerType))
    max_grad_norm: float = _key(gt=0)
    mixed_precision: typing.Optional[str] = _key(choices=MIXED_PRECISIONS)
    tf32: bool = _key()
    eval_steps: int = _key(ge=1)
    save_steps: int = _key(ge=1)
    save_total_limit: int = _key(ge=1)
    log_steps: int = _key(ge=1)
    resume: typing.Optional[str] = _key()  # null | auto | a checkpoint directory (checked in common/config.py)
    cpu_threads: typing.Optional[int] = _key(ge=1)
    compile: bool = _key()
    compile_backend: str = _key()
    kernels: str = _key(choices=KERNEL_MODES)


@dataclasses.dataclass
class WandbSection:
    mode: str = _key(choices=WANDB_MODES)
    project: str = _key()
    group: typing.Optional[str] = _key()
    tags: typing.List[str] = _key()
    report_to: typing.Any = _key()  # one tracker name or a list of them (checked in common/config.py)
    log_model: bool = _key()
    log_checkpoints: bool = _key()


@dataclasses.dataclass
class RunConfig:
    seed: int = _key(ge=0, lt=2**32)
    output_dir: str = _key(nonempty=True)
    task: str = _key(choices=TASKS)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    wandb: WandbSection = dataclasses.field(default_factory=WandbSection)
