"""A study as data: the study file (configs/study/*.yaml) read once into a StudySpec, its plan (plan.py: what it
trains) and its analysis: the hypotheses, each an outcome, a contrast over arms, a predicted sign and a Holm family;
the A/A control; the test. Checked at load with one-line errors; each hypothesis's floor (the smallest p its exact
test can reach at the planned seeds, after Holm) is computed then, and a plan that could never decide is refused
(docs/studies.md, "A study is a spec")."""

import dataclasses
import math
import typing
from pathlib import Path

from normlab.config.keys import checked, suggest
from normlab.errors import StudyError
from normlab.files.formats import load_yaml_mapping
from normlab.paths import REPO_ROOT
from normlab.study import rules
from normlab.study.measures import BUILT_IN, load_hooks
from normlab.study.plan import Overrides, Plan, load_plan

OUTCOMES = ("exit", "accuracy", "loss", "largest_learning_lr")  # built in; a study's measures add names
CONTRASTS = ("pair", "group_means", "main_effect", "interaction", "rank_correlation")
ROLES = ("claim", "manipulation_check", "exploratory")
SIGNS = {-1: "< 0", 0: "not separated", 1: "> 0", None: "-"}
Arms = typing.Union[str, typing.List[str], None]


@dataclasses.dataclass
class Hypothesis:
    id: str
    outcome: str
    contrast: str = dataclasses.field(default="pair", metadata={"choices": CONTRASTS})
    claim: str = ""
    a: Arms = None  # pair: an arm; group_means: a list of arms (their mean per seed)
    b: Arms = None
    factors: typing.Optional[typing.List[str]] = None  # main_effect: one factor; interaction: two or more
    arms: typing.Optional[typing.List[str]] = None  # rank_correlation: the arms whose values are ranked
    against: typing.Optional[str] = None  # rank_correlation: the measure ranked against `outcome`
    sign: typing.Optional[int] = dataclasses.field(default=None, metadata={"choices": (-1, 0, 1, None)})
    size: typing.Optional[float] = None  # the predicted size of the effect (in the outcome's unit)
    sd: typing.Optional[float] = None  # the expected SD of its per-seed values (a pilot's): with size, the power
    family: typing.Optional[str] = None  # Holm's family (default: its own)
    role: str = dataclasses.field(default="claim", metadata={"choices": ROLES})
    experiment: typing.Optional[str] = None  # largest_learning_lr: the LR grid it reads
    warmup: str = "on"
    # pair, group_means: {"a" or "b": "OP NUMBER"}, a bound every run of that side must meet at each LR rank
    # (e.g. a manipulation check's "every random-batch run pads >= 55%"); the prediction fails where one does not
    every_run: typing.Optional[typing.Dict[str, str]] = None
    # pair: "OP NUMBER", a bound the geometric mean over seeds of a / b must meet at each LR rank (a manipulation
    # check's "noise at batch 8 >= 1.5x batch 32", the outcome positive); the prediction fails where it does not
    ratio: typing.Optional[str] = None
    # sign 0: the margin a "not separated" must also be within, its interval inside [-within, +within] at each LR
    # rank (else the tie is not shown: a wide interval separates nothing)
    within: typing.Optional[float] = None

    @property
    def predicted(self) -> str:
        return SIGNS[self.sign]


@dataclasses.dataclass
class AAControl:
    """The same arm on two disjoint seed sets: its board runs and `experiment`'s."""

    arm: str
    experiment: str = "aa"
    copy: typing.Optional[str] = None  # the A/A experiment's variant where it is named apart (default: the arm)
    outcome: str = "accuracy"
    resample: int = 8  # seeds per resample of the false-positive rate


@dataclasses.dataclass
class Pin:
    """Where an arm's runs are when no chosen LR says it: these experiments, at [best, runner-up] LRs."""

    experiments: typing.List[str]
    lrs: typing.List[float]


@dataclasses.dataclass
class StudyFile:
    """Every key a study file may hold (docs/studies.md); normlab.config.keys.checked reads the file into it with
    one-line errors, then plan.load_plan and StudySpec.load check what each key holds."""

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
    signal: typing.Optional[dict] = None  # plan.Signal: the signal measurement
    selection_from: typing.Optional[str] = None
    arms: typing.Optional[dict] = None  # the variants every experiment without its own `variants` trains
    factors: typing.Optional[dict] = None  # a 2^k design: {factor: {level: variant spec}} generates its cells
    test: str = dataclasses.field(default="permutation", metadata={"choices": ("permutation", "calibrated")})
    alpha: float = rules.ALPHA
    hypotheses: typing.Optional[typing.List[dict]] = None
    aa: typing.Optional[dict] = None
    pin: typing.Optional[typing.Dict[str, dict]] = None
    measures: typing.Optional[typing.List[str]] = None
    hooks: typing.Optional[str] = None
    pilot: bool = False  # a pilot may be unable to decide: its floors are printed, not refused


