"""The run configuration: configs/default.yaml <- a variant file <- `key.sub=value` overrides. Each layer's keys are
checked against the schema (normlab/config/schema.py) and merged onto its OmegaConf structured config, which
converts values to their key's type; the result is a RunConfig (dataclasses: `cfg.train.lr`; `cfg.model` holds
only the model keys given), checked before any data is loaded. Every failure is a ConfigError with a one-line
message naming the key and what is valid.
"""

import contextlib
import dataclasses
import math
import os
import sys
import typing
from collections.abc import Mapping
from pathlib import Path

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ValidationError

from model.configuration_normlab import NormLabConfig
from model.norm_code import check_norm_code
from model.norms import NORM_TYPES, norm_class
from normlab.config.keys import bad_choice, describe, suggest
from normlab.config.schema import BOUNDS, TRACKERS, ModelKeys, ModelSection, RunConfig, Section
from normlab.data.documents import doc_sizes_problem
from normlab.errors import ConfigError
from normlab.files.formats import atomic_write_text, load_yaml_mapping
from normlab.paths import REPO_ROOT

CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"

# Where a user's likely mistake has a better answer than a spelling suggestion.
HINTS = {
    "model.num_labels": "the number of labels is data.num_labels (null: inferred from the training labels)",
    "model.max_length": "the truncation length is data.max_length",
}
# The W&B settings wandb.init reads from the environment (docs/wandb.md): the config's keys they set, unless a layer
# above configs/default.yaml does (a variant file, a resumed run's saved config, an override).
WANDB_ENV = {"WANDB_PROJECT": "wandb.project", "WANDB_ENTITY": "wandb.entity", "WANDB_RUN_GROUP": "wandb.group",
             "WANDB_TAGS": "wandb.tags"}
USAGE = ("{prog} [--config FILE|NAME] [--debug] [key.sub=value ...]   "
         "e.g. --config post_ln model.norm=rmsnorm train.lr=1e-3")
HELP_CONFIG = "--help-config[=WORD]: every config key (or those whose name contains WORD), its default and what it does"


def usage() -> str:
    """USAGE under the name the run was started by: train.py, or the installed normlab-train."""
    installed = bool(sys.argv) and Path(sys.argv[0]).name == "normlab-train"
    return USAGE.format(prog="normlab-train" if installed else "train.py")


def _keys_named(name: str) -> list[str]:
    """The dotted config keys that are `name` or end in it (dashes read as underscores): `max_steps` ->
    ['train.max_steps']."""
    def keys(kind, prefix=""):
        for f in dataclasses.fields(kind):
            yield from keys(f.type, f"{prefix}{f.name}.") if dataclasses.is_dataclass(f.type) else [prefix + f.name]
    name = name.replace("-", "_")
    return [k for k in keys(RunConfig) if k == name or k.rsplit(".", 1)[-1] == name]


def _key_type(key: str, source: str):
    """The schema type of a dotted key, or a ConfigError naming the key, a close match and the valid keys."""
    kind, here = RunConfig, ""
    for part in key.split("."):
        if not dataclasses.is_dataclass(kind):
            raise ConfigError(f"config key '{key}' ({source}): '{here}' is a value, not a section with sub-keys")
        fields = {f.name: f.type for f in dataclasses.fields(kind)}
        full = f"{here}.{part}" if here else part
        if part not in fields:
            close = suggest(part, fields, f"; did you mean '{here + '.' if here else ''}{{}}'?")
            named = _keys_named(part) if not here else []  # `max_steps=200`: a key of a section
            hint = f"; {HINTS[full]}" if full in HINTS else (
                close or (f"; did you mean '{named[0]}'?" if named else ""))
            under = f"under {here}" if here else "at the top level"
            raise ConfigError(f"unknown config key '{full}' ({source}){hint}; valid keys {under}: {', '.join(fields)}")
        kind, here = fields[part], full
    if dataclasses.is_dataclass(kind):
        first = dataclasses.fields(kind)[0].name
        raise ConfigError(f"'{key}' is a section ({source}); give its keys, e.g. {key}.{first}=...")
    return kind


def _wrong_type(key: str, value, kind, source: str) -> ConfigError:
    problem = f"{key} may not be null" if value is None else f"{key}={value!r} has the wrong type"
    return ConfigError(f"{problem} ({source}); expected {describe(kind)}")


