"""A study file (configs/study/*.yaml), read and checked, and expanded into its runs (docs/studies.md: the format,
chosen LRs and shared runs).
"""

import dataclasses
import itertools
import math
import typing
from pathlib import Path

from normlab.config.keys import checked
from normlab.errors import StudyError
from normlab.files.formats import load_yaml_mapping
from normlab.paths import REPO_ROOT

STUDY_CONFIG_DIR = REPO_ROOT / "configs" / "study"
AXES = ("experiment", "variant", "lr", "warmup", "seed")  # what --only can narrow
Overrides = typing.Optional[typing.Dict[str, typing.Any]]  # run config keys (train.max_steps) and their values


# The study file's schema (docs/studies.md); normlab.config.keys.checked reads a mapping into it with one-line errors.

@dataclasses.dataclass
class VariantSpec:
    config: typing.Optional[str] = None  # a configs/ variant name or a YAML path
    overrides: Overrides = None
    warmup: typing.Optional[list] = None  # which of the experiment's warmup settings (on, off) it runs
    tune: typing.Optional[str] = None  # the swept variant whose chosen LR it takes (default: itself)
    lr_scale: float = 1.0
    seeds: typing.Optional[typing.List[int]] = None  # its own seeds instead of the experiment's


@dataclasses.dataclass
class ExperimentSpec:
    lr: typing.Union[list, dict]  # LRs, {min, max, num}, or {best_of: EXPERIMENT[, ranks: 2]}
    seeds: typing.List[int]
    variants: typing.Union[dict, list, None] = None  # default: the study's arms (and factorial cells); a list: some
    description: str = ""
    overrides: Overrides = None
    warmup: typing.Optional[dict] = None  # {on: warmup steps, off: 0}


@dataclasses.dataclass
class GridSpec:
    name: str
    description: str = ""
    overrides: Overrides = None
    variants: typing.Optional[dict] = None  # variants, lr, warmup, seeds: one experiment, or every experiment's
    lr: typing.Union[list, dict, None] = None
    warmup: typing.Optional[dict] = None
    seeds: typing.Optional[typing.List[int]] = None
    wandb_project: typing.Optional[str] = None
    experiments: typing.Optional[dict] = None
    score: typing.Optional[dict] = None  # the records' scoring (normlab/study/scoring.py)
    share_runs: bool = False
    signal: typing.Optional[dict] = None  # normlab/study/signal.py's settings
    selection_from: typing.Optional[str] = None
    arms: typing.Optional[dict] = None  # the variants every experiment without its own `variants` trains
    factors: typing.Optional[dict] = None  # a 2^k design: {factor: {level: variant spec}} generates its cells
    # the analysis (normlab/study/spec.py reads these; docs/studies.md, "A study is a spec")
    test: str = dataclasses.field(default="permutation", metadata={"choices": ("permutation", "calibrated")})
    alpha: float = 0.05
    hypotheses: typing.Optional[list] = None
    aa: typing.Optional[dict] = None
    pin: typing.Optional[dict] = None
    measures: typing.Optional[list] = None
    hooks: typing.Optional[str] = None
    pilot: bool = False


def _checked(schema, values, where):
    return checked(schema, values, str(where), StudyError)