@dataclasses.dataclass
class StudySpec:
    path: Path  # the study file it was read from
    plan: Plan  # what the study trains
    hypotheses: list
    aa: typing.Optional[AAControl]
    pin: dict  # {arm: Pin}
    measures: list
    test: str = "permutation"
    alpha: float = rules.ALPHA
    pilot: bool = False
    hooks: typing.Optional[str] = None

    @property
    def name(self) -> str:
        return self.plan.name

    @classmethod
    def load(cls, path: Path, quiet: bool = False, hooks_file: Path | None = None) -> "StudySpec":
        """The study file, read once and checked: its hook file imported (`hooks_file`: a study folder's copy of
        it), every name it uses known, its plan able to decide (StudyError, one line, otherwise)."""
        try:
            raw = load_yaml_mapping(path)
        except ValueError as e:
            raise StudyError(str(e)) from None
        where = str(path)
        top = checked(StudyFile, raw, where, StudyError)
        spec = cls(path=Path(path), plan=load_plan(top, raw, where), measures=list(top.measures or []),
                   hypotheses=[checked(Hypothesis, h, f"{where}: hypothesis {hypothesis_id(h, i)}", StudyError)
                               for i, h in enumerate(top.hypotheses or [])],
                   aa=checked(AAControl, top.aa, f"{where}: aa", StudyError) if top.aa else None,
                   pin={arm: checked(Pin, p, f"{where}: pin {arm}", StudyError) for arm, p in (top.pin or {}).items()},
                   test=top.test, alpha=float(top.alpha), pilot=top.pilot, hooks=top.hooks)
        spec.load_measures(where, hooks_file)
        spec.check(where)
        try:
            rows = rules.check_plan(spec.planned_tests(), refuse=not spec.pilot)
        except rules.PlanError as err:
            raise StudyError(f"{where}: {err} (or declare `pilot: true`)") from None
        if rows and not quiet:
            print(f"study {spec.name}: floors (smallest p at the planned seeds, after Holm) and power: " + ", ".join(
                f"{r['id']} {r['floor']:.3g}" + (f" (power {r['power']:.0%})" if math.isfinite(r["power"]) else "")
                for r in rows) + ("; a pilot: some can never decide" if spec.pilot else ""))
        return spec

    # ------------------------------------------------------------------------------------------------------
    # what the analysis reads

    def arms(self) -> list[str]:
        """Every variant that trains at chosen LRs (or is pinned), in the file's order, but the A/A's copy."""
        trained = [v for exp in self.plan.experiments.values() if exp.best_of is not None
                   and not (self.aa and exp.name == self.aa.experiment) for v in exp.variants]
        return list(dict.fromkeys(trained + list(self.pin)))

    def ranks(self) -> int:
        """2 where the arms train at their best and runner-up LRs, else 1."""
        return max([e.ranks for e in self.plan.experiments.values()] + [2 if self.pin else 1])

    def chosen_lr_experiments(self, arm: str) -> list[str]:
        """The experiments that train the arm at its chosen LRs (the A/A's excluded)."""
        return [n for n, e in self.plan.experiments.items() if e.best_of and arm in e.variants
                and not (self.aa and n == self.aa.experiment)]

    def seeds_of(self, arm: str) -> set:
        """The seeds the arm's runs are planned at (its chosen-LR or pinned experiments)."""
        exps = self.plan.experiments
        names = self.pin[arm].experiments if arm in self.pin else self.chosen_lr_experiments(arm)
        return {s for n in names if arm in exps[n].variants for s in exps[n].seeds_of(arm)}

    def arms_of(self, h: Hypothesis) -> list[str]:
        if h.contrast in ("main_effect", "interaction"):
            return list(self.plan.cells)
        if h.contrast == "rank_correlation":
            return list(h.arms or [])
        return [x for side in (h.a, h.b) for x in ([side] if isinstance(side, str) else side or [])]

    def planned_tests(self) -> list[rules.PlannedTest]:
        """Each hypothesis as the plan's test: its planned seeds (a rank correlation: its arms, whose smallest
        one-sided p is one ordering of n!), its family, and, where the spec gives them, its size and per-seed SD
        (for the power)."""
        tests = []
        for h in self.hypotheses:
            family = sum((x.family or x.id) == (h.family or h.id) for x in self.hypotheses)
            if h.contrast == "rank_correlation":
                n = len(h.arms or [])
                tests.append(rules.PlannedTest(h.id, n, family, alpha=self.alpha, smallest_p=1 / math.factorial(n)))
                continue
            if h.outcome == "largest_learning_lr":
                seeds = set(self.plan.experiments[h.experiment].seeds)
            else:
                seeds = set.intersection(*(self.seeds_of(a) for a in self.arms_of(h)))
            tests.append(rules.PlannedTest(h.id, len(seeds), family, effect=h.size, sd=h.sd, alpha=self.alpha))
        return tests

    def load_measures(self, where: str, hooks_file: Path | None = None) -> None:
        """Import the hook file (default: the spec's `hooks`, a path from the repository root), so that a name
        under `measures` that nothing registers is refused now, before any run trains, not by the report after."""
        valid = set(BUILT_IN)
        if self.hooks:
            path = Path(hooks_file or REPO_ROOT / self.hooks)
            if not path.is_file():
                raise StudyError(f"{where}: hooks: {path} not found; give the Python file that registers the "
                                 f"study's measures (@measure), as a path from the repository root")
            valid |= load_hooks(path)
            self.hooks = str(path)
        for name in self.measures:
            if name not in valid:
                raise StudyError(f"{where}: measures: {name!r} is not a measure of this study{suggest(name, valid)}; "
                                 f"valid: {', '.join(sorted(valid))} (the built-in ones and those its `hooks:` file "
                                 f"registers with @measure)")

    def check(self, where: str) -> None:
        """Every name a hypothesis uses exists: its arms, factors, outcomes and experiment."""
        arms, outcomes = set(self.arms()) | set(self.plan.cells), set(OUTCOMES) | set(self.measures)
        per_run = outcomes - {"largest_learning_lr"}  # a grid's, not a run's: no A/A or rank correlation reads it
        factors = {f for levels in self.plan.cells.values() for f in levels}
        for h in self.hypotheses:
            at = f"{where}: hypothesis {h.id}"
            for key, valid in (("outcome", outcomes), ("against", per_run)):
                if getattr(h, key) is not None and getattr(h, key) not in valid:
                    raise StudyError(f"{at}: {bad_outcome(key, getattr(h, key), valid)}")
            need = {"pair": ("a", "b"), "group_means": ("a", "b"), "main_effect": ("factors",),
                    "interaction": ("factors",), "rank_correlation": ("arms", "against")}[h.contrast]
            missing = [k for k in need if not getattr(h, k)]
            if missing:
                raise StudyError(f"{at}: contrast {h.contrast} needs {' and '.join(need)}; missing {missing[0]}")
            if h.contrast in ("main_effect", "interaction"):
                bad = [f for f in h.factors if f not in factors]
                count_ok = (len(h.factors) == 1) == (h.contrast == "main_effect")
                if bad or not count_ok:
                    how = "one factor" if h.contrast == "main_effect" else "two factors or more"
                    raise StudyError(f"{at}: {h.contrast} names {how} of {', '.join(sorted(factors)) or 'none'}; "
                                     f"got {h.factors}")
            unknown = [a for a in self.arms_of(h) if a not in arms]
            if unknown and h.outcome != "largest_learning_lr":
                raise StudyError(f"{at}: arm {unknown[0]!r} is not an arm of the study; choose from "
                                 f"{', '.join(sorted(arms))}")
            if h.every_run:
                check_bounds(h, at)
            check_declared(h, at)
            if h.outcome == "largest_learning_lr" and h.experiment not in self.plan.experiments:
                raise StudyError(f"{at}: largest_learning_lr needs `experiment`, one of "
                                 f"{', '.join(self.plan.experiments)}")
        if self.aa:
            if self.aa.outcome not in per_run:
                raise StudyError(f"{where}: aa: {bad_outcome('outcome', self.aa.outcome, per_run)}")
            exp = self.plan.experiments.get(self.aa.experiment)
            if exp is None or (self.aa.copy or self.aa.arm) not in exp.variants:
                raise StudyError(f"{where}: aa: experiment {self.aa.experiment!r} must be one of "
                                 f"{', '.join(self.plan.experiments)} and train {self.aa.copy or self.aa.arm}")


