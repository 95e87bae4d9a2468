"""The run configuration: configs/default.yaml, deep-merged with a variant file, then `key.sub=value` overrides.

Two sources, one job each: the dataclasses below are the schema (each key's type, and in its metadata the
choices or bounds it must keep); configs/default.yaml holds every value, with a comment each. OmegaConf holds the
typed tree while the three layers are set key by key, converting values to their type (`1e-3` written in YAML is
a float, `1` where a float is expected is 1.0) and refusing the rest. The result is a nested plain dict (what
gets saved with the run and logged to wandb), checked before any data is loaded, so a typo costs a second, not a
tokenizer build. `model.*` may be any NormLabConfig field: that section's schema is read off NormLabConfig.
Every failure is a ConfigError (a ValueError) with a one-line message naming the key and what is valid.
"""

import dataclasses
import difflib
import inspect
import math
import operator
import sys
import typing
from pathlib import Path

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ValidationError
from transformers import SchedulerType

from common.io import atomic_write_text, load_yaml_mapping
from model.configuration_normlab import HIDDEN_ACTS, NORM_PLACEMENTS, NORM_TYPES, POOLINGS, NormLabConfig
from normlab_kernels import MODES as KERNEL_MODES

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"

TASKS = ("classification", "mlm")
WANDB_MODES = ("auto", "online", "offline", "disabled")
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
# accelerate's tracker names (accelerate.utils.LoggerType) plus "all"; kept literal so the config loads fast.
TRACKERS = ("all", "wandb", "tensorboard", "trackio", "comet_ml", "mlflow", "aim", "clearml", "dvclive", "swanlab")
# Where a user's likely mistake has a better answer than a spelling suggestion.
HINTS = {
    "model.num_labels": "the number of labels is data.num_labels (null: inferred from the training labels)",
    "model.max_length": "the truncation length is data.max_length",
}
USAGE = ("train.py [--config FILE|NAME] [--debug] [key.sub=value ...]   "
         "e.g. --config post_ln model.norm=rmsnorm train.lr=1e-3")


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is valid."""


# ----------------------------------------------------------------------------------------------------------
# the schema


def _key(**checks):
    """A schema key: no default here (configs/default.yaml holds the values); `checks` are choices=, ge=, gt=,
    lt= or nonempty=True, applied once the layers are merged."""
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
    resume: typing.Optional[str] = _key()  # null | auto | a checkpoint directory (checked in _validate)
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
    report_to: typing.Any = _key()  # one tracker name or a list of them (checked in _validate)
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


# ----------------------------------------------------------------------------------------------------------
# setting one key


def _suggest(word, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _field(key: str, source: str) -> dataclasses.Field:
    """The schema field of a dotted key, or a ConfigError naming the key, a close match and the valid keys."""
    section, here = RunConfig, ""
    for part in key.split("."):
        if not dataclasses.is_dataclass(section):
            raise ConfigError(f"config key '{key}' ({source}): '{here}' is a value, not a section with sub-keys")
        fields = {f.name: f for f in dataclasses.fields(section)}
        full = f"{here}.{part}" if here else part
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            hint = f"; {HINTS[full]}" if full in HINTS else (
                f"; did you mean '{here + '.' if here else ''}{close[0]}'?" if close else "")
            under = f"under {here}" if here else "at the top level"
            raise ConfigError(f"unknown config key '{full}' ({source}){hint}; valid keys {under}: {', '.join(fields)}")
        field, section, here = fields[part], fields[part].type, full
    if dataclasses.is_dataclass(section):
        first = dataclasses.fields(section)[0].name
        raise ConfigError(f"'{key}' is a section ({source}); give its keys, e.g. {key}.{first}=...")
    return field


def _describe(kind) -> str:
    kinds = typing.get_args(kind) if typing.get_origin(kind) is typing.Union else (kind,)
    names = [getattr(typing.get_origin(k) or k, "__name__", "any value") for k in kinds if k is not type(None)]
    return " or ".join(names) + (" or null" if type(None) in kinds else "")


def _set(cfg, key: str, value, source: str, raw: str | None = None) -> None:
    """cfg[key] = value, converted to the key's type by OmegaConf; `raw` is the command line's text."""
    kind = _field(key, source).type
    base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind  # Optional[X] -> X
    if base is str and raw is not None and value is not None and not isinstance(value, (str, list, dict)):
        value = raw.strip()  # keep `wandb.group=1.10` and `train.mixed_precision=no` as typed
    if base is str and isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} has the wrong type ({source}); expected {_describe(kind)} (YAML reads "
                          f"yes/no/on/off as booleans: quote it, e.g. 'no')")
    if base is int and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:  # `1e3` (a string to YAML) or 1000.0 where an int is expected
            value = int(float(value)) if float(value).is_integer() else value
        except (ValueError, OverflowError):
            pass
    if typing.get_origin(base) is list and isinstance(value, str):  # `wandb.tags=a,b` or `wandb.tags=a`
        value = [s.strip() for s in value.split(",") if s.strip()]
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except ValidationError:
        if value is None:
            raise ConfigError(f"{key} may not be null ({source}); expected {_describe(kind)}") from None
        raise ConfigError(f"{key}={value!r} has the wrong type ({source}); expected {_describe(kind)}") from None
    if isinstance(OmegaConf.select(cfg, key), float) and not math.isfinite(OmegaConf.select(cfg, key)):
        raise ConfigError(f"{key}={value!r} must be a finite number ({source})")


def _settings(tree: dict, prefix: str = "") -> list:
    """A YAML mapping as (dotted key, value) pairs: {'train': {'lr': 1}} -> [('train.lr', 1)]."""
    pairs = []
    for k, v in tree.items():
        pairs += _settings(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return pairs


def _read_yaml(path: Path) -> dict:
    try:
        return load_yaml_mapping(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _parse_override(item: str) -> tuple[str, object, str]:
    """`key=value` -> (key, the value as YAML reads it, the raw text)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=1e-3)")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw  # e.g. a path with odd characters: take it literally
    return key.strip(), value, raw