def _coerce(key: str, value, source: str, raw: str | None):
    """`value` as its key's type where YAML reads it as another (OmegaConf converts the rest when the layer is
    merged); `raw` is the command line's text."""
    kind = _key_type(key, source)
    base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind  # Optional[X] -> X
    if base is str and raw is not None and value is not None and not isinstance(value, (str, list, dict)):
        value = raw.strip()  # keep `wandb.group=1.10` and `train.mixed_precision=no` as typed
    if base is str and isinstance(value, bool):
        raise ConfigError(f"{_wrong_type(key, value, kind, source)} (YAML reads yes/no/on/off as booleans: quote it, "
                          f"e.g. 'no')")
    if base is int and isinstance(value, (str, float)):
        with contextlib.suppress(ValueError, OverflowError):  # `1e3` (a string to YAML) or 1000.0 for an int
            value = int(float(value)) if float(value).is_integer() else value
    if typing.get_origin(base) is list and isinstance(value, str):  # `wandb.tags=a,b` or `wandb.tags=a`
        value = [s.strip() for s in value.split(",") if s.strip()]
    items = value if isinstance(value, list) and typing.get_origin(base) is list else []
    if isinstance(value, dict) and base is not typing.Any or any(isinstance(v, (list, dict)) for v in items):
        raise _wrong_type(key, value, kind, source)  # OmegaConf's merge lets these through
    number = value if isinstance(value, float) and base in (float, typing.Any) else None
    if isinstance(value, str) and base is float:
        with contextlib.suppress(ValueError):  # text that OmegaConf reads as a float: `inf`, `1e400`
            number = float(value)
    if number is not None and not math.isfinite(number):
        raise ConfigError(f"{key}={value!r} must be a finite number ({source})")
    return value


def _merge(cfg, pairs, source: str):
    """`cfg` with one layer's (dotted key, value, command-line text or None) pairs set, as their keys' types."""
    for key, value, raw in pairs:
        value = _coerce(key, value, source, raw)
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except ValidationError:  # a value that does not convert to its key's type
            raise _wrong_type(key, value, _key_type(key, source), source) from None
    return cfg


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


def _check_choice(key: str, value, choices):
    if value not in choices:
        raise ConfigError(bad_choice(key, value, choices))