def hypothesis_id(raw, index: int) -> str:
    """How messages name a hypothesis: its id (H1), or its place in the list where it has none."""
    return str(raw.get("id", index + 1)) if isinstance(raw, dict) else str(index + 1)


def bad_outcome(key: str, name: str, outcomes: set) -> str:
    return (f"{key} {name!r} is not one of {', '.join(sorted(outcomes))}{suggest(name, outcomes)} (a study's own "
            f"measure is listed under `measures`)")


def check_bounds(h: Hypothesis, at: str) -> None:
    """`every_run` bounds a side of a pair or of group means: keys a and b, values OP NUMBER."""
    if h.contrast not in ("pair", "group_means"):
        raise StudyError(f"{at}: every_run bounds the runs of side a or b, so it needs contrast pair or group_means; "
                         f"got {h.contrast}")
    for side, bound in h.every_run.items():
        if side not in ("a", "b"):
            raise StudyError(f"{at}: every_run: unknown side {side!r}; valid sides: a, b")
        try:
            rules.parse_bound(bound)
        except ValueError as err:
            raise StudyError(f"{at}: every_run: {side}: {err}") from None


def check_declared(h: Hypothesis, at: str) -> None:
    """`ratio` reads a pair's two arms (a bound, OP NUMBER); `within` is a positive margin of a predicted tie."""
    if h.ratio is not None:
        if h.contrast != "pair":
            raise StudyError(f"{at}: ratio divides arm a's outcome by arm b's per seed, so it needs contrast pair; "
                             f"got {h.contrast}")
        try:
            rules.parse_bound(h.ratio)
        except ValueError as err:
            raise StudyError(f"{at}: ratio: {err}") from None
    if h.within is not None and not (h.sign == 0 and h.within > 0):
        raise StudyError(f"{at}: within is the margin of a predicted tie: it needs sign 0 and a number > 0; got "
                         f"sign {h.sign}, within {h.within}")
