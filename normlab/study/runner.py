"""Run a norm study (scripts/study.py is the entry point; docs/studies.md explains the stages, engines and files):
train the plan's runs stage by stage (LR sweeps first, then what their choices unlock), then the records and the
report. Every stage takes the spec (spec.py; its plan says what to train) and the study folder. STUDY/study.json
records the commands and every run's status; STUDY/spec.yaml is the plan, held once.
"""

import json
import shlex
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from normlab.command import error_exit
from normlab.errors import RecordsError, StudyError
from normlab.files.formats import atomic_write_json, read_json
from normlab.paths import REPO_ROOT
from normlab.run_dir import FINISHED, RunDir, saved_config_raw
from normlab.study.executors import Job, LocalEngine, subprocess_runner
from normlab.study.plan import Plan, RunSpec, narrow
from normlab.study.selection_file import read_selection
from normlab.study.sharded import run_sharded
from normlab.study.spec import StudySpec
from normlab.study.study_dir import SCORED, SIGNAL, StudyDir, git_commit, machine

# a run is the training module itself, as a module: the root train.py is only the user's entry point
TRAIN = ["-m", "normlab.train.run"]


def run_settings(plan: Plan, run: RunSpec, study_dir: Path) -> tuple[str | None, dict]:
    """(the run's configs/ file or None, {run config key: value} on top of it): the study's, the experiment's and
    the variant's overrides, then the run's own LR, seed and warmup, its directory, W&B group and tags; an
    interrupted run resumes from its checkpoint."""
    config, overrides, warmup_steps = plan.experiments[run.experiment].settings(run.variant, run.warmup)
    settings = {**plan.overrides, **overrides, "train.lr": run.lr, "seed": run.seed}
    if warmup_steps is not None:
        settings["train.warmup_steps"] = warmup_steps
    tags = [t for t in (plan.name, run.experiment, run.variant, f"warmup-{run.warmup}") if t]
    tags += [Path(config).stem] if config else []  # the variant file's tag, as train.py gives a run of it
    settings.update({"output_dir": str(StudyDir(study_dir).run(run.name)), "wandb.group": plan.name,
                     "wandb.tags": tags, "train.resume": "auto"})
    if plan.wandb_project:
        settings["wandb.project"] = plan.wandb_project
    return config, settings


def run_config(plan: Plan, run: RunSpec, study_dir: Path, extra=(), cpu_threads: int | None = None):
    """The run's config (a RunConfig) by train.py's own loader: its configs/ file, its settings (run_settings),
    then `extra`, the study command's key=value overrides, which win; with `cpu_threads`, that train.cpu_threads
    unless the run sets its own."""
    from normlab.config.loader import load_config, replace_keys

    config, settings = run_settings(plan, run, study_dir)
    cfg = load_config(str(REPO_ROOT / config) if config else None, list(extra),
                      layers=[(settings, f"in study {plan.name}'s settings of run {run.name}")])
    if cpu_threads and cfg.train.cpu_threads is None:
        cfg = replace_keys(cfg, {"train.cpu_threads": cpu_threads})
    return cfg


def write_run_config(cfg) -> RunDir:
    """The run's config.yaml, which train.py is launched with (--config); a run directory an earlier attempt left
    with other settings than a resume may change is refused (StudyError), never overwritten."""
    from normlab.train.preflight import RESUMABLE, config_diff

    run_dir = RunDir.of(cfg)
    if run_dir.config_file.is_file():
        differ = [k for k in config_diff(saved_config_raw(run_dir.config_file)[0], cfg) if k not in RESUMABLE]
        if differ:
            raise StudyError(f"{run_dir.path} holds a run with other settings (differs in: {', '.join(differ[:6])}); "
                             f"restore the study's settings, or delete the directory to train the run again")
    run_dir.save_config(cfg)
    return run_dir


def validate_commands(plan: Plan, runs, study_dir: Path, extra):
    """Check every run's config with train.py's own loader before training anything (a typo costs seconds)."""
    from normlab.config.loader import ConfigError

    first = {}
    for run in runs:
        first.setdefault((run.experiment, run.variant, run.warmup), run)
    for (experiment, variant, warmup), run in first.items():
        try:
            run_config(plan, run, study_dir, extra)
        except ConfigError as err:
            raise StudyError(f"{experiment + ' ' if experiment else ''}variant {variant}: {err}") from None


