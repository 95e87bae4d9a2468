"""`python scripts/bench_shared_cpu.py ARGS` runs `python -m normlab.cli.bench_shared_cpu ARGS`.
normlab/cli/bench_shared_cpu.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.bench_shared_cpu", run_name="__main__", alter_sys=True)
