"""A study's plan: what it trains. The study file's experiments (configs/study/*.yaml) read into typed objects, with
the methods every stage asks: the runs to train, an arm's LR at a rank, the LR choices still to make
(docs/studies.md: the format, chosen LRs and shared runs). spec.py reads the file once and builds the Plan beside
the analysis."""

import dataclasses
import itertools
import math
import typing
from collections import Counter
from pathlib import Path

from normlab.config.keys import checked
from normlab.errors import StudyError
from normlab.paths import REPO_ROOT

STUDY_CONFIG_DIR = REPO_ROOT / "configs" / "study"
AXES = ("experiment", "variant", "lr", "warmup", "seed")  # what --only can narrow
Overrides = typing.Optional[typing.Dict[str, typing.Any]]  # run config keys (train.max_steps) and their values


@dataclasses.dataclass
class Variant:
    """One arm as an experiment trains it: the study file's keys, resolved in place by `resolve`."""

    config: typing.Optional[str] = None  # a configs/ variant name or a YAML path; resolved: the file's path
    overrides: Overrides = None
    warmup: typing.Optional[list] = None  # which of the experiment's warmup settings (on, off) it runs
    tune: typing.Optional[str] = None  # the swept variant whose chosen LR it takes (default: itself)
    lr_scale: float = 1.0
    seeds: typing.Optional[typing.List[int]] = None  # its own seeds instead of the experiment's

    def resolve(self, where: str, name: str, settings: dict) -> "Variant":
        """Checked, with its defaults filled in: its config file's path, its warmup settings, its tune variant."""
        self.warmup = [on_off(w) for w in (self.warmup if self.warmup is not None else list(settings))]
        if not set(self.warmup) <= set(settings):
            raise StudyError(f"{where}: warmup {self.warmup} not among the study's settings {list(settings)}")
        if self.config is not None:
            is_file = str(self.config).endswith((".yaml", ".yml"))
            path = Path(self.config) if is_file else Path("configs") / f"{self.config}.yaml"
            if not (REPO_ROOT / path).is_file() and not path.is_file():
                raise StudyError(f"{where}: config file {path} not found")
            self.config = str(path)
        if not self.lr_scale > 0:
            raise StudyError(f"{where}: lr_scale {self.lr_scale!r} must be a positive number")
        if self.seeds is not None:
            check_seeds(where, self.seeds)
        self.overrides = checked_overrides(self.overrides, f"variant {name} overrides")
        self.tune, self.lr_scale = str(self.tune or name), float(self.lr_scale)
        return self


@dataclasses.dataclass
class ExperimentFile:
    """An experiment as the study file writes it (checked into an Experiment by load_experiment)."""

    lr: typing.Union[list, dict]  # LRs, {min, max, num}, or {best_of: EXPERIMENT[, ranks: 2]}
    seeds: typing.List[int]
    variants: typing.Union[dict, list, None] = None  # default: the study's arms (and factorial cells); a list: some
    description: str = ""
    overrides: Overrides = None
    warmup: typing.Optional[dict] = None  # {on: warmup steps, off: 0}


@dataclasses.dataclass
class Experiment:
    """One grid: variants x LRs x warmup settings x seeds, with its own run config overrides (after the study's).
    A chosen-LR experiment has no LRs of its own: each variant trains at the LRs the sweep `best_of` chose."""

    name: str
    variants: typing.Dict[str, Variant]
    seeds: typing.List[int]
    warmup: typing.Dict[str, typing.Optional[int]]  # {on: train.warmup_steps (None: the config's), off: 0}
    lr: typing.List[float]  # [] where the LRs are chosen
    best_of: typing.Optional[str] = None
    ranks: int = 0  # a chosen-LR experiment's: 1 (the best LR) or 2 (the best and the runner-up)
    overrides: dict = dataclasses.field(default_factory=dict)
    description: str = ""

    def seeds_of(self, variant: str) -> list[int]:
        return self.variants[variant].seeds or self.seeds

    def settings(self, variant: str, warmup: str) -> tuple:
        """Everything that makes a run of this variant what it is, except its LR and seed: (its configs/ file or
        None, {run config key: value} of the experiment and then the variant, its train.warmup_steps or None)."""
        v = self.variants[variant]
        return v.config, {**self.overrides, **v.overrides}, self.warmup[warmup]


