"""The run configuration: configs/default.yaml, deep-merged with a variant file, then `key.sub=value` overrides.

The result is a nested plain dict (what gets saved with the run and logged to wandb). Every key and value is
checked here, before any data is loaded, so a typo costs a second, not a tokenizer build:
  - the keys of configs/default.yaml are the schema; `model.*` may be any NormLabConfig field;
  - a value must have the default's type (an int is fine where a float is expected); keys whose default is null
    have their type in NULLABLE_TYPES below;
  - choices (task, wandb.mode, ...), positivity, data.max_length <= model.max_position_embeddings, and the
    model section itself (a NormLabConfig is built from it).
Every failure is a ConfigError (a ValueError) with a one-line message naming the key and what is valid.
"""

import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import os
import sys
import types
import typing
from pathlib import Path

import yaml

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

# Keys whose default is null: their type cannot be read off the default. A null-default key missing here
# (added to default.yaml later) accepts any value.
NULLABLE_TYPES = {
    "data.path": (str,),
    "data.num_labels": (int,),
    "data.max_train_samples": (int,),
    "data.max_eval_samples": (int,),
    "data.tokenizer": (str,),
    "train.max_steps": (int,),
    "train.cpu_threads": (int,),
    "train.mixed_precision": (str,),
    "train.resume": (str,),
    "wandb.group": (str,),
}
# Keys that take more than their default's type.
EXTRA_TYPES = {"wandb.report_to": (str, list)}
# Where a user's likely mistake has a better answer than a spelling suggestion.
HINTS = {
    "model.num_labels": "the number of labels is data.num_labels (null: inferred from the training labels)",
    "model.max_length": "the truncation length is data.max_length",
}

USAGE = ("train.py [--config FILE|NAME] [--debug] [key.sub=value ...]   "
         "e.g. --config post_ln model.norm=rmsnorm train.lr=1e-3")


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is valid."""


@dataclasses.dataclass(frozen=True)
class _Leaf:
    types: tuple  # accepted types, in order of preference; () = anything
    nullable: bool

    def describe(self) -> str:
        names = " or ".join("list" if t is list else t.__name__ for t in self.types) or "any value"
        return names + (" or null" if self.nullable else "")


# ----------------------------------------------------------------------------------------------------------
# the schema: default.yaml's tree, with the model section widened to every NormLabConfig field


def _leaf_from_annotation(annotation) -> _Leaf:
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    nullable = type(None) in args
    kinds = tuple(a for a in args if a is not type(None))
    if float in kinds:  # `float | int` fields: store floats
        kinds = (float,)
    return _Leaf(kinds, nullable)


def model_fields() -> dict:
    """NormLabConfig's own fields (name -> _Leaf): the valid `model.*` keys."""
    return {name: _leaf_from_annotation(a) for name, a in inspect.get_annotations(NormLabConfig).items()}


def _leaf_from_default(key: str, value) -> _Leaf:
    if key in EXTRA_TYPES:
        return _Leaf(EXTRA_TYPES[key], value is None)
    if value is None:
        return _Leaf(NULLABLE_TYPES.get(key, ()), True)
    if isinstance(value, bool):
        return _Leaf((bool,), False)
    if isinstance(value, float):
        return _Leaf((float,), False)
    return _Leaf((type(value),), False)


def _schema_from(defaults: dict, prefix: str = "") -> dict:
    schema = {}
    for k, v in defaults.items():
        key = prefix + k
        if key == "model":
            schema[k] = model_fields()
        elif isinstance(v, dict):
            schema[k] = _schema_from(v, key + ".")
        else:
            schema[k] = _leaf_from_default(key, v)
    return schema


def _read_yaml(path: Path) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys (e.g. `model: {{norm: rmsnorm}}`), "
                          f"got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------------------------------------
# keys and values


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _child(node, part: str, here: str, source: str):
    """node[part] (schema), or a ConfigError naming the full key, a close match and the valid keys."""
    full = f"{here}.{part}" if here else part
    if not isinstance(node, dict):
        raise ConfigError(f"config key '{full}' ({source}): '{here}' is a value, not a section with sub-keys")
    if part not in node:
        close = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6)
        hint = f"; {HINTS[full]}" if full in HINTS else (
            f"; did you mean '{here + '.' if here else ''}{close[0]}'?" if close else "")
        under = f"under {here}" if here else "at the top level"
        raise ConfigError(f"unknown config key '{full}' ({source}){hint}; valid keys {under}: {', '.join(node)}")
    return node[part]


def _lookup(schema: dict, key: str, source: str):
    """The schema node (_Leaf or section dict) of a dotted key; ConfigError if it does not exist."""
    node, here = schema, ""
    for part in key.split("."):
        node = _child(node, part, here, source)
        here = f"{here}.{part}" if here else part
    return node