def _tail(path: Path, n=3) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-500:]


class StudyLedger:
    """study.json, kept current after every run (safe to read while the study runs): the commands and every run's
    status; the plan is the spec snapshot beside it (spec.yaml), not a copy in here."""

    def __init__(self, study_dir: Path, spec: StudySpec, command: str):
        self.path = StudyDir(study_dir).study_json
        self.lock = threading.Lock()
        StudyDir(study_dir).save_spec(spec)  # the spec every later stage and report of this study reads
        old = read_json(self.path, {})
        if old.get("name") not in (None, spec.name):
            raise StudyError(f"{study_dir} holds study {old['name']!r}, not {spec.name!r}; pick another --study-dir")
        self.data = {"name": spec.name, "description": spec.plan.description, "grid_file": str(spec.path),
                     "command": command,
                     # every invocation that trained into this directory (a study may be built in pieces)
                     "commands": [c for c in old.get("commands", []) if c != command] + [command],
                     "runs": old.get("runs", {}),
                     # the earlier invocations' times (record_invocation): a study built in pieces keeps them all
                     **({"invocations": old["invocations"]} if "invocations" in old else {})}

    def record(self, name, fresh=False, **fields):
        """Update a run's entry (fresh: start it over, dropping what an earlier attempt recorded)."""
        with self.lock:
            if fresh:
                self.data["runs"][name] = {}
            self.data["runs"].setdefault(name, {}).update(fields)
            atomic_write_json(self.path, self.data, indent=1)


def study_job(plan: Plan, run: RunSpec, study_dir: Path, extra, launcher, engine) -> Job:
    """A run as the engine takes it: its config written into its run directory, the train.py command launched
    with it, its log and resources."""
    env, threads = {}, engine.threads_per_run
    # several CPU runs share the cores: tell each its share, as train.cpu_threads (under accelerate launch
    # train.py cannot tell a 1 in OMP_NUM_THREADS from accelerate's default) and as OMP_NUM_THREADS
    cfg = run_config(plan, run, study_dir, extra, cpu_threads=threads)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        threads = cfg.train.cpu_threads  # the run's own thread count is what a Ray task reserves
    run_dir = write_run_config(cfg)
    cmd = [*launcher, *TRAIN, "--config", str(run_dir.config_file)]
    return Job(run.name, cmd, run_dir.path, StudyDir(study_dir).log(run.name), run_dir.config_file,
               gpus=engine.gpus_per_run, cpus=threads or 1, env=env)