# ----------------------------------------------------------------------------------------------------------
# checks on the merged config


def _check_choice(key: str, value, choices):
    if value not in choices:
        raise ConfigError(
            f"{key}={value!r} is not valid{_suggest(value, choices)}; choose one of: {', '.join(map(str, choices))}"
        )


BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "lt": ("<", operator.lt)}


def _check_section(section, values: dict, prefix: str = ""):
    """Each key's metadata checks (choices, bounds, non-empty); null passes where the type allows it."""
    for f in dataclasses.fields(section):
        key, value, checks = prefix + f.name, values.get(f.name), f.metadata
        if dataclasses.is_dataclass(f.type):
            _check_section(f.type, value, key + ".")
        elif value is None:
            continue
        elif "choices" in checks:
            _check_choice(key, value, checks["choices"])
        elif checks.get("nonempty") and not str(value).strip():
            raise ConfigError(f"{key} is empty; give a value (e.g. {key}=...)")
        bounds = [(sign, op, checks[name]) for name, (sign, op) in BOUNDS.items() if name in checks]
        if value is not None and not all(op(value, bound) for _, op, bound in bounds):
            raise ConfigError(f"{key}={value!r} must be {' and '.join(f'{s} {b}' for s, _, b in bounds)}")


def _validate(cfg: dict):
    _check_section(RunConfig, cfg)
    t, d, w = cfg["train"], cfg["data"], cfg["wandb"]
    resume = t["resume"]
    if resume is not None and resume != "auto" and not Path(resume).is_dir():
        raise ConfigError(
            f"train.resume={resume!r} is not an existing directory; give null, auto (latest checkpoint in "
            f"output_dir), or a path such as {cfg['output_dir']}/checkpoints/step_500"
        )
    for name in [w["report_to"]] if isinstance(w["report_to"], str) else w["report_to"]:
        _check_choice("wandb.report_to", name, TRACKERS + ("none",))
    if not d["name"] and not d["path"]:
        raise ConfigError("data.name and data.path are both empty; set data.name (Hub id) or data.path "
                          "(local file or folder)")
    model_cfg = model_config_from(cfg)
    if d["max_length"] > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"data.max_length={d['max_length']} exceeds model.max_position_embeddings="
            f"{model_cfg.max_position_embeddings}; lower data.max_length or set "
            f"model.max_position_embeddings={d['max_length']} (or more)"
        )