def _coerce(key: str, value, leaf: _Leaf, source: str):
    """`value` converted to the leaf's type, or ConfigError. YAML reads `1e-3` as a string: numbers are parsed."""
    if value is None:
        if leaf.nullable or not leaf.types:
            return None
        raise ConfigError(f"{key} may not be null ({source}); expected {leaf.describe()}")
    kinds = leaf.types
    if not kinds:
        return value
    if isinstance(value, dict):
        raise ConfigError(f"{key} is a value ({leaf.describe()}), not a section ({source})")
    if isinstance(value, bool):
        if bool in kinds:
            return value
        hint = " (YAML reads yes/no/on/off as booleans: quote it, e.g. 'no')" if str in kinds else ""
        raise ConfigError(f"{key}={value!r} has the wrong type ({source}); expected {leaf.describe()}{hint}")
    if isinstance(value, str) and (int in kinds or float in kinds):
        for parse in (int, float):
            try:
                value = parse(value.strip())
                break
            except ValueError:
                continue
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number ({source})")
        if int in kinds and isinstance(value, int):
            return value
        if float in kinds:
            return float(value)
        if int in kinds and float(value).is_integer():
            return int(value)
        if str in kinds:
            return str(value)
    if isinstance(value, str) and str in kinds:
        return value
    if list in kinds:
        if isinstance(value, str):  # `wandb.tags=a,b` or `wandb.tags=a`
            return [s.strip() for s in value.split(",") if s.strip()]
        if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            return [str(v) for v in value]
    raise ConfigError(f"{key}={value!r} has the wrong type ({source}); expected {leaf.describe()}")


def _merge(cfg: dict, update: dict, schema: dict, source: str, prefix: str = ""):
    """Deep-merge `update` (a variant file's tree) into `cfg`, checking every key and value."""
    for k, v in update.items():
        key = f"{prefix}{k}"
        node = _child(schema, str(k), prefix.rstrip("."), source)
        if isinstance(node, dict):
            if not isinstance(v, dict):
                raise ConfigError(f"'{key}' is a section ({source}); give its keys, e.g. {key}.{next(iter(node))}=...")
            _merge(cfg.setdefault(k, {}), v, node, source, key + ".")
        else:
            cfg[k] = _coerce(key, v, node, source)


def _apply_override(cfg: dict, schema: dict, item: str):
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=1e-3)")
    source = "command line"
    node = _lookup(schema, key, source)
    if isinstance(node, dict):
        raise ConfigError(f"'{key}' is a section ({source}); set one of its keys, e.g. {key}.{next(iter(node))}=...")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw  # e.g. a path with odd characters: take it literally
    if str in node.types and list not in node.types and value is not None and not isinstance(value, (str, list, dict)):
        value = raw.strip()  # keep `wandb.group=1.10` and `train.mixed_precision=no` as typed
    value = _coerce(key, value, node, source)
    parts = key.split(".")
    target = cfg
    for p in parts[:-1]:
        target = target.setdefault(p, {})
    target[parts[-1]] = value


# ----------------------------------------------------------------------------------------------------------
# cross checks


def _check_choice(key: str, value, choices):
    if value not in choices:
        raise ConfigError(
            f"{key}={value!r} is not valid{_suggest(value, choices)}; choose one of: {', '.join(map(str, choices))}"
        )


def _check_min(cfg: dict, key: str, low, inclusive=True, upper=None):
    section, _, name = key.rpartition(".")
    value = (cfg.get(section, {}) if section else cfg).get(name)
    if value is None:  # null where allowed, or a key this version of default.yaml does not have
        return
    ok = (value >= low if inclusive else value > low) and (upper is None or value < upper)
    if not ok:
        rng = f"{'>=' if inclusive else '>'} {low}" + (f" and < {upper}" if upper is not None else "")
        raise ConfigError(f"{key}={value!r} must be {rng}")


