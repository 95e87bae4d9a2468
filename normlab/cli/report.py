"""The norm study's report: report.md and its figures, from the per-run records alone (no retraining).

    python scripts/report.py studies/smoke --out docs/study-smoke   # a scored study; copies its records to --out
    python scripts/report.py docs/study-smoke                        # regenerate from the records and spec.yaml
    python scripts/report.py STUDY/quick_v4 --rerun-of docs/study-v4/quick   # a retrain: did it reproduce them?
    python scripts/report.py docs/study-smoke --freeze               # finished: name this commit in meta.json

--out FOLDER where FOLDER already holds this study's committed records (its remaining seeds trained in a fresh
study folder): the committed records are kept and the study's finished runs join them (normlab/study/records.py).

normlab/study/report.py writes it with the one analysis (normlab/study/engine.py) of the study's spec as it ran
(spec.yaml in the folder). A finished study frozen at a commit (meta.json `report_commit`: studies v2-v6, docs) is
refused: its report regenerates at that commit. It writes nothing else into the report's folder. With --wandb,
a W&B run in the study's group (job_type report; offline unless --wandb-mode or $WANDB_MODE says otherwise; never
prompts) gets the figures, the scorecard and every run as a table row; its files go to --wandb-dir (default: the
study directory when SOURCE is one, else the current one).

--freeze, for a finished study's committed records: regenerates its report at this commit, and where report.md and
the figures come out byte-identical, writes the commit into meta.json (`report_commit`, normlab/study/freeze.py);
from then on report.py refuses the folder at every commit, naming that one.

--rerun-of writes no report: it compares a retrained study run by run with the committed records it retrains
(normlab/study/rerun.py), keeps each run's digest and provenance in that folder's rerun/ and exits 1 if any differ.
"""

import argparse
import os
import sys
from pathlib import Path

from normlab.command import command_parser, error_exit
from normlab.errors import RecordsError, StudyError
from normlab.study.freeze import freeze
from normlab.study.report import make_report
from normlab.study.rerun import RERUN, write_rerun
from normlab.study.study_dir import StudyDir


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("source", type=Path, help="a scored study directory, or a folder of committed records")
    parser.add_argument("--out", type=Path, default=None, help="write the report (and copy the records) here")
    parser.add_argument("--wandb", action="store_true", help="also log the report as a W&B run")
    parser.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default=None,
                        help="with --wandb: the run's mode (default: $WANDB_MODE, else offline)")
    parser.add_argument("--wandb-dir", type=Path, default=None,
                        help="with --wandb: where its files go (DIR/wandb/; default: SOURCE if a study directory, "
                             "else the current directory)")
    parser.add_argument("--rerun-of", type=Path, default=None,
                        help="SOURCE retrains the study whose records are in this folder: write each run's digest to "
                             f"its {RERUN}/ and say which runs differ (no report)")
    parser.add_argument("--freeze", action="store_true",
                        help="the study is finished: check that this commit regenerates SOURCE's committed report "
                             "byte for byte, then name the commit in its meta.json (no report written)")
    parser.add_argument("--no-wandb", action="store_true", help=argparse.SUPPRESS)  # the default now
    args = parser.parse_args(argv)
    if not args.wandb and (args.wandb_mode or args.wandb_dir):
        parser.error("--wandb-mode and --wandb-dir go with --wandb")
    if args.rerun_of is not None:
        if args.out or args.wandb:
            parser.error("--rerun-of writes no report: it goes without --out and --wandb")
        return rerun_main(args.source, args.rerun_of)
    if args.freeze:
        if args.out or args.wandb or args.rerun_of:
            parser.error("--freeze writes no report: it goes without --out, --wandb and --rerun-of")
        return freeze_main(args.source)
    mode = (args.wandb_mode or os.environ.get("WANDB_MODE") or "offline") if args.wandb else "disabled"
    wandb_dir = args.wandb_dir or (args.source if StudyDir(args.source).is_study else Path.cwd())
    try:
        report = make_report(args.source, args.out, mode, wandb_dir)
    except (FileNotFoundError, RecordsError, StudyError) as err:
        return error_exit("report.py", err)
    print(f"wrote {report} and its figures")
    return 0


def freeze_main(folder: Path) -> int:
    try:
        commit = freeze(folder)
    except (FileNotFoundError, RecordsError, StudyError) as err:
        return error_exit("report.py", err)
    print(f"{folder}: frozen at {commit} (meta.json report_commit); its report regenerates there byte for byte")
    return 0


def rerun_main(study_dir: Path, folder: Path) -> int:
    """Exit 0 when every retrained run reproduced its committed record exactly, else 1 (naming the runs)."""
    try:
        differ, runs, other_steps, other_threads = write_rerun(study_dir, folder)
    except FileNotFoundError as err:
        return error_exit("report.py", err)
    print(f"{runs - len(differ)} of {runs} retrained runs reproduced their committed record exactly "
          f"(digests: {folder / RERUN})")
    if other_steps:
        print(f"{other_steps} of them evaluated at other steps than their committed record and were compared at the "
              f"steps they evaluated")
    if other_threads:
        print(f"{other_threads} of the runs that differ trained with another CPU thread count than their committed "
              f"record, or one of the two does not say: a CPU run's last digits depend on it (retrain with the "
              f"study's --parallel, or set train.cpu_threads)")
    if differ:
        print(f"differ or not committed: {', '.join(differ[:10])}" + (f" and {len(differ) - 10} more"
                                                                         if len(differ) > 10 else ""))
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