@dataclasses.dataclass
class RunSpec:
    """One run of a study: where it sits in the plan. Its name names its run directory; a shared run lists every
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


@dataclasses.dataclass
class Signal:
    """The `signal` measurement (normlab/study/signal.py), a stage the runner runs once the LRs it reads are known:
    every arm of `variants` at every seed, `steps` Adam steps from initialization on fixed batches."""

    variants: typing.Dict[str, typing.Any]  # arms as an experiment writes them (config, overrides, tune)
    seeds: typing.List[int]
    steps: int
    lr: typing.Union[float, dict]  # one LR for every arm, or {best_of: EXPERIMENT}: each at its tune variant's best
    batch_size: int
    max_length: int


@dataclasses.dataclass
class Plan:
    """The study's experiments and how they share runs and LR choices; `cells` maps a 2^k design's cells to their
    levels ({cell: {factor: level}})."""

    name: str
    experiments: typing.Dict[str, Experiment]
    overrides: dict = dataclasses.field(default_factory=dict)
    cells: dict = dataclasses.field(default_factory=dict)
    description: str = ""
    score: dict = dataclasses.field(default_factory=dict)  # the records' scoring (normlab/study/scoring.py)
    share_runs: bool = False
    wandb_project: typing.Optional[str] = None
    selection_from: typing.Optional[str] = None  # another study's selection.json that chose these LRs
    signal: typing.Optional[Signal] = None

    def sweeps(self) -> set[str]:
        """The experiments whose LR sweep chooses another's LRs."""
        return {e.best_of for e in self.experiments.values() if e.best_of}

    def chosen_lr(self, experiment: str, variant: str, selection: dict, rank: int = 0) -> float | None:
        """The LR of `rank` (0: the best, 1: the runner-up) that the sweep of a chosen-LR experiment chose for the
        variant; None until chosen."""
        exp = self.experiments[experiment]
        return lr_at(exp.best_of, exp.variants[variant], selection, rank)

    def signal_lr(self, variant: str, selection: dict) -> float | None:
        """The LR the `signal` measurement runs an arm at: the block's one LR, or its tune variant's best."""
        lr = self.signal.lr
        return float(lr) if not isinstance(lr, dict) else lr_at(lr["best_of"], self.signal.variants[variant], selection)

    def lrs(self, experiment: str, variant: str, selection: dict) -> list[float]:
        """The variant's LRs in this experiment: its grid, or the LRs its sweep chose (none until they are chosen)."""
        exp = self.experiments[experiment]
        if exp.best_of is None:
            return exp.lr
        lrs = [self.chosen_lr(experiment, variant, selection, rank) for rank in range(exp.ranks)]
        if lrs[0] is None:
            return []
        if None in lrs:
            raise StudyError(f"experiment {experiment}: needs the runner-up LR of {exp.variants[variant].tune}, "
                             f"which selection.json (written by an older choice) does not have; choose again in a "
                             f"fresh study directory")
        return lrs

    def runs(self, selection: dict | None = None) -> list[RunSpec]:
        """Every run: experiment x variant x lr x (the variant's warmup settings) x seed, in that nesting order. Runs
        of a chosen-LR experiment appear once `selection` holds their LR. Shared runs appear once, under the first
        experiment that needs them, with every experiment that uses them in `experiments`."""
        runs, by_name = [], {}
        # selection_from: the LRs were chosen by another study, whose sweeps are named here but never trained
        named_only = self.sweeps() if self.selection_from else set()
        for exp in (e for e in self.experiments.values() if e.name not in named_only):
            for variant, v in exp.variants.items():
                lrs = self.lrs(exp.name, variant, selection or {})
                for lr, warmup, seed in itertools.product(lrs, v.warmup, exp.seeds_of(variant)):
                    name = run_name(variant, lr, warmup, seed, "" if self.share_runs else exp.name)
                    if name in by_name:
                        by_name[name].experiments.append(exp.name)
                        continue
                    by_name[name] = RunSpec(name, exp.name, [exp.name], variant, lr, warmup, seed)
                    runs.append(by_name[name])
        return runs

    def stand_in(self, selection: dict) -> dict:
        """`selection` with a stand-in choice (LRs 1 and 2) for each one still to make: its runs are every run the
        plan can have, their LRs aside."""
        return {**selection, **{key: {"lr": 1.0, "runner_up": 2.0} for key in self.pending(selection)}}

    def unexpanded(self, selection: dict) -> dict:
        """{experiment: the runs the choices still to make will add to it, at most (one may be a run trained already,
        where a shared run's chosen LR was swept at its seed)}."""
        known = {r.name for r in self.runs(selection)}
        return dict(Counter(r.experiment for r in self.runs(self.stand_in(selection)) if r.name not in known))

    def pending(self, selection: dict) -> dict:
        """{selection key: (swept experiment, tune variant, warmup)} for every chosen LR not chosen yet: those the
        chosen-LR experiments train at, and those a {best_of} signal block measures at."""
        needs = [(e.best_of, v) for e in self.experiments.values() if e.best_of for v in e.variants.values()]
        if self.signal is not None and isinstance(self.signal.lr, dict):
            needs += [(self.signal.lr["best_of"], v) for v in self.signal.variants.values()]
        todo = {}
        for sweep, v in needs:
            key = selection_key(sweep, v.tune, v.warmup[0])
            if key not in selection:
                todo[key] = (sweep, v.tune, v.warmup[0])
        return todo


