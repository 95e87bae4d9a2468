"""Run a norm study: every variant over a log-spaced learning-rate grid, with and without warmup, over seeds.

    python scripts/study.py --preset quick                      # configs/study/quick.yaml
    python scripts/study.py --preset quick --only variant=post_ln,pre_ln --only seed=0
    python scripts/study.py --preset full --study-dir studies/full-a100 train.max_steps=2000
    python scripts/study.py --preset quick --dry-run            # print the runs, train nothing

The grid is data (configs/study/<preset>.yaml, documented there). Each run is one `train.py` process:
    python train.py --config <variant file> <study overrides> <variant overrides> train.lr=.. train.warmup_steps=..
        seed=.. output_dir=STUDY/runs/<run> wandb.group=<study name> <command-line overrides>
writing STUDY/runs/<run>/ and its log to STUDY/logs/<run>.log. With several GPUs, one run per GPU at a time
(`accelerate launch` with CUDA_VISIBLE_DEVICES=<gpu>); otherwise one run after another. `--engine ray` runs every
run as a Ray task instead, here or on a cluster (scripts/engines.py; docs/studies.md).

STUDY/study.json records the grid, the command and every run's status. A run that diverges or crashes is
recorded there and the study goes on; running the same command again skips runs whose summary.json says
completed or diverged (and resumes interrupted ones from their last checkpoint). At the end the report is
written (scripts/report.py) unless --no-report.
"""

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `python scripts/study.py` puts scripts/, not the repo, on the path

from common.io import atomic_write_json, load_yaml_mapping, read_json  # noqa: E402
from engines import FINISHED, EngineError, Job, LocalEngine, make_engine, read_status, subprocess_runner  # noqa: E402
STUDY_CONFIG_DIR = REPO_ROOT / "configs" / "study"
AXES = ("experiment", "variant", "lr", "warmup", "seed")  # what --only can narrow
# FINISHED (engines.py): a rerun skips these statuses; anything else (failed, interrupted) is run again
GRID_KEYS = {"name", "description", "overrides", "variants", "lr", "warmup", "seeds", "comparisons", "wandb_project",
             "experiments", "init", "score"}
EXPERIMENT_KEYS = {"description", "overrides", "variants", "lr", "warmup", "seeds"}


class StudyError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------------
# The grid


def resolve_preset(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = STUDY_CONFIG_DIR / f"{preset}.yaml"
    if candidate.is_file():
        return candidate
    choices = sorted(p.stem for p in STUDY_CONFIG_DIR.glob("*.yaml"))
    raise StudyError(f"--preset {preset!r} not found; choose one of {', '.join(choices)} or give a YAML file path")


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
        return [float(f"{lo * (hi / lo) ** (i / (num - 1)):.3g}") for i in range(num)]
    raise StudyError(f"lr: {spec!r} must be a list of positive numbers or {{min: .., max: .., num: ..}}")


def _overrides(mapping, where) -> list[str]:
    if mapping is None:
        return []
    if not isinstance(mapping, dict):
        raise StudyError(f"{where} must be a mapping of train.py keys to values, e.g. {{train.max_steps: 200}}")
    return [_format_override(k, v) for k, v in mapping.items()]


def _format_override(key, value):
    # yaml.safe_load on the train.py side reads these back: lists/bools/null as JSON (valid YAML)
    return f"{key}={json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else value}"


def _on_off(value):
    # YAML 1.1 reads a bare on/off as a boolean; the study means the names
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)


def _load_variants(where, variants_spec, warmup) -> dict:
    variants = {}
    for name, spec in variants_spec.items():
        spec = {"config": spec} if isinstance(spec, str) or spec is None else dict(spec)
        bad = set(spec) - {"config", "overrides", "warmup"}
        if bad:
            raise StudyError(f"{where}: variant {name}: unknown key(s) {', '.join(sorted(bad))}; valid: config, overrides, warmup")
        settings = [_on_off(w) for w in spec.get("warmup", list(warmup))]
        if not set(settings) <= set(warmup):
            raise StudyError(f"{where}: variant {name}: warmup {settings} not among the study's settings {list(warmup)}")
        config = spec.get("config")
        if config is not None:
            config_path = Path(config) if str(config).endswith((".yaml", ".yml")) else Path("configs") / f"{config}.yaml"
            if not (REPO_ROOT / config_path).is_file() and not config_path.is_file():
                raise StudyError(f"{where}: variant {name}: config file {config_path} not found")
            config = str(config_path)
        variants[name] = {"config": config, "overrides": _overrides(spec.get("overrides"), f"variant {name} overrides"),
                          "warmup": list(settings)}
    return variants


