"""`python scripts/report.py ARGS` runs `python -m normlab.cli.report ARGS` (= `normlab-report ARGS`).
normlab/cli/report.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.report", run_name="__main__", alter_sys=True)