def _check_norm(key: str, value):
    """A registered norm name (read now: a user's register_norm counts), or a module:Class imported now."""
    if value in NORM_TYPES:
        return
    if ":" not in str(value):
        raise ConfigError(bad_choice(key, value, NORM_TYPES) + ", or module:Class of a norm of your own")
    try:
        norm_class(value, key=key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_section(section: Section, prefix: str = ""):
    """Each key's metadata checks (choices, bounds, non-empty); null passes where the type allows it. The model
    section checks only the keys it gives."""
    schema = ModelSection if isinstance(section, ModelKeys) else type(section)  # ModelKeys holds the keys given
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for name, value in section.items():
        key, checks = prefix + name, fields[name].metadata
        if isinstance(value, Section):
            _check_section(value, key + ".")
        elif value is None:
            continue
        elif checks.get("norm"):
            _check_norm(key, value)
        elif "choices" in checks:
            _check_choice(key, value, checks["choices"])
        elif checks.get("nonempty") and not str(value).strip():
            raise ConfigError(f"{key} is empty; give a value (e.g. {key}=...)")
        bounds = [(sign, op, checks[name]) for name, (sign, op) in BOUNDS.items() if name in checks]
        if value is not None and not all(op(value, bound) for _, op, bound in bounds):
            raise ConfigError(f"{key}={value!r} must be {' and '.join(f'{s} {b}' for s, _, b in bounds)}")


def _validate(cfg: RunConfig, resume_given: bool):
    """The checks across keys, after each key's own (_check_section). `resume_given`: train.resume is this
    command's (a saved run's may name a checkpoint rotated away since; it is not resumed from again)."""
    _check_section(cfg)
    d, resume, report_to = cfg.data, cfg.train.resume, cfg.wandb.report_to
    if resume_given and resume is not None and resume != "auto" and not Path(resume).is_dir():
        raise ConfigError(f"train.resume={resume!r} is not an existing directory; give null, auto (latest checkpoint "
                          f"in output_dir), or a path such as {cfg.output_dir}/checkpoints/step_500")
    for name in [report_to] if isinstance(report_to, str) else report_to:
        _check_choice("wandb.report_to", name, TRACKERS + ("none",))
    if not d.name and not d.path:
        raise ConfigError("data.name and data.path are both empty; set data.name (Hub id) or data.path "
                          "(local file or folder)")
    problem = doc_sizes_problem(d.doc_sizes)
    if problem:
        raise ConfigError(problem)
    # NormLabConfig's own checks run here too, so a bad model key fails before any data loads; train.py builds the
    # model's config again once the tokenizer and labels give vocab_size and num_labels
    model_config = model_config_from(cfg)
    try:  # a run saves its model: a norm whose code cannot travel is refused now, not at the first checkpoint
        check_norm_code(model_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    positions = model_config.max_position_embeddings
    if d.max_length > positions:
        raise ConfigError(f"data.max_length={d.max_length} exceeds model.max_position_embeddings={positions}; "
                          f"lower data.max_length or set model.max_position_embeddings={d.max_length} (or more)")


def resolve_config_file(config_file: str) -> Path:
    """A path to a YAML file (from the current directory, else from the checkout: `configs/post_ln.yaml` works
    anywhere), or a bare variant name (`post_ln` -> configs/post_ln.yaml)."""
    path = Path(config_file)
    for candidate in (path, REPO_ROOT / path, CONFIG_DIR / config_file, CONFIG_DIR / f"{config_file}.yaml"):
        if candidate.is_file():
            return candidate
    variants = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "default")
    raise ConfigError(f"config file {config_file!r} not found{suggest(path.stem, variants)}; give a YAML path or "
                      f"one of the variants in {CONFIG_DIR}: {', '.join(variants)}")


def load_config(config_file: str | None = None, overrides=(), saved: tuple[dict, str] | None = None,
                layers=()) -> RunConfig:
    """configs/default.yaml <- config_file (path or bare variant name) <- `key.sub=value` overrides; checked.
    `saved`: (a run's saved config, where it was read) in place of config_file, for a resumed run. `layers`:
    (mapping of keys, nested or dotted, to values; where it comes from) pairs merged in order before the
    overrides, as a program's settings (the study's runs)."""
    merged = _Layers(config_file, saved, layers)
    return merged.checked(_merge_overrides(merged.cfg, overrides), resume_given=saved is None)


def load_resumed(saved: tuple[dict, str], overrides=()) -> tuple[dict, RunConfig]:
    """A resumed run's config, its files read and merged once: (the run's saved config (as load_config's `saved`)
    on the defaults, flat: {dotted key: value}; the same with the command's `key=value` overrides, checked). Only
    the second is checked: it is the config the run continues with, and the first differs from it only in the
    keys the overrides name."""
    merged = _Layers(None, saved, ())
    before = flatten_config(merged.typed([]))
    return before, merged.checked(_merge_overrides(merged.cfg, overrides), resume_given=False)


def _merge_overrides(cfg, overrides) -> list[str]:
    """Merge the command line's `key=value` items into `cfg`; -> the keys they name."""
    pairs = [_parse_override(item) for item in overrides]
    _merge(cfg, pairs, "command line")
    return [key for key, _, _ in pairs]


class _Layers:
    """configs/default.yaml, then the layers above it (a variant file, a saved config, a program's settings) merged
    onto the schema's OmegaConf config (`cfg`, which the command line's overrides may then update in place)."""

    def __init__(self, config_file, saved, layers):
        files = [DEFAULT_CONFIG] + ([resolve_config_file(str(config_file))] if config_file else [])
        try:  # each file: not YAML, or not a mapping
            files = [(load_yaml_mapping(path), f"in {path}") for path in files]
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.cfg, self.default = OmegaConf.structured(RunConfig), files[0][0]
        above_default = files[1:] + ([saved] if saved is not None else []) + list(layers)
        for layer, source in files[:1] + environment_layers() + above_default:
            _merge(self.cfg, [(key, value, None) for key, value in flatten_config(layer).items()], source)
        self.named = [key for layer, _ in above_default for key in flatten_config(layer)]  # keys set above the defaults

    def typed(self, also_named) -> RunConfig:
        """`cfg` as it is now, as a RunConfig (each key's type checked as it was merged, the checks across keys
        not run); `also_named`: the keys the command line set."""
        unset = [k for k in OmegaConf.missing_keys(self.cfg) if not k.startswith("model.")]
        if unset:
            raise ConfigError(f"{DEFAULT_CONFIG} has no value for {', '.join(sorted(unset))}; add it there")
        return _default_names_stay_with_their_data(_typed(OmegaConf.to_container(self.cfg)), self.default,
                                                   "data.label_names" in self.named + list(also_named))

    def checked(self, also_named, resume_given: bool) -> RunConfig:
        """`cfg` as it is now, as a checked RunConfig; `also_named`: the keys the command line set."""
        out = self.typed(also_named)
        _validate(out, resume_given)
        return out


def environment_layers() -> list[tuple[dict, str]]:
    """({config key: value}, where it comes from) of each WANDB_ENV variable that is set and not empty; WANDB_TAGS
    is comma-separated, as wandb reads it."""
    return [({key: os.environ[var]}, f"from ${var}") for var, key in WANDB_ENV.items()
            if os.environ.get(var, "").strip()]


def _default_names_stay_with_their_data(cfg: RunConfig, default: Mapping, named: bool) -> RunConfig:
    """configs/default.yaml's data.label_names name its own dataset's classes (SST-2's, which its local copies do
    not carry). Other data (a data.path, another data.name) does not inherit them: unless a layer above the defaults
    names the classes (`named`), they are null, and the data's own names or a one-line refusal decide them
    (normlab/data/sources.py, _class_names)."""
    d = cfg.data
    if named or (d.path is None and d.name == default.get("data", {}).get("name")):
        return cfg
    return replace_keys(cfg, {"data.label_names": None})


def _typed(values: dict) -> RunConfig:
    """The merged config's plain values as a RunConfig; `model` keeps only the keys given."""
    sections = {f.name: f.type for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.type)}
    model = ModelKeys({k: v for k, v in values["model"].items() if v != MISSING})
    return RunConfig(**{**values, **{name: kind(**values[name]) for name, kind in sections.items()}, "model": model})


