"""`python scripts/evaluate.py ARGS` runs `python -m normlab.cli.evaluate ARGS` (= `normlab-evaluate ARGS`).
normlab/cli/evaluate.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.evaluate", run_name="__main__", alter_sys=True)
