"""`python scripts/score_runs.py ARGS` runs `python -m normlab.cli.score_runs ARGS`.
normlab/cli/score_runs.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.score_runs")