def lr_at(sweep: str, v: Variant, selection: dict, rank: int = 0) -> float | None:
    """The LR of `rank` (0: the best, 1: the runner-up) that `sweep` chose for the variant (its `tune` variant's
    choice, times its lr_scale); None until chosen. The one place an arm's LR at a rank is computed: the runs to
    train, the signal measurement and the analysis (engine.Study.lr) all ask it."""
    chosen = selection.get(selection_key(sweep, v.tune, v.warmup[0]))
    if not chosen or (rank == 1 and "runner_up" not in chosen):
        return None
    return three_digits(float(chosen["lr"] if rank == 0 else chosen["runner_up"]) * v.lr_scale)


# ---------------------------------------------------------------------------------------------------------------
# reading the study file's plan


def load_plan(top, raw: dict, where: str) -> Plan:
    """The plan of a study file already checked against its schema (`top`, spec.StudyFile; `raw` as read): a file
    without `experiments` is one unnamed experiment (its run names carry no experiment prefix)."""
    design, cells = design_variants(top.arms, top.factors, where)
    shared = {k: raw[k] for k in ("variants", "lr", "warmup", "seeds") if k in raw}
    if top.experiments is not None:
        if not top.experiments:
            raise StudyError(f"{where}: experiments must map names to grids (variants, lr, warmup, seeds)")
        experiments = [load_experiment(f"{where}: experiment {name}", str(name), {**shared, **(spec or {})}, design)
                       for name, spec in top.experiments.items()]
    else:
        experiments = [load_experiment(where, "", shared, design)]
    plan = Plan(str(top.name), {e.name: e for e in experiments}, checked_overrides(top.overrides, "overrides"), cells,
                top.description, top.score or {}, top.share_runs, top.wandb_project, top.selection_from)
    check_selection(where, plan)
    if plan.share_runs:
        check_shared(where, plan)
    if top.signal is not None:
        plan.signal = load_signal(f"{where}: signal", top.signal, plan)
    return plan