def run_study(spec: StudySpec, study_dir: Path, runs, extra=(), command="", runner=subprocess_runner,
              parallel=1, gpus=0, print_fn=print, engine=None) -> dict:
    """Train every run not finished yet; returns {run name: status}. Never raises for a run's failure.
    `engine` (executors.py) runs them; default: LocalEngine(parallel, gpus, runner)."""
    engine = engine or LocalEngine(parallel=parallel, gpus=gpus, runner=runner)
    (study_dir / "logs").mkdir(parents=True, exist_ok=True)
    study = StudyLedger(study_dir, spec, command)
    launcher = [sys.executable]
    if engine.gpus_per_run:  # one process per GPU, given its GPU by the engine
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
    statuses, todo = {}, []
    for run in runs:
        status = RunDir(StudyDir(study_dir).run(run.name)).status()
        base = run.placement()
        if status in FINISHED:
            statuses[run.name] = status
            study.record(run.name, **base, status=status)
        else:
            todo.append(study_job(spec.plan, run, study_dir, extra, launcher, engine))
            study.record(run.name, fresh=True, **base, status="pending", command=shlex.join(todo[-1].cmd))
    print_fn(f"study {spec.name}: {len(runs)} runs selected, {len(runs) - len(todo)} already finished, "
             f"{len(todo)} to train -> {study_dir}")
    counter = iter(range(1, len(todo) + 1))
    where = {"commit": git_commit(), "machine": machine()}

    def started(job):
        study.record(job.name, status="running", log=str(job.log.relative_to(study_dir)), **where,
                     started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def finished(job, outcome):
        status = RunDir(job.run_dir).status()
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
    counts = sorted(Counter(statuses.values()).items())
    print_fn(f"study {spec.name} done: " + ", ".join(f"{k} {v}" for k, v in counts))
    return statuses


def after_training(spec: StudySpec, study_dir: Path, report: bool, shards: int = 1) -> None:
    """The per-run records (scores of every final model) in `shards` processes, then the report. A study file
    without a `score` block gets neither records nor report (the report reads only the records)."""
    if not spec.plan.score:
        return
    from normlab.study import report as study_report
    from normlab.study import scoring

    count = run_sharded(scoring.score, study_dir, SCORED, shards, key=lambda row: row["name"])
    print(f"{count} records -> {study_dir / SCORED}")
    if not report:
        return
    try:
        print(f"wrote {study_report.make_report(study_dir)} and its figures")
    except (FileNotFoundError, RecordsError, StudyError) as err:  # one line, as report.py says it; records stay
        error_exit("report.py", err)


def study_selection(plan: Plan, study_dir: Path) -> dict:
    """STUDY/selection.json; for a study whose LRs another study chose (`selection_from`, e.g. long_v4 takes
    quick_v4's), that study's file until this one has its own copy."""
    selection = StudyDir(study_dir).selection()
    if selection or not plan.selection_from:
        return selection
    source = Path(plan.selection_from)
    path = source if source.is_absolute() else REPO_ROOT / source
    if not path.is_file():
        raise StudyError(f"selection_from: {path} not found; run the study that chooses these LRs first "
                         f"(or copy its selection.json to {study_dir})")
    selection = read_selection(path)
    if missing := plan.pending(selection):
        raise StudyError(f"selection_from: {path} has no choice for {', '.join(sorted(missing))}; this study "
                         f"cannot choose them (its sweeps are named, not trained)")
    return selection


def selected_runs(plan: Plan, only: dict, selection: dict) -> list[RunSpec]:
    """The runs --only asks for among those whose LR is known. A value that names nothing is an error (a typo);
    before every LR is chosen an `lr` value may still name a run the choice will create, but no other value can."""
    pending = plan.pending(selection)
    if pending:  # the other axes against every run the plan can have
        narrow(plan.runs(plan.stand_in(selection)), {axis: values for axis, values in only.items() if axis != "lr"})
    return narrow(plan.runs(selection), only, strict=not pending)


def waiting(plan: Plan, selection: dict, study_dir: Path) -> str | None:
    """The line that says which experiments cannot expand yet, for want of their sweep's LR choice (None: none)."""
    pending = plan.pending(selection)
    if not pending:
        return None
    sweeps = sorted({experiment for experiment, _, _ in pending.values()})
    waits = [e.name for e in plan.experiments.values() if e.best_of in sweeps]
    return (f"study {plan.name}: {', '.join(waits)} wait{'s' * (len(waits) == 1)} for the LRs that "
            f"{', '.join(sweeps)} choose{'s' * (len(sweeps) == 1)}, not chosen yet: train "
            f"{'it' if len(sweeps) == 1 else 'them'} (--only experiment={','.join(sweeps)}), or copy a "
            f"selection.json that has the choices into {study_dir}")


def ready_to_choose(plan: Plan, selection: dict, study_dir: Path) -> dict:
    """{selection key: {lr: [run names]}} of each arm whose sweep has finished but whose LR is not chosen yet."""
    ready, runs = {}, plan.runs(selection)
    for key, (experiment, variant, warmup) in plan.pending(selection).items():
        sweep = [r for r in runs if experiment in r.experiments
                 and r.variant == variant and r.warmup == warmup]
        if all(RunDir(StudyDir(study_dir).run(r.name)).status() in FINISHED for r in sweep):
            ready[key] = {}
            for r in sweep:
                ready[key].setdefault(r.lr, []).append(r.name)
    return ready


def run_stages(spec: StudySpec, study_dir: Path, only: dict, extra, command: str, engine, shards: int = 1) -> None:
    """Train what can be trained; when an LR sweep has finished, choose its LRs on dev and train what they
    unlock; repeat until nothing more can run (a narrowed study may leave choices for a later invocation); then
    the spec's measurements (signal) once the LRs they read are chosen. The choices score the sweeps on dev, and
    the measurements run, in `shards` processes."""
    from normlab.study.selection import select

    plan = spec.plan
    selection = study_selection(plan, study_dir)
    if selection and not StudyDir(study_dir).selection_file.is_file():  # from selection_from: keep a copy, as read
        study_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(StudyDir(study_dir).selection_file, selection, indent=1)
    while True:
        runs = selected_runs(plan, only, selection)
        sweeps = {experiment for experiment, _, _ in plan.pending(selection).values()}
        first = [r for r in runs if sweeps & set(r.experiments)]  # the sweeps that choose LRs go first
        if runs:
            run_study(spec, study_dir, first or runs, extra, command=command, engine=engine)
        if ready := ready_to_choose(plan, selection, study_dir):
            print(f"choosing the LR of {len(ready)} arm(s) on the dev split")
            selection = select(spec, study_dir, ready, processes=shards)
            continue
        if first:  # a narrowed sweep left choices open: train the rest that can run
            run_study(spec, study_dir, [r for r in runs if r not in first], extra, command=command, engine=engine)
        if (line := waiting(plan, selection, study_dir)) is not None:  # a narrowed study may leave them for later
            print(line)
        measure_signal(spec, study_dir, selection, shards)
        return


def measure_signal(spec: StudySpec, study_dir: Path, selection: dict, shards: int = 1) -> None:
    """The spec's `signal` measurement (signal.py) into STUDY/signal.jsonl, once: when every LR it reads is
    chosen, and not again where the file is there."""
    from normlab.study import signal

    sig = spec.plan.signal
    if sig is None or (study_dir / SIGNAL).is_file() or not StudyDir(study_dir).is_study:
        return
    if any(spec.plan.signal_lr(arm, selection) is None for arm in sig.variants):
        print(f"study {spec.name}: the signal measurement waits for its arms' chosen LRs")
        return
    order = {(arm, seed): i for i, (arm, seed) in enumerate(signal.cases(sig))}
    print(f"measuring the signal of {len(order)} (arm, seed) pairs")
    run_sharded(signal.measure_study, study_dir, SIGNAL, shards, key=lambda row: order[row["variant"], row["seed"]])


def dry_run(plan: Plan, runs, study_dir: Path, overrides, narrowed: bool = False) -> int:
    """Print each run's command, what its config sets beyond configs/default.yaml, and whether a rerun would
    train or skip it, then what the LR choices will add (a whole study makes them itself; a `narrowed` one may have
    to be told to train the sweep); write nothing."""
    from normlab.config.loader import flatten_config, load_config

    default = flatten_config(load_config())
    statuses = [RunDir(StudyDir(study_dir).run(run.name)).status() for run in runs]
    for run, status in zip(runs, statuses):
        action = f"skip ({status})" if status in FINISHED else "train"
        cfg = flatten_config(run_config(plan, run, study_dir, overrides))
        command = shlex.join([sys.executable, *TRAIN, "--config", str(RunDir(cfg["output_dir"]).config_file)])
        settings = " ".join(f"{k}={json.dumps(v) if isinstance(v, (list, bool)) or v is None else v}"
                            for k, v in cfg.items() if v != default.get(k))
        print(f"{action:18s} {command}    # {settings}")
    print(f"{len(runs)} runs ({sum(s not in FINISHED for s in statuses)} to train) in {study_dir}")
    selection = study_selection(plan, study_dir)
    if not narrowed and (later := plan.unexpanded(selection)):
        sweeps = sorted({plan.experiments[e].best_of for e in later})
        counts = [f"{n} runs of {e}" for e, n in later.items()]
        print(f"then, once {' and '.join(sweeps)} {'has' if len(sweeps) == 1 else 'have'} ended: each arm's LR chosen "
              f"on the dev split, and up to {', '.join(counts)} at those LRs (a dry run lists them after the choice)")
    elif (line := waiting(plan, selection, study_dir)) is not None:
        print(line)
    if plan.signal is not None:
        pairs = len(plan.signal.variants) * len(plan.signal.seeds)
        print(f"then the signal measurement ({pairs} arm-seed pairs, no training) into {study_dir / SIGNAL}")
    return 0