def _load_experiment(where, spec: dict, defaults: dict) -> dict:
    """One grid: variants x lr x warmup x seeds, with its own overrides (after the study's)."""
    spec = {**defaults, **spec}
    for key in ("variants", "lr", "seeds"):
        if key not in spec:
            raise StudyError(f"{where}: missing '{key}'")
    warmup = spec.get("warmup") or {"on": None}
    if isinstance(warmup, dict):
        warmup = {_on_off(k): v for k, v in warmup.items()}
    if not isinstance(warmup, dict) or not set(warmup) <= {"on", "off"}:
        raise StudyError(f"{where}: warmup must map on/off to train.warmup_steps, e.g. {{on: 30, off: 0}}")
    seeds = spec["seeds"]
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds)):
        raise StudyError(f"{where}: seeds must be a non-empty list of integers")
    return {"description": spec.get("description", ""), "variants": _load_variants(where, spec["variants"], warmup),
            "overrides": _overrides(spec.get("overrides"), f"{where} overrides"),
            "lr": lr_grid(spec["lr"]), "warmup": warmup, "seeds": seeds}


def load_grid(path: Path) -> dict:
    """The study file, checked and normalised: experiments -> {variants, lr, warmup, seeds, overrides}.

    A file without `experiments` is one unnamed experiment (its run names carry no experiment prefix)."""
    try:
        grid = load_yaml_mapping(path)
    except ValueError as e:
        raise StudyError(str(e)) from None
    unknown = set(grid) - GRID_KEYS
    if unknown:
        raise StudyError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(GRID_KEYS))}")
    if "name" not in grid:
        raise StudyError(f"{path}: missing 'name'")
    shared = {k: grid[k] for k in ("variants", "lr", "warmup", "seeds") if k in grid}
    if "experiments" in grid:
        if not isinstance(grid["experiments"], dict) or not grid["experiments"]:
            raise StudyError(f"{path}: experiments must map names to grids (variants, lr, warmup, seeds)")
        experiments = {}
        for name, spec in grid["experiments"].items():
            bad = set(spec or {}) - EXPERIMENT_KEYS
            if bad:
                raise StudyError(f"{path}: experiment {name}: unknown key(s) {', '.join(sorted(bad))}; "
                                 f"valid: {', '.join(sorted(EXPERIMENT_KEYS))}")
            experiments[str(name)] = _load_experiment(f"{path}: experiment {name}", spec or {}, shared)
    else:
        experiments = {"": _load_experiment(str(path), shared, {})}
    return {"name": str(grid["name"]), "description": grid.get("description", ""),
            "overrides": _overrides(grid.get("overrides"), "overrides"), "experiments": experiments,
            "init": grid.get("init"), "score": grid.get("score") or {},
            "comparisons": grid.get("comparisons", []), "wandb_project": grid.get("wandb_project")}


def run_name(variant, lr, warmup, seed, experiment="") -> str:
    return f"{experiment + '-' if experiment else ''}{variant}-lr{lr:g}-wu{warmup}-s{seed}"


def expand(grid: dict) -> list[dict]:
    """Every run: experiment x variant x lr x (the variant's warmup settings) x seed, in that nesting order."""
    runs = []
    for experiment, exp in grid["experiments"].items():
        for variant, spec in exp["variants"].items():
            for lr in exp["lr"]:
                for warmup in spec["warmup"]:
                    for seed in exp["seeds"]:
                        runs.append({"name": run_name(variant, lr, warmup, seed, experiment), "experiment": experiment,
                                     "variant": variant, "lr": lr, "warmup": warmup, "seed": seed})
    return runs


def parse_only(items: list[str]) -> dict:
    """["variant=post_ln,pre_ln,seed=0"] -> {"variant": {"post_ln", "pre_ln"}, "seed": {"0"}}.

    Comma-separated key=value items; an item without "=" is one more value of the previous key; repeated keys
    (within one --only or across several) are alternatives, different keys must all match."""
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


