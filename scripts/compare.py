"""`python scripts/compare.py ARGS` runs `python -m normlab.cli.compare ARGS` (= `normlab-compare ARGS`).
normlab/cli/compare.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.compare", run_name="__main__", alter_sys=True)