def resolve_preset(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = STUDY_CONFIG_DIR / f"{preset}.yaml"
    if candidate.is_file():
        return candidate
    choices = sorted(p.stem for p in STUDY_CONFIG_DIR.glob("*.yaml"))
    raise StudyError(f"--preset {preset!r} not found; choose one of {', '.join(choices)} or give a YAML file path")


def three_digits(x: float) -> float:
    """`x` rounded to 3 significant digits (LRs: short run names, and the grid's values as written)."""
    return round(x, 2 - math.floor(math.log10(abs(x)))) if x else 0.0


def lr_grid(spec) -> list[float]:
    """A list of LRs, or {min, max, num}: num log-spaced values from min to max (3 significant digits)."""
    if isinstance(spec, list) and spec and all(isinstance(x, (int, float)) and x > 0 for x in spec):
        return [float(x) for x in spec]
    if isinstance(spec, dict) and set(spec) == {"min", "max", "num"}:
        lo, hi, num = spec["min"], spec["max"], spec["num"]
        if not (isinstance(num, int) and num >= 1 and 0 < lo <= hi):
            raise StudyError(f"lr: {spec} needs 0 < min <= max and an integer num >= 1")
        if num == 1:
            return [float(lo)]
        return [three_digits(lo * (hi / lo) ** (i / (num - 1))) for i in range(num)]
    raise StudyError(f"lr: {spec!r} must be a list of positive numbers, {{min: .., max: .., num: ..}} or "
                     f"{{best_of: EXPERIMENT}}")


def _overrides(mapping, where) -> dict:
    """A mapping of run config keys to values, as given (the run's config loader checks them)."""
    if not all(isinstance(k, str) for k in (mapping or {})):
        raise StudyError(f"{where} must map run config keys to values, e.g. {{train.max_steps: 200}}")
    return dict(mapping or {})


def _on_off(value):
    # YAML 1.1 reads a bare on/off as a boolean; the study means the names
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)


def _check_seeds(where, seeds) -> None:
    if not seeds:
        raise StudyError(f"{where}: seeds must be a non-empty list of integers")


def _load_variants(where, variants_spec, warmup) -> dict:
    variants = {}
    for name, raw in variants_spec.items():
        spec = _checked(VariantSpec, {"config": raw} if isinstance(raw, str) or raw is None else raw,
                        f"{where}: variant {name}")
        settings = [_on_off(w) for w in (spec.warmup if spec.warmup is not None else list(warmup))]
        if not set(settings) <= set(warmup):
            raise StudyError(f"{where}: variant {name}: warmup {settings} not among the study's settings "
                             f"{list(warmup)}")
        config = spec.config
        if config is not None:
            is_file = str(config).endswith((".yaml", ".yml"))
            config_path = Path(config) if is_file else Path("configs") / f"{config}.yaml"
            if not (REPO_ROOT / config_path).is_file() and not config_path.is_file():
                raise StudyError(f"{where}: variant {name}: config file {config_path} not found")
            config = str(config_path)
        if not spec.lr_scale > 0:
            raise StudyError(f"{where}: variant {name}: lr_scale {spec.lr_scale!r} must be a positive number")
        if spec.seeds is not None:
            _check_seeds(f"{where}: variant {name}", spec.seeds)
        variants[name] = {"config": config, "overrides": _overrides(spec.overrides, f"variant {name} overrides"),
                          "warmup": list(settings), "tune": str(spec.tune or name), "lr_scale": float(spec.lr_scale),
                          "seeds": spec.seeds}
    return variants


def design_variants(raw: dict, where) -> tuple[dict, dict]:
    """({variant: spec} of the study's `arms` and the cells its `factors` generate, {cell: {factor: level}}). A
    2^k design names each cell by its levels in factor order (block ln, final mbn -> ln_mbn); a cell's spec merges
    its levels' specs (a level's `config` is the cell's; overrides add up)."""
    arms = dict(raw.get("arms") or {})
    factors = raw.get("factors") or {}
    if not isinstance(factors, dict) or not all(isinstance(v, dict) and len(v) == 2 for v in factors.values()):
        raise StudyError(f"{where}: factors must map each factor to its two levels, e.g. "
                         f"{{final: {{ln: {{}}, mbn: {{overrides: {{model.final_norm: masked_batchnorm}}}}}}}}")
    cells = {}
    if not factors:
        return arms, cells
    for combo in itertools.product(*({_on_off(k): v or {} for k, v in lv.items()}.items() for lv in factors.values())):
        name = "_".join(level for level, _ in combo)
        configs = {spec["config"] for _, spec in combo if spec.get("config")}
        if len(configs) > 1:
            raise StudyError(f"{where}: factorial cell {name} gets two configs ({', '.join(sorted(configs))}); "
                             f"let one factor's levels set `config`")
        overrides = {k: v for _, spec in combo for k, v in (spec.get("overrides") or {}).items()}
        arms[name] = {**({"config": configs.pop()} if configs else {}), "overrides": overrides}
        cells[name] = {f: level for f, (level, _) in zip(factors, combo)}
    return arms, cells


