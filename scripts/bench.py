"""`python scripts/bench.py ARGS` runs `python -m normlab.cli.bench ARGS` (= `normlab-bench ARGS`).
normlab/cli/bench.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.bench")
