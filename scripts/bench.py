"""`python scripts/bench.py ARGS` runs `python -m normlab.cli.bench ARGS` (= `normlab-bench ARGS`).
normlab/cli/bench.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.bench", run_name="__main__", alter_sys=True)