def _experiment_variants(where, variants, design: dict) -> dict:
    """An experiment's variants: its own mapping, a list of the design's arms, or (none given) all of them."""
    if isinstance(variants, dict):
        return variants
    if variants is None and design:
        return design
    unknown = [v for v in variants or [None] if v not in design]
    if unknown:
        raise StudyError(f"{where}: variants {unknown[0]!r} is not an arm of the study; choose from "
                         f"{', '.join(design) or '(no arms: give variants as a mapping)'}")
    return {v: design[v] for v in variants}


def _load_experiment(where, spec: dict, defaults: dict, design: dict | None = None) -> dict:
    """One grid: variants x lr x warmup x seeds, with its own overrides (after the study's)."""
    spec = _checked(ExperimentSpec, {**defaults, **spec}, where)
    spec.variants = _experiment_variants(where, spec.variants, design or {})
    warmup = spec.warmup or {"on": None}
    warmup = {_on_off(k): v for k, v in warmup.items()}
    if not set(warmup) <= {"on", "off"} or not all(v is None or isinstance(v, int) for v in warmup.values()):
        raise StudyError(f"{where}: warmup must map on/off to train.warmup_steps, e.g. {{on: 30, off: 0}}")
    _check_seeds(where, spec.seeds)
    best_of, ranks = _chosen_lr_spec(where, spec.lr)
    return {"description": spec.description, "variants": _load_variants(where, spec.variants, warmup),
            "overrides": _overrides(spec.overrides, f"{where} overrides"),
            "lr": [] if best_of else lr_grid(spec.lr), "best_of": best_of, "ranks": ranks, "warmup": warmup,
            "seeds": spec.seeds}


def _chosen_lr_spec(where, lr) -> tuple:
    """{best_of: E} -> (E, 1): each variant at the LR E chose; {best_of: E, ranks: 2}: at its best and at its
    runner-up LR (study v4's robustness rule). Anything else is a grid: (None, 0)."""
    if not (isinstance(lr, dict) and "best_of" in lr):
        return None, 0
    if not set(lr) <= {"best_of", "ranks"} or lr.get("ranks", 1) not in (1, 2):
        raise StudyError(f"{where}: lr {lr} must be {{best_of: EXPERIMENT}} or {{best_of: EXPERIMENT, ranks: 2}} "
                         f"(ranks 1: the best LR; 2: the best and the runner-up)")
    return lr["best_of"], lr.get("ranks", 1)


def load_grid(path: Path) -> dict:
    """The study file, checked and normalised: experiments -> {variants, lr, warmup, seeds, overrides}; a file
    without `experiments` is one unnamed experiment (its run names carry no experiment prefix)."""
    try:
        raw = load_yaml_mapping(path)
    except ValueError as e:
        raise StudyError(str(e)) from None
    grid = _checked(GridSpec, raw, path)
    design, cells = design_variants(raw, path)
    shared = {k: raw[k] for k in ("variants", "lr", "warmup", "seeds") if k in raw}
    if grid.experiments is not None:
        if not grid.experiments:
            raise StudyError(f"{path}: experiments must map names to grids (variants, lr, warmup, seeds)")
        experiments = {str(name): _load_experiment(f"{path}: experiment {name}", spec or {}, shared, design)
                       for name, spec in grid.experiments.items()}
    else:
        experiments = {"": _load_experiment(str(path), shared, {}, design)}
    out = {"name": str(grid.name), "description": grid.description,
           "overrides": _overrides(grid.overrides, "overrides"), "experiments": experiments,
           "score": grid.score or {}, "share_runs": grid.share_runs,
           "wandb_project": grid.wandb_project,
           "selection_from": grid.selection_from, "cells": cells}
    _check_selection(path, out)
    if out["share_runs"]:
        _check_shared(path, out)
    return out


