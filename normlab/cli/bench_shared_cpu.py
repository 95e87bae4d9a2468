"""Two trainings sharing one CPU, against one alone: each concurrent run's slowdown (normlab/bench/shared_cpu.py).

    python scripts/bench_shared_cpu.py [--steps N] [--settle-s S] [--keep DIR] [--json FILE] [key=value ...]

key=value: train.py overrides for all three runs (e.g. train.kernels=reference). To see what the passive OpenMP
wait policy does, run it again with OMP_WAIT_POLICY=ACTIVE in the environment. Run it on an otherwise quiet
machine: it waits for the load average to settle before each phase (up to --settle-s, default 180 s) and prints
it.
"""

import shlex
import sys
import tempfile
from pathlib import Path

from normlab.bench.shared_cpu import bench_shared_cpu, print_shared_cpu
from normlab.command import command_parser
from normlab.files.formats import atomic_write_json


def main(argv=None) -> int:
    ap = command_parser(__doc__)
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps of each run (default 400)")
    ap.add_argument("--settle-s", type=float, default=180,
                    help="wait up to this long before each phase for the 1-minute load average to fall under 0.5")
    ap.add_argument("--keep", default=None, help="write the runs here and keep them (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("overrides", nargs="*", help="train.py key=value overrides")
    args = ap.parse_args(argv)
    if args.steps < 30:
        ap.error(f"--steps={args.steps} must be >= 30 (the rate is a median over the logged steps after warm-up)")
    command = "python scripts/bench_shared_cpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="normlab-shared-cpu-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        res = bench_shared_cpu(work, args.steps, args.overrides, settle_s=args.settle_s)
    print_shared_cpu(res, command)
    if args.json:
        atomic_write_json(args.json, {**res, "command": command}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