def replace_keys(cfg: RunConfig, changes: dict) -> RunConfig:
    """A copy of `cfg` with {dotted key: value} changed (values as their keys' types; not re-checked)."""
    top = {k: v for k, v in changes.items() if "." not in k}
    for name in {k.split(".", 1)[0] for k in changes if "." in k}:
        section, sub = getattr(cfg, name), {k.split(".", 1)[1]: v for k, v in changes.items()
                                            if k.startswith(name + ".")}
        top[name] = (ModelKeys({**section.given(), **sub}) if isinstance(section, ModelKeys)
                     else dataclasses.replace(section, **sub))
    return dataclasses.replace(cfg, **top)


def model_config_from(cfg: RunConfig, **extra) -> NormLabConfig:
    """The NormLabConfig of a run; `extra` (vocab_size, num_labels, pad_token_id, ...) wins over the model keys the
    config gives."""
    try:
        return NormLabConfig(**{**cfg.model.given(), **extra})
    except Exception as e:  # ValueError from its checks, or huggingface_hub's strict-dataclass error
        raise ConfigError(" ".join(str(e).replace("NormLabConfig.", "model.").split())) from None


def save_config(cfg: RunConfig, path) -> None:
    """Write the resolved config as YAML (atomically: a kill mid-write leaves the old file)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, config_yaml(cfg))


def config_yaml(cfg: RunConfig) -> str:
    """The config as config.yaml holds it: the schema's key order, the model keys given."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def flatten_config(cfg: Mapping, prefix: str = "") -> dict:
    """{'train': {'lr': 1e-3}} (a plain dict or a RunConfig) -> {'train.lr': 1e-3} (for trackers that want flat
    keys, and to check each key)."""
    flat = {}
    for k, v in cfg.items():
        flat.update(flatten_config(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return flat


def _as_override(name: str, value: str | None) -> str:
    """'; settings are key=value: train.max_steps=200' when `--name value` names a config key, else ''."""
    keys = _keys_named(name)
    if not keys:
        return ""
    given = value if value is not None and not value.startswith("-") and "=" not in value else "..."
    return f"; settings are key=value: {' or '.join(f'{k}={given}' for k in keys)}"


def parse_cli(argv=None):
    """`[--config FILE] [--debug] [key=value ...]` -> (config_file or None, [overrides], debug)."""
    args = iter(sys.argv[1:] if argv is None else argv)
    config_file, overrides, debug = None, [], False
    for arg in args:
        if arg in ("--config", "-c") or arg.startswith("--config="):
            if config_file is not None:
                raise ConfigError(f"--config given twice ({config_file!r} and more); give one variant file and put "
                                  f"the rest in key=value overrides")
            config_file = arg.split("=", 1)[1] if "=" in arg else next(args, "")
            if not config_file:
                raise ConfigError("--config needs a file or variant name, e.g. --config configs/post_ln.yaml or "
                                  "--config post_ln")
        elif arg == "--debug":
            debug = True
        elif arg in ("-h", "--help"):
            print(f"usage: {usage()}\n  {HELP_CONFIG}")
            raise SystemExit(0)
        elif arg == "--help-config" or arg.startswith("--help-config="):
            from normlab.config.help import help_text

            print(help_text(DEFAULT_CONFIG, arg.partition("=")[2] or None))
            raise SystemExit(0)
        elif arg.startswith("-") and "=" not in arg:
            hint = _as_override(arg.lstrip("-"), next(args, None))  # `--max_steps 200`: train.max_steps=200
            raise ConfigError(f"unknown option {arg!r}{hint}; usage: {usage()}")
        elif "=" not in arg:
            raise ConfigError(f"unexpected argument {arg!r}: overrides are key=value (e.g. train.lr=1e-3) and a "
                              f"config file goes after --config")
        else:
            overrides.append(arg.lstrip("-"))  # `--train.lr=1e-3`: forgive the dashes
    return config_file, overrides, debug