def narrow(runs: list[dict], only: dict) -> list[dict]:
    """The runs matching every --only key; a value that matches no run of the grid is an error (a typo)."""
    for axis, wanted in only.items():
        present = sorted({r[axis] for r in runs}, key=lambda v: (isinstance(v, str), v))
        for w in wanted:
            if not any(_matches(axis, v, w) for v in present):
                raise StudyError(f"--only {axis}={w}: not in the grid; choose from {', '.join(f'{v:g}' if axis == 'lr' else str(v) for v in present)}")
    return [r for r in runs if all(any(_matches(a, r[a], w) for w in ws) for a, ws in only.items())]


def train_command(grid, run, study_dir: Path, extra: list[str], launcher: list[str]) -> list[str]:
    exp = grid["experiments"][run["experiment"]]
    spec = exp["variants"][run["variant"]]
    cmd = list(launcher) + [str(REPO_ROOT / "train.py")]
    if spec["config"]:
        cmd += ["--config", spec["config"]]
    warmup_steps = exp["warmup"][run["warmup"]]
    cmd += (grid["overrides"] + exp["overrides"] + spec["overrides"]
            + [f"train.lr={run['lr']:g}", f"seed={run['seed']}"])
    if warmup_steps is not None:
        cmd.append(f"train.warmup_steps={warmup_steps}")
    cmd += [f"output_dir={study_dir / 'runs' / run['name']}", f"wandb.group={grid['name']}",
            _format_override("wandb.tags", [t for t in (grid["name"], run["experiment"], run["variant"],
                                                         f"warmup-{run['warmup']}") if t]),
            "train.resume=auto"]  # an interrupted run continues from its last checkpoint
    if grid.get("wandb_project"):
        cmd.append(f"wandb.project={grid['wandb_project']}")
    return cmd + list(extra)


def validate_commands(grid, runs, extra):
    """Check every run's config with train.py's own loader before training anything (a typo costs seconds)."""
    from common.config import ConfigError, load_config

    seen = set()
    for run in runs:
        exp = grid["experiments"][run["experiment"]]
        spec = exp["variants"][run["variant"]]
        key = (run["experiment"], run["variant"], run["warmup"])
        if key in seen:
            continue
        seen.add(key)
        overrides = grid["overrides"] + exp["overrides"] + spec["overrides"] + list(extra) + [f"train.lr={run['lr']:g}"]
        config = str(REPO_ROOT / spec["config"]) if spec["config"] else None
        try:
            load_config(config, overrides)
        except ConfigError as err:
            raise StudyError(f"{run['experiment'] + ' ' if run['experiment'] else ''}variant {run['variant']}: {err}") from None


# ----------------------------------------------------------------------------------------------------------------
# Running


def _tail(path: Path, n=3) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-500:]


class Study:
    """study.json, kept current after every run (safe to read while the study runs)."""

    def __init__(self, study_dir: Path, grid: dict, grid_file: Path, command: str):
        self.dir = study_dir
        self.path = study_dir / "study.json"
        self.lock = threading.Lock()
        old = read_json(self.path, {})
        if old.get("name") not in (None, grid["name"]):
            raise StudyError(f"{study_dir} holds study {old['name']!r}, not {grid['name']!r}; pick another --study-dir")
        self.data = {"name": grid["name"], "description": grid["description"], "grid_file": str(grid_file),
                     "experiments": grid["experiments"], "init": grid["init"], "score": grid["score"],
                     "common_overrides": grid["overrides"], "comparisons": grid["comparisons"],
                     "wandb_project": grid["wandb_project"], "command": command,
                     # every invocation that trained into this directory (a study may be built in pieces)
                     "commands": [c for c in old.get("commands", []) if c != command] + [command],
                     "runs": old.get("runs", {})}

    def record(self, name, fresh=False, **fields):
        """Update a run's entry (fresh: start it over, dropping what an earlier attempt recorded)."""
        with self.lock:
            if fresh:
                self.data["runs"][name] = {}
            self.data["runs"].setdefault(name, {}).update(fields)
            atomic_write_json(self.path, self.data, indent=1)