def load_signal(where: str, raw: dict, plan: Plan) -> Signal:
    """The signal block, checked: its arms resolved as variants, a {best_of} LR naming a sweep that trains each
    arm's tune variant."""
    sig = checked(Signal, raw, where, StudyError)
    sig.variants = {name: checked(Variant, v or {}, f"{where}: variant {name}", StudyError).resolve(
        f"{where}: variant {name}", name, {"on": None}) for name, v in sig.variants.items()}
    if isinstance(sig.lr, dict):
        sweep = plan.experiments.get(sig.lr.get("best_of"))
        if set(sig.lr) != {"best_of"} or sweep is None or sweep.best_of is not None:
            swept = [e.name for e in plan.experiments.values() if e.best_of is None]
            raise StudyError(f"{where}: lr {sig.lr} must be a number or {{best_of: EXPERIMENT}}, EXPERIMENT one of "
                             f"{', '.join(swept)}")
        untuned = [v.tune for v in sig.variants.values() if v.tune not in sweep.variants]
        if untuned:
            raise StudyError(f"{where}: {untuned[0]!r} is not a variant of {sweep.name}, whose best LR it would take; "
                             f"its variants: {', '.join(sweep.variants)}")
        for v in sig.variants.values():  # the choice its tune variant's sweep makes (the block itself has no warmup)
            v.warmup = sweep.variants[v.tune].warmup[:1]
    return sig


def load_experiment(where: str, name: str, raw: dict, design: dict) -> Experiment:
    spec = checked(ExperimentFile, raw, where, StudyError)
    warmup = {on_off(k): v for k, v in (spec.warmup or {"on": None}).items()}
    if not set(warmup) <= {"on", "off"} or not all(v is None or isinstance(v, int) for v in warmup.values()):
        raise StudyError(f"{where}: warmup must map on/off to train.warmup_steps, e.g. {{on: 30, off: 0}}")
    check_seeds(where, spec.seeds)
    variants = {}
    for variant, v in experiment_variants(where, spec.variants, design).items():
        at = f"{where}: variant {variant}"
        v = checked(Variant, {"config": v} if isinstance(v, str) or v is None else v, at, StudyError)
        variants[variant] = v.resolve(at, variant, warmup)
    best_of, ranks = chosen_lr_spec(where, spec.lr)
    return Experiment(name, variants, spec.seeds, warmup, [] if best_of else lr_grid(spec.lr), best_of, ranks,
                      checked_overrides(spec.overrides, f"{where} overrides"), spec.description)


def design_variants(arms, factors, where) -> tuple[dict, dict]:
    """({variant: spec} of the study's `arms` and the cells its `factors` generate, {cell: {factor: level}}). A
    2^k design names each cell by its levels in factor order (block ln, final mbn -> ln_mbn); a cell's spec merges
    its levels' specs (a level's `config` is the cell's; overrides add up)."""
    arms, factors, cells = dict(arms or {}), factors or {}, {}
    if not all(isinstance(v, dict) and len(v) == 2 for v in factors.values()):
        raise StudyError(f"{where}: factors must map each factor to its two levels, e.g. "
                         f"{{final: {{ln: {{}}, mbn: {{overrides: {{model.final_norm: masked_batchnorm}}}}}}}}")
    if not factors:
        return arms, cells
    for combo in itertools.product(*({on_off(k): v or {} for k, v in lv.items()}.items() for lv in factors.values())):
        name = "_".join(level for level, _ in combo)
        configs = {spec["config"] for _, spec in combo if spec.get("config")}
        if len(configs) > 1:
            raise StudyError(f"{where}: factorial cell {name} gets two configs ({', '.join(sorted(configs))}); "
                             f"let one factor's levels set `config`")
        cell_overrides = {k: v for _, spec in combo for k, v in (spec.get("overrides") or {}).items()}
        arms[name] = {**({"config": configs.pop()} if configs else {}), "overrides": cell_overrides}
        cells[name] = {f: level for f, (level, _) in zip(factors, combo)}
    return arms, cells


def experiment_variants(where, variants, design: dict) -> dict:
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


