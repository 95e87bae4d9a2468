"""`python scripts/bench_shared_cpu.py ARGS` runs `python -m normlab.cli.bench_shared_cpu ARGS`.
normlab/cli/bench_shared_cpu.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.bench_shared_cpu")