def _check_selection(path, grid: dict) -> None:
    """Every {best_of: E} names a swept experiment E that has each variant's `tune` variant."""
    for name, exp in grid["experiments"].items():
        source = exp["best_of"]
        if source is None:
            continue
        src = grid["experiments"].get(source)
        if src is None or src["best_of"] is not None:
            swept = [n for n, e in grid["experiments"].items() if e["best_of"] is None]
            raise StudyError(f"{path}: experiment {name}: best_of {source!r} is not a swept experiment; "
                             f"choose one of {', '.join(swept)}")
        for variant, spec in exp["variants"].items():
            if spec["tune"] not in src["variants"]:
                raise StudyError(f"{path}: experiment {name}: variant {variant} is tuned as {spec['tune']!r}, "
                                 f"which {source} does not train; its variants: {', '.join(src['variants'])}")


def variant_overrides(grid: dict, experiment: str, variant: str, warmup: str) -> tuple:
    """Everything that makes a run of this variant what it is, except its LR and seed: (its configs/ file or
    None, {run config key: value} of the experiment and then the variant, its train.warmup_steps or None)."""
    exp = grid["experiments"][experiment]
    spec = exp["variants"][variant]
    return spec["config"], {**exp["overrides"], **spec["overrides"]}, exp["warmup"][warmup]


def _check_shared(path, grid: dict) -> None:
    """Shared runs are named by variant, LR and seed: two experiments that may give a run the same name (the same
    variant and warmup, a seed in common) must configure it alike. Disjoint seeds never share a run, so they may
    differ (e.g. an LR sweep that evaluates only at its end)."""
    seen = {}
    for name, exp in grid["experiments"].items():
        for variant, spec in exp["variants"].items():
            seeds = set(spec["seeds"] or exp["seeds"])
            for warmup in spec["warmup"]:
                config = variant_overrides(grid, name, variant, warmup)
                for other, other_config, other_seeds in seen.setdefault((variant, warmup), []):
                    if other_config != config and seeds & other_seeds:
                        raise StudyError(f"{path}: share_runs: variant {variant} (warmup {warmup}) is configured "
                                         f"differently in experiments {other} and {name}, which share seeds "
                                         f"{sorted(seeds & other_seeds)}; give one of them another name")
                seen[(variant, warmup)].append((name, config, seeds))