def _validate(cfg: dict):
    _check_choice("task", cfg["task"], TASKS)
    _check_min(cfg, "seed", 0, upper=2**32)
    if not cfg["output_dir"].strip():
        raise ConfigError("output_dir is empty; give a run directory, e.g. output_dir=runs/my_run")

    t, d, w, m = cfg["train"], cfg["data"], cfg["wandb"], cfg["model"]
    for key in ("lr", "max_grad_norm"):
        _check_min(cfg, f"train.{key}", 0, inclusive=False)
    for key in ("batch_size", "grad_accum_steps", "epochs", "max_steps", "eval_steps", "save_steps", "log_steps",
                "save_total_limit", "cpu_threads"):
        _check_min(cfg, f"train.{key}", 1)
    _check_min(cfg, "train.warmup_steps", 0)
    _check_min(cfg, "train.weight_decay", 0)
    _check_min(cfg, "train.adam_beta1", 0, upper=1)
    _check_min(cfg, "train.adam_beta2", 0, upper=1)
    if t.get("mixed_precision") is not None:
        _check_choice("train.mixed_precision", t["mixed_precision"], MIXED_PRECISIONS)
    from transformers import SchedulerType  # light: transformers imports lazily

    _check_choice("train.scheduler", t["scheduler"], [s.value for s in SchedulerType])
    _check_choice("train.kernels", t["kernels"], KERNEL_MODES)
    resume = t.get("resume")
    if resume is not None and resume != "auto" and not Path(resume).is_dir():
        raise ConfigError(
            f"train.resume={resume!r} is not an existing directory; give null, auto (latest checkpoint in "
            f"output_dir), or a path such as {cfg['output_dir']}/checkpoints/step_500"
        )

    _check_choice("wandb.mode", w["mode"], WANDB_MODES)
    for name in [w["report_to"]] if isinstance(w["report_to"], str) else w["report_to"]:
        _check_choice("wandb.report_to", name, TRACKERS + ("none",))

    for key in ("max_length", "max_train_samples", "max_eval_samples"):
        _check_min(cfg, f"data.{key}", 1)
    _check_min(cfg, "data.num_labels", 2)
    for key in ("text_column", "label_column", "train_split", "eval_split"):
        if not d[key]:
            raise ConfigError(f"data.{key} is empty; give a column/split name")
    if not d["name"] and not d["path"]:
        raise ConfigError("data.name and data.path are both empty; set data.name (Hub id) or data.path "
                          "(local file or folder)")

    for key, choices in (("norm", NORM_TYPES), ("norm_placement", NORM_PLACEMENTS), ("pooling", POOLINGS),
                         ("hidden_act", HIDDEN_ACTS)):
        if key in m:
            _check_choice(f"model.{key}", m[key], choices)
    try:
        model_cfg = NormLabConfig(**m)
    except Exception as e:  # ValueError from its checks, or huggingface_hub's strict-dataclass error
        raise ConfigError(" ".join(str(e).replace("NormLabConfig.", "model.").split())) from None
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
    defaults = _read_yaml(DEFAULT_CONFIG)
    schema = _schema_from(defaults)
    cfg = {}
    _merge(cfg, defaults, schema, source=f"in {DEFAULT_CONFIG}")  # also coerces, e.g. a float written `1e-3`
    if config_file:
        path = resolve_config_file(str(config_file))
        _merge(cfg, _read_yaml(path), schema, source=f"in {path}")
    for item in overrides:
        _apply_override(cfg, schema, item)
    _validate(cfg)
    return cfg


def model_config_from(cfg: dict, **extra) -> NormLabConfig:
    """The NormLabConfig of a run; `extra` (vocab_size, num_labels, pad_token_id, ...) wins over cfg['model']."""
    kwargs = {**cfg["model"], **extra}
    try:
        return NormLabConfig(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(" ".join(str(e).replace("NormLabConfig.", "model.").split())) from None


def save_config(cfg: dict, path) -> None:
    """Write the resolved config as YAML (atomically: a kill mid-write leaves the old file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False, default_flow_style=False)
    os.replace(tmp, path)


def config_hash(cfg_subset) -> str:
    """A short stable hash of any JSON-able part of a config (key order does not matter)."""
    blob = json.dumps(cfg_subset, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def flatten_config(cfg: dict, prefix: str = "") -> dict:
    """{'train': {'lr': 1e-3}} -> {'train.lr': 1e-3} (for trackers that want flat keys)."""
    flat = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            flat.update(flatten_config(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def parse_cli(argv=None):
    """`[--config FILE] [--debug] [key=value ...]` -> (config_file or None, [overrides], debug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file, overrides, debug = None, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("--config", "-c") or arg.startswith("--config="):
            if config_file is not None:
                raise ConfigError(f"--config given twice ({config_file!r} and more); give one variant file and put "
                                  f"the rest in key=value overrides")
            if "=" in arg:
                config_file = arg.split("=", 1)[1]
            elif i < len(argv):
                config_file, i = argv[i], i + 1
            else:
                config_file = ""
            if not config_file:
                raise ConfigError("--config needs a file or variant name, e.g. --config configs/post_ln.yaml or "
                                  "--config post_ln")
        elif arg == "--debug":
            debug = True
        elif arg in ("-h", "--help"):
            print(f"usage: {USAGE}")
            raise SystemExit(0)
        elif arg.startswith("--") and "=" in arg:  # `--train.lr=1e-3`: forgive the dashes
            overrides.append(arg[2:])
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; usage: {USAGE}")
        elif "=" in arg:
            overrides.append(arg)
        else:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides are key=value (e.g. train.lr=1e-3) and a config file "
                f"goes after --config"
            )
    return config_file, overrides, debug


__all__ = [
    "ConfigError", "REPO_ROOT", "CONFIG_DIR", "DEFAULT_CONFIG", "TASKS", "WANDB_MODES", "load_config",
    "model_config_from", "save_config", "config_hash", "flatten_config", "parse_cli", "resolve_config_file",
]