def chosen_lr_spec(where, lr) -> tuple:
    """{best_of: E} -> (E, 1): each variant at the LR E chose; {best_of: E, ranks: 2}: at its best and at its
    runner-up LR (study v4's robustness rule). Anything else is a grid: (None, 0)."""
    if not (isinstance(lr, dict) and "best_of" in lr):
        return None, 0
    if not set(lr) <= {"best_of", "ranks"} or lr.get("ranks", 1) not in (1, 2):
        raise StudyError(f"{where}: lr {lr} must be {{best_of: EXPERIMENT}} or {{best_of: EXPERIMENT, ranks: 2}} "
                         f"(ranks 1: the best LR; 2: the best and the runner-up)")
    return lr["best_of"], lr.get("ranks", 1)


def check_selection(where, plan: Plan) -> None:
    """Every {best_of: E} names a swept experiment E that has each variant's `tune` variant."""
    for exp in (e for e in plan.experiments.values() if e.best_of is not None):
        src = plan.experiments.get(exp.best_of)
        if src is None or src.best_of is not None:
            swept = [e.name for e in plan.experiments.values() if e.best_of is None]
            raise StudyError(f"{where}: experiment {exp.name}: best_of {exp.best_of!r} is not a swept experiment; "
                             f"choose one of {', '.join(swept)}")
        for variant, v in exp.variants.items():
            if v.tune not in src.variants:
                raise StudyError(f"{where}: experiment {exp.name}: variant {variant} is tuned as {v.tune!r}, "
                                 f"which {src.name} does not train; its variants: {', '.join(src.variants)}")


def check_shared(where, plan: Plan) -> None:
    """Shared runs are named by variant, LR and seed: two experiments that may give a run the same name (the same
    variant and warmup, a seed in common) must configure it alike. Disjoint seeds never share a run, so they may
    differ (e.g. an LR sweep that evaluates only at its end)."""
    seen = {}
    for exp in plan.experiments.values():
        for variant, v in exp.variants.items():
            seeds = set(exp.seeds_of(variant))
            for warmup in v.warmup:
                config = exp.settings(variant, warmup)
                for other, other_config, other_seeds in seen.setdefault((variant, warmup), []):
                    if other_config != config and seeds & other_seeds:
                        raise StudyError(f"{where}: share_runs: variant {variant} (warmup {warmup}) is configured "
                                         f"differently in experiments {other} and {exp.name}, which share seeds "
                                         f"{sorted(seeds & other_seeds)}; give one of them another name")
                seen[(variant, warmup)].append((exp.name, config, seeds))


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


def checked_overrides(mapping, where) -> dict:
    """A mapping of run config keys to values, as given (the run's config loader checks them)."""
    if not all(isinstance(k, str) for k in (mapping or {})):
        raise StudyError(f"{where} must map run config keys to values, e.g. {{train.max_steps: 200}}")
    return dict(mapping or {})


def on_off(value):
    # YAML 1.1 reads a bare on/off as a boolean; the study means the names
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)


def check_seeds(where, seeds) -> None:
    if not seeds:
        raise StudyError(f"{where}: seeds must be a non-empty list of integers")


def run_name(variant, lr, warmup, seed, experiment="") -> str:
    return f"{experiment + '-' if experiment else ''}{variant}-lr{lr:g}-wu{warmup}-s{seed}"


def selection_key(experiment: str, variant: str, warmup: str) -> str:
    return f"{experiment}/{variant}/wu{warmup}"


def selection_arm(key: str) -> str:
    """The variant whose choice a selection key names (selection_key's inverse, for labels)."""
    return key.split("/")[1]


def selection_warmup(key: str) -> str:
    """The warmup setting (on, off) a selection key names (selection_key's inverse, for labels)."""
    return key.split("/")[2].removeprefix("wu")


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
    """The runs matching every --only key; a value that matches no run of the plan is an error (a typo)."""
    for axis, wanted in only.items() if strict else ():
        present = sorted({getattr(r, axis) for r in runs}, key=lambda v: (isinstance(v, str), v))
        for w in wanted:
            if not any(_matches(axis, v, w) for v in present):
                choices = ", ".join(f"{v:g}" if axis == "lr" else str(v) for v in present)
                raise StudyError(f"--only {axis}={w}: not in the grid; choose from {choices}")
    return [r for r in runs if all(any(_matches(a, getattr(r, a), w) for w in ws) for a, ws in only.items())]
