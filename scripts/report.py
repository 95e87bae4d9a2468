"""`python scripts/report.py ARGS` runs `python -m normlab.cli.report ARGS` (= `normlab-report ARGS`).
normlab/cli/report.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.report")
