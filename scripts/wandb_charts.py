"""`python scripts/wandb_charts.py ARGS` runs `python -m normlab.cli.wandb_charts ARGS`.
normlab/cli/wandb_charts.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.wandb_charts")