def study_job(grid, run, study_dir: Path, extra, launcher, engine) -> Job:
    """A run as the engine takes it: its train.py command, run directory, log and resources."""
    cmd = train_command(grid, run, study_dir, extra, launcher)
    env, threads = {}, engine.threads_per_run
    if threads:
        # several CPU runs share the cores: tell each its share, as train.cpu_threads (under accelerate launch
        # train.py cannot tell a 1 in OMP_NUM_THREADS from accelerate's default) and as OMP_NUM_THREADS
        env["OMP_NUM_THREADS"] = str(threads)
        given = [c.split("=", 1)[1] for c in cmd if c.startswith("train.cpu_threads=")]
        if not given:
            cmd.append(f"train.cpu_threads={threads}")
        elif given[-1].isdigit():  # the run's own thread count is what a Ray task reserves
            threads = int(given[-1])
    return Job(run["name"], cmd, study_dir / "runs" / run["name"], study_dir / "logs" / f"{run['name']}.log",
               gpus=engine.gpus_per_run, cpus=threads or 1, env=env)


def run_study(grid, grid_file, study_dir: Path, runs, extra=(), command="", runner=subprocess_runner,
              parallel=1, gpus=0, print_fn=print, engine=None) -> dict:
    """Train every run not finished yet; returns {run name: status}. Never raises for a run's failure.
    `engine` (engines.py) runs them; default: LocalEngine(parallel, gpus, runner)."""
    engine = engine or LocalEngine(parallel=parallel, gpus=gpus, runner=runner)
    study_dir.mkdir(parents=True, exist_ok=True)
    (study_dir / "logs").mkdir(exist_ok=True)
    study = Study(study_dir, grid, grid_file, command)
    launcher = [sys.executable]
    if engine.gpus_per_run:  # one process per GPU, given its GPU by the engine
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
    statuses, todo = {}, []
    for run in runs:
        status = read_status(study_dir / "runs" / run["name"])
        base = {k: run[k] for k in ("experiment", "variant", "lr", "warmup", "seed")}
        if status in FINISHED:
            statuses[run["name"]] = status
            study.record(run["name"], **base, status=status)
        else:
            todo.append(study_job(grid, run, study_dir, extra, launcher, engine))
            study.record(run["name"], fresh=True, **base, status="pending", command=shlex.join(todo[-1].cmd))
    print_fn(f"study {grid['name']}: {len(runs)} runs selected, {len(runs) - len(todo)} already finished, "
             f"{len(todo)} to train -> {study_dir}")
    counter = iter(range(1, len(todo) + 1))

    def started(job):
        study.record(job.name, status="running", log=str(job.log.relative_to(study_dir)))

    def finished(job, outcome):
        status = read_status(job.run_dir)
        if status is None or (outcome.returncode != 0 and status not in FINISHED):
            status = "failed"
        fields = dict(status=status, returncode=outcome.returncode, duration_s=outcome.duration_s,
                      attempts=outcome.attempts, host=outcome.host)
        if status == "failed":
            fields["error"] = outcome.error or _tail(job.log)
        study.record(job.name, **fields)
        statuses[job.name] = status
        took = f" in {outcome.duration_s:.0f}s" if outcome.duration_s is not None else ""
        print_fn(f"[{next(counter)}/{len(todo)}] {job.name}: {status}{took}"
                 + (f" (exit {outcome.returncode}; see {job.log})" if status == "failed" else ""))

    engine.run_all(todo, started, finished)
    counts = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    print_fn(f"study {grid['name']} done: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return statuses


def machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {os.cpu_count()} CPU cores"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU cores, no GPU"


def record_invocation(study_dir: Path, command: str, started: float) -> None:
    """Append this command's commit, machine, wall time and CPU time (of the runs it started) to study.json."""
    path = study_dir / "study.json"
    data = read_json(path)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or None
    times = os.times()
    data.setdefault("invocations", []).append({
        "command": command, "commit": commit, "machine": machine(), "started": time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(started)), "wall_s": round(time.time() - started, 1),
        "cpu_s": round(times.children_user + times.children_system, 1)})
    atomic_write_json(path, data, indent=1)


def wants_e1(grid: dict, only: dict) -> bool:
    """E1 (scripts/init_study.py) runs when the study has an `init` block and --only experiment=... names e1 or
    no experiment; `e1` is then taken out of the experiment filter (it has no training runs)."""
    if not grid.get("init"):
        return False
    wanted = only.get("experiment")
    if wanted is None:
        return "seed" not in only and "variant" not in only and "lr" not in only and "warmup" not in only
    if "e1" not in wanted:
        return False
    wanted.discard("e1")
    return True