# ----------------------------------------------------------------------------------------------------------
# public API


def resolve_config_file(config_file: str) -> Path:
    """A path to a YAML file, or a bare variant name (`post_ln` -> configs/post_ln.yaml)."""
    path = Path(config_file)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / config_file, CONFIG_DIR / f"{config_file}.yaml"):
        if candidate.is_file():
            return candidate
    variants = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "default")
    raise ConfigError(
        f"config file {config_file!r} not found{_suggest(path.stem, variants)}; give a YAML path or one of "
        f"the variants in {CONFIG_DIR}: {', '.join(variants)}"
    )


def load_config(config_file: str | None = None, overrides=()) -> dict:
    """configs/default.yaml <- config_file (path or bare variant name) <- `key.sub=value` overrides; checked."""
    cfg = OmegaConf.structured(RunConfig)
    layers = [(DEFAULT_CONFIG, f"in {DEFAULT_CONFIG}")]
    if config_file:
        path = resolve_config_file(str(config_file))
        layers.append((path, f"in {path}"))
    for path, source in layers:
        for key, value in _settings(_read_yaml(path)):
            _set(cfg, key, value, source)
    for item in overrides:
        key, value, raw = _parse_override(item)
        _set(cfg, key, value, "command line", raw)
    unset = [k for k in OmegaConf.missing_keys(cfg) if not k.startswith("model.")]
    if unset:
        raise ConfigError(f"{DEFAULT_CONFIG} has no value for {', '.join(sorted(unset))}; add it there")
    out = OmegaConf.to_container(cfg)
    out["model"] = {k: v for k, v in out["model"].items() if v != MISSING}  # only the model keys given
    _validate(out)
    return out


def model_config_from(cfg: dict, **extra) -> NormLabConfig:
    """The NormLabConfig of a run; `extra` (vocab_size, num_labels, pad_token_id, ...) wins over cfg['model']."""
    try:
        return NormLabConfig(**{**cfg["model"], **extra})
    except Exception as e:  # ValueError from its checks, or huggingface_hub's strict-dataclass error
        raise ConfigError(" ".join(str(e).replace("NormLabConfig.", "model.").split())) from None


def save_config(cfg: dict, path) -> None:
    """Write the resolved config as YAML (atomically: a kill mid-write leaves the old file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False))


def flatten_config(cfg: dict, prefix: str = "") -> dict:
    """{'train': {'lr': 1e-3}} -> {'train.lr': 1e-3} (for trackers that want flat keys)."""
    return dict(_settings(cfg, prefix))


def parse_cli(argv=None):
    """`[--config FILE] [--debug] [key=value ...]` -> (config_file or None, [overrides], debug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file, overrides, debug = None, [], False
    while argv:
        arg = argv.pop(0)
        if arg in ("--config", "-c") or arg.startswith("--config="):
            if config_file is not None:
                raise ConfigError(f"--config given twice ({config_file!r} and more); give one variant file and put "
                                  f"the rest in key=value overrides")
            config_file = arg.split("=", 1)[1] if "=" in arg else (argv.pop(0) if argv else "")
            if not config_file:
                raise ConfigError("--config needs a file or variant name, e.g. --config configs/post_ln.yaml or "
                                  "--config post_ln")
        elif arg == "--debug":
            debug = True
        elif arg in ("-h", "--help"):
            print(f"usage: {USAGE}")
            raise SystemExit(0)
        elif arg.startswith("-") and "=" not in arg:
            raise ConfigError(f"unknown option {arg!r}; usage: {USAGE}")
        elif "=" in arg:
            overrides.append(arg.lstrip("-"))  # `--train.lr=1e-3`: forgive the dashes
        else:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides are key=value (e.g. train.lr=1e-3) and a config file "
                f"goes after --config"
            )
    return config_file, overrides, debug


__all__ = [
    "ConfigError", "REPO_ROOT", "CONFIG_DIR", "DEFAULT_CONFIG", "TASKS", "WANDB_MODES", "RunConfig", "load_config",
    "model_config_from", "save_config", "flatten_config", "parse_cli", "resolve_config_file",
]