@dataclasses.dataclass
class RunSpec:
    """One run of a study: where it sits in the grid. Its name names its run directory; a shared run lists every
    experiment that uses it."""

    name: str
    experiment: str
    experiments: typing.List[str]
    variant: str
    lr: float
    warmup: str
    seed: int

    def placement(self) -> dict:
        """What study.json keeps of it beside its status: everything but the name that keys the entry."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}


def run_name(variant, lr, warmup, seed, experiment="") -> str:
    return f"{experiment + '-' if experiment else ''}{variant}-lr{lr:g}-wu{warmup}-s{seed}"


def chosen_lr(grid: dict, experiment: str, variant: str, selection: dict, rank: int = 0) -> float | None:
    """The LR of `rank` (0: the best, 1: the runner-up) that the sweep of a {best_of} experiment chose for the
    variant (its `tune` variant's choice, times its lr_scale); None until chosen. The one place an arm's LR at a
    rank is computed: the runs to train (run_lrs) and the analysis (engine.Study.lr) both ask it."""
    exp = grid["experiments"][experiment]
    spec = exp["variants"][variant]
    chosen = selection.get(selection_key(exp["best_of"], spec["tune"], spec["warmup"][0]))
    if not chosen or (rank == 1 and "runner_up" not in chosen):
        return None
    return three_digits(float(chosen["lr"] if rank == 0 else chosen["runner_up"]) * spec["lr_scale"])


def run_lrs(grid: dict, experiment: str, variant: str, selection: dict) -> list[float]:
    """The variant's LRs in this experiment: its grid, or the LRs its sweep chose (none until they are chosen)."""
    exp = grid["experiments"][experiment]
    if exp["best_of"] is None:
        return exp["lr"]
    lrs = [chosen_lr(grid, experiment, variant, selection, rank) for rank in range(exp.get("ranks", 1))]
    if lrs[0] is None:
        return []
    if None in lrs:
        tune = exp["variants"][variant]["tune"]
        raise StudyError(f"experiment {experiment}: needs the runner-up LR of {tune}, which selection.json "
                         f"(written by an older choice) does not have; choose again in a fresh study directory")
    return lrs


def selection_key(experiment: str, variant: str, warmup: str) -> str:
    return f"{experiment}/{variant}/wu{warmup}"


def selection_arm(key: str) -> str:
    """The variant whose choice a selection key names (selection_key's inverse, for labels)."""
    return key.split("/")[1]


def expand(grid: dict, selection: dict | None = None) -> list[RunSpec]:
    """Every run: experiment x variant x lr x (the variant's warmup settings) x seed, in that nesting order. Runs
    of a {best_of} experiment appear once `selection` holds their LR. Shared runs appear once, under the first
    experiment that needs them, with every experiment that uses them in `experiments`."""
    runs, by_name = [], {}
    # selection_from: the LRs were chosen by another study, whose sweeps are named here but never trained
    named_only = {e["best_of"] for e in grid["experiments"].values()} if grid.get("selection_from") else set()
    for experiment, exp in grid["experiments"].items():
        if experiment in named_only:
            continue
        for variant, spec in exp["variants"].items():
            lrs = run_lrs(grid, experiment, variant, selection or {})
            for lr, warmup, seed in itertools.product(lrs, spec["warmup"], spec["seeds"] or exp["seeds"]):
                name = run_name(variant, lr, warmup, seed, "" if grid.get("share_runs") else experiment)
                if name in by_name:
                    by_name[name].experiments.append(experiment)
                    continue
                by_name[name] = RunSpec(name, experiment, [experiment], variant, lr, warmup, seed)
                runs.append(by_name[name])
    return runs


def pending_selections(grid: dict, selection: dict) -> dict:
    """{selection key: (swept experiment, tune variant, warmup)} for every chosen-LR not chosen yet."""
    todo = {}
    for exp in grid["experiments"].values():
        if exp["best_of"] is not None:
            for spec in exp["variants"].values():
                key = selection_key(exp["best_of"], spec["tune"], spec["warmup"][0])
                if key not in selection:
                    todo[key] = (exp["best_of"], spec["tune"], spec["warmup"][0])
    return todo


def parse_only(items: list[str]) -> dict:
    """["variant=post_ln,pre_ln,seed=0"] -> {"variant": {"post_ln", "pre_ln"}, "seed": {"0"}}: an item without "="
    is one more value of the previous key; a repeated key gives alternatives, different keys must all match."""
    only = {}
    for text in items:
        key = None
        for item in filter(None, (s.strip() for s in text.split(","))):
            if "=" in item:
                key, value = (s.strip() for s in item.split("=", 1))
            elif key is None:
                raise StudyError(f"--only {text!r}: expected key=value items, e.g. variant=post_ln,pre_ln,seed=0")
            else:
                value = item
            if key not in AXES:
                raise StudyError(f"--only: unknown key {key!r}; narrow by one of: {', '.join(AXES)}")
            only.setdefault(key, set()).add(value)
    return only


def _matches(axis, value, wanted: str) -> bool:
    if axis == "lr":
        try:
            return math.isclose(float(value), float(wanted), rel_tol=1e-6)
        except ValueError:
            return False
    return str(value) == wanted


def narrow(runs: list[RunSpec], only: dict, strict: bool = True) -> list[RunSpec]:
    """The runs matching every --only key; a value that matches no run of the grid is an error (a typo)."""
    for axis, wanted in only.items() if strict else ():
        present = sorted({getattr(r, axis) for r in runs}, key=lambda v: (isinstance(v, str), v))
        for w in wanted:
            if not any(_matches(axis, v, w) for v in present):
                choices = ", ".join(f"{v:g}" if axis == "lr" else str(v) for v in present)
                raise StudyError(f"--only {axis}={w}: not in the grid; choose from {choices}")
    return [r for r in runs if all(any(_matches(a, getattr(r, a), w) for w in ws) for a, ws in only.items())]