def after_training(study_dir: Path, run_e1: bool, score: bool, report: bool) -> None:
    """E1, then the per-run records (scores of every final model), then the report: each a script of its own. A
    study file without a `score` block gets neither records nor report (the report reads only the records)."""
    scripts = REPO_ROOT / "scripts"
    if run_e1:
        subprocess.run([sys.executable, str(scripts / "init_study.py"), str(study_dir)], cwd=REPO_ROOT, check=True)
    if not score:
        return
    subprocess.run([sys.executable, str(scripts / "score_runs.py"), str(study_dir)], cwd=REPO_ROOT, check=True)
    if report:
        subprocess.run([sys.executable, str(scripts / "report.py"), str(study_dir)], cwd=REPO_ROOT)


def dry_run(grid, runs, study_dir: Path, overrides) -> int:
    """Print each run's command and whether a rerun would train or skip it; write nothing."""
    for run in runs:
        status = read_status(study_dir / "runs" / run["name"])
        action = f"skip ({status})" if status in FINISHED else "train"
        print(f"{action:18s} {shlex.join(train_command(grid, run, study_dir, overrides, [sys.executable]))}")
    print(f"{len(runs)} runs ({sum(read_status(study_dir / 'runs' / r['name']) not in FINISHED for r in runs)} to train)"
          f" in {study_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train the norm variants over a learning-rate grid, warmup on/off and seeds (see the module docstring).",
        usage="study.py --preset quick|full|FILE.yaml [--only key=value,...] [--study-dir DIR] [--dry-run] "
              "[--engine local|ray [--address A] [--max-retries N]] [key=value ...]")
    parser.add_argument("--preset", required=True, help="quick, full (configs/study/<name>.yaml) or a study YAML file")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE,...",
                        help="narrow the grid: keys experiment (e1 too), variant, lr, warmup (on/off), seed; e.g. "
                             "--only variant=post_ln,pre_ln --only seed=0 (repeat a key for alternatives)")
    parser.add_argument("--study-dir", type=Path, default=None, help="default: studies/<study name>")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands; train nothing")
    parser.add_argument("--parallel", type=int, default=None,
                        help="runs at once (default: one per visible GPU, 1 on CPU; on CPU the cores are split "
                             "between them: train.cpu_threads and OMP_NUM_THREADS)")
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="local: this machine's GPUs or cores (default); ray: every run a Ray task, on a new "
                             "local Ray instance or the cluster at --address (docs/studies.md)")
    parser.add_argument("--address", default=None, metavar="auto|ray://HOST:PORT",
                        help="--engine ray: an existing Ray cluster (auto: the one `ray start` runs on this node)")
    parser.add_argument("--max-retries", type=int, default=None,
                        help="--engine ray: attempts after the first for a run whose worker died or whose train.py "
                             "was killed, each resuming from its last checkpoint (default 2)")
    parser.add_argument("--no-report", action="store_true", help="do not run scripts/report.py at the end")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="train.py overrides for every run")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bad = [o for o in args.overrides if "=" not in o]
        if bad:
            raise StudyError(f"unexpected argument {bad[0]!r}: extra train.py overrides are key=value")
        grid_file = resolve_preset(args.preset)
        grid = load_grid(grid_file)
        only = parse_only(args.only)
        run_e1 = wants_e1(grid, only)
        runs = narrow(expand(grid), only) if only.get("experiment", {None}) != set() else []
        study_dir = (args.study_dir or REPO_ROOT / "studies" / grid["name"]).resolve()
        validate_commands(grid, runs, args.overrides)
    except StudyError as err:
        print(f"study.py: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(grid, runs, study_dir, args.overrides)
    command = shlex.join(["python", "scripts/study.py", *(argv if argv is not None else sys.argv[1:])])
    started = time.time()
    try:
        engine = make_engine(args.engine, parallel=args.parallel, address=args.address, max_retries=args.max_retries)
    except EngineError as err:
        print(f"study.py: error: {err}", file=sys.stderr)
        return 2
    print(engine.describe())
    try:
        with engine:
            run_study(grid, grid_file, study_dir, runs, args.overrides, command=command, engine=engine)
    except StudyError as err:
        print(f"study.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstudy interrupted; run the same command again to continue (finished runs are skipped, "
              "interrupted ones resume from their last checkpoint)", file=sys.stderr)
        return 130
    record_invocation(study_dir, command, started)
    after_training(study_dir, run_e1, bool(grid["score"]), not args.no_report)
    return 0  # failed runs are in study.json and the report, not in the exit code: the study itself completed


if __name__ == "__main__":
    sys.exit(main())
