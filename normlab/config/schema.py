"""The run config's schema and its loaded form: each key's type, and in its metadata the choices or bounds its value
must keep (configs/default.yaml holds the values; `model.*` is read off NormLabConfig's fields). normlab.config.loader
loads a run's config into these dataclasses; code reads their attributes (`cfg.train.lr`)."""

import dataclasses
import inspect
import operator
import typing
from collections.abc import Mapping

from omegaconf import MISSING
from transformers import SchedulerType

from model.configuration_normlab import HIDDEN_ACTS, NORM_PLACEMENTS, NORM_TYPES, POOLINGS, NormLabConfig
from model.ops import KERNEL_MODES

TASKS = ("classification", "mlm")
WANDB_MODES = ("auto", "online", "offline", "disabled")
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
# accelerate's tracker names (accelerate.utils.LoggerType) plus "all"; kept literal so the config loads fast.
TRACKERS = ("all", "wandb", "tensorboard", "trackio", "comet_ml", "mlflow", "aim", "clearml", "dvclive", "swanlab")
# The bounds a key's metadata may set (_key): how an error and --help-config write each, and its test.
BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "lt": ("<", operator.lt)}


class Section(Mapping):
    """A loaded config section (or the whole config): attributes, plus a read-only mapping view of its keys, which
    compares equal to the same keys as a plain dict (a saved config.yaml read back) and is what is saved."""

    def _names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, key):
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def to_dict(self) -> dict:
        """As plain data (nested dicts and lists), in the schema's key order: what config.yaml holds."""
        return {k: v.to_dict() if isinstance(v, Section) else list(v) if isinstance(v, list) else v
                for k, v in self.items()}


class ModelKeys(Section):
    """The loaded `model` section: only the keys the config gives (NormLabConfig's defaults fill the rest when
    normlab.config.loader.model_config_from builds the model's config). Reading a key that was not given raises
    AttributeError naming it."""

    def __init__(self, given: dict):
        object.__setattr__(self, "_given", dict(given))

    def _names(self) -> list[str]:
        return list(self._given)

    def given(self) -> dict:
        return dict(self._given)

    def __getattr__(self, name):  # only for names that are not attributes: the keys
        given = object.__getattribute__(self, "_given")
        if name in given:
            return given[name]
        if name in MODEL_KEYS:
            raise AttributeError(f"model.{name} is not set in this config (NormLabConfig's default applies: read it "
                                 f"off normlab.config.loader.model_config_from(cfg))")
        raise AttributeError(f"no config key model.{name}")

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"the config is read-only (model.{name})")

    def __repr__(self) -> str:
        return f"ModelKeys({self._given!r})"


def _key(**checks):
    """A schema key without a default (configs/default.yaml holds the values); `checks` (choices=, ge=, gt=, lt=,
    nonempty=True, norm=True: a registered norm name or a module:Class) apply to the merged config."""
    return dataclasses.field(default=MISSING, metadata=checks)


def _model_section():
    """Every NormLabConfig field as an optional key (`float | int` read as float), with the model's choices."""
    choices = {"norm_placement": NORM_PLACEMENTS, "pooling": POOLINGS, "hidden_act": HIDDEN_ACTS}
    fields = []
    for name, annotation in inspect.get_annotations(NormLabConfig).items():
        kinds = typing.get_args(annotation) or (annotation,)
        kind = float if float in kinds else next(k for k in kinds if k is not type(None))
        kind = typing.Optional[kind] if type(None) in kinds else kind
        if name in ("norm", "final_norm"):  # the registry's names when checked, or a module:Class of one's own
            checks = _key(choices=NORM_TYPES, norm=True)
        else:
            checks = _key(choices=choices[name]) if name in choices else _key()
        fields.append((name, kind, checks))
    return dataclasses.make_dataclass("ModelSection", fields)


ModelSection = _model_section()  # the schema of `model` (every key optional); a loaded config holds ModelKeys
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelSection))
SECTION = dict(eq=False)  # Mapping's __eq__: a section equals a dict of the same keys


@dataclasses.dataclass(**SECTION)
class DataSection(Section):
    name: str = _key()
    path: typing.Optional[str] = _key()
    text_column: str = _key(nonempty=True)
    label_column: str = _key(nonempty=True)
    num_labels: typing.Optional[int] = _key(ge=2)
    label_names: typing.Optional[typing.List[str]] = _key()
    train_split: str = _key(nonempty=True)
    eval_split: str = _key(nonempty=True)
    eval_fraction: float = _key(gt=0, lt=1)  # of a single data file's rows (normlab/data/sources.py)
    max_length: int = _key(ge=1)
    max_train_samples: typing.Optional[int] = _key(ge=1)
    max_eval_samples: typing.Optional[int] = _key(ge=1)
    dev_rows: typing.Optional[int] = _key(ge=1)
    group_by_length: bool = _key()
    tokenizer: typing.Optional[str] = _key()
    doc_sizes: typing.Optional[typing.List[int]] = _key()  # checked in normlab/config/loader.py (odd, distinct)
    doc_seed: int = _key(ge=0, lt=2**32)
    doc_eval_sentences: int = _key(ge=1)


@dataclasses.dataclass(**SECTION)
class TrainSection(Section):
    lr: float = _key(gt=0)
    weight_decay: float = _key(ge=0)
    adam_beta1: float = _key(ge=0, lt=1)
    adam_beta2: float = _key(ge=0, lt=1)
    batch_size: int = _key(ge=1)
    grad_accum_steps: int = _key(ge=1)
    epochs: int = _key(ge=1)
    max_steps: typing.Optional[int] = _key(ge=1)
    warmup_steps: typing.Optional[int] = _key(ge=0)  # wins over warmup_ratio when set (normlab/config/run_length.py)
    warmup_ratio: typing.Optional[float] = _key(ge=0, lt=1)
    scheduler: str = _key(choices=tuple(s.value for s in SchedulerType))
    max_grad_norm: float = _key(gt=0)
    mixed_precision: typing.Optional[str] = _key(choices=MIXED_PRECISIONS)
    tf32: bool = _key()
    eval_steps: typing.Optional[int] = _key(ge=1)  # null: from eval_count and the run's length
    eval_count: int = _key(ge=1)
    precise_bn_batches: int = _key(ge=0)
    save_steps: int = _key(ge=1)
    save_total_limit: int = _key(ge=1)
    log_steps: int = _key(ge=1)
    resume: typing.Optional[str] = _key()  # null | auto | a checkpoint directory (checked in normlab/config/loader.py)
    cpu_threads: typing.Optional[int] = _key(ge=1)
    compile: bool = _key()
    compile_backend: str = _key()
    kernels: str = _key(choices=KERNEL_MODES)


@dataclasses.dataclass(**SECTION)
class WandbSection(Section):
    mode: str = _key(choices=WANDB_MODES)
    project: str = _key(nonempty=True)
    entity: typing.Optional[str] = _key()
    group: typing.Optional[str] = _key()
    tags: typing.List[str] = _key()
    report_to: typing.Any = _key()  # one tracker name or a list of them (checked in normlab/config/loader.py)
    log_model: bool = _key()
    log_checkpoints: bool = _key()


@dataclasses.dataclass(**SECTION)
class RunConfig(Section):
    seed: int = _key(ge=0, lt=2**32)
    output_dir: str = _key(nonempty=True)
    task: str = _key(choices=TASKS)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    wandb: WandbSection = dataclasses.field(default_factory=WandbSection)
