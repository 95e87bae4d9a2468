"""`python scripts/score_runs.py ARGS` runs `python -m normlab.cli.score_runs ARGS`.
normlab/cli/score_runs.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.score_runs", run_name="__main__", alter_sys=True)
