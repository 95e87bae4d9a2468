"""Run a norm study (normlab/study/runner.py runs its stages; docs/studies.md).

    python scripts/study.py --preset smoke --parallel 1     # configs/study/smoke.yaml: the pipeline in minutes
    python scripts/study.py --preset quick_v4 --parallel 2  # configs/study/quick_v4.yaml on a 2-core CPU
    python scripts/study.py --preset quick --dry-run        # print the runs, train nothing
    python scripts/study.py --preset full --study-dir studies/full-h100
"""

import argparse
import contextlib
import shlex
import sys
import time
from pathlib import Path

from normlab.command import error_exit
from normlab.errors import StudyError
from normlab.paths import REPO_ROOT
from normlab.study.executors import make_engine
from normlab.study.plan import parse_only, resolve_preset
from normlab.study.runner import (
    after_training,
    dry_run,
    ready_to_choose,
    run_stages,
    selected_runs,
    study_selection,
    validate_commands,
    waiting,
)
from normlab.study.spec import StudySpec
from normlab.study.study_dir import git_commit, record_invocation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="study.py",
        description="Train the norm variants over a learning-rate grid, warmup on/off and seeds (docs/studies.md).",
        usage="study.py --preset quick|full|FILE.yaml [--only key=value,...] [--study-dir DIR] [--dry-run] "
              "[--engine local|ray [--address A] [--max-retries N]] [key=value ...]")
    parser.add_argument("--preset", required=True, help="quick, full (configs/study/<name>.yaml) or a study YAML file")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE,...",
                        help="narrow by experiment, variant, lr, warmup (on/off), seed: variant=a,b,seed=0")
    parser.add_argument("--study-dir", type=Path, default=None, help="default: studies/<study name>")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands; train nothing")
    parser.add_argument("--parallel", type=int, default=None,
                        help="runs at once (default: one per visible GPU, else 1; CPU runs split the cores); "
                             "also the processes that choose the LRs and score the runs")
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="local: this machine (default); ray: every run a Ray task, here or at --address")
    parser.add_argument("--address", default=None, metavar="auto|ray://HOST:PORT",
                        help="--engine ray: an existing Ray cluster (auto: the one `ray start` runs on this node)")
    parser.add_argument("--max-retries", type=int, default=None,
                        help="--engine ray: retries of a run whose worker or train.py was killed (default 2)")
    parser.add_argument("--process-per-run", action="store_true",
                        help="local engine: a fresh process per run instead of warm workers (slower, same numbers)")
    parser.add_argument("--no-report", action="store_true", help="do not run scripts/report.py at the end")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="train.py overrides for every run")
    return parser


def typed_command(argv=None) -> str:
    """The command as it was typed, for study.json and meta.json: `python scripts/study.py ...`, `python -m
    normlab.cli.study ...` or `normlab-study ...` (sys.orig_argv: the interpreter's own command line); a call with
    `argv` (a test, another program) is written as the script's."""
    if argv is not None:
        return shlex.join(["python", "scripts/study.py", *argv])
    typed = sys.orig_argv[1:]
    if typed and Path(typed[0]).name == "normlab-study":
        return shlex.join(["normlab-study", *typed[1:]])
    return shlex.join(["python", *typed])


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.parallel is not None and args.parallel < 1:
        parser.error(f"--parallel={args.parallel} must be >= 1")
    command = typed_command(argv)
    try:
        bad = [o for o in args.overrides if "=" not in o]
        if bad:
            raise StudyError(f"unexpected argument {bad[0]!r}: extra train.py overrides are key=value")
        spec = StudySpec.load(resolve_preset(args.preset))  # prints each floor; refuses a plan that cannot decide
        plan = spec.plan
        only = parse_only(args.only)
        study_dir = (args.study_dir or REPO_ROOT / "studies" / plan.name).resolve()
        selection = study_selection(plan, study_dir)
        runs = selected_runs(plan, only, selection)
        validate_commands(plan, runs, study_dir, args.overrides)
        if args.dry_run:
            return dry_run(plan, runs, study_dir, args.overrides, narrowed=bool(only))
        line = waiting(plan, selection, study_dir)
        if not runs and line and not ready_to_choose(plan, selection, study_dir):
            # narrowed to experiments still waiting for their sweep: nothing to run, nothing failed; say which
            # sweep to train and leave the study folder as it was
            print(line)
            return 0
        started, commit = time.time(), git_commit()  # the code the runs train with, not HEAD when they end
        engine = make_engine(args.engine, parallel=args.parallel, address=args.address,
                             max_retries=args.max_retries, warm=not args.process_per_run)
        print(engine.describe())
        with contextlib.closing(engine):
            run_stages(spec, study_dir, only, args.overrides, command, engine, shards=args.parallel or 1)
    except StudyError as err:
        return error_exit("study.py", err)
    except KeyboardInterrupt:
        print("\nstudy interrupted; run the same command again to continue (finished runs are skipped, "
              "interrupted ones resume from their last checkpoint)", file=sys.stderr)
        return 130
    record_invocation(study_dir, command, started, commit=commit)
    after_training(spec, study_dir, not args.no_report, shards=args.parallel or 1)
    return 0  # failed runs are in study.json and the report, not in the exit code: the study itself completed


if __name__ == "__main__":
    sys.exit(main())
