"""`python scripts/wandb_charts.py ARGS` runs `python -m normlab.cli.wandb_charts ARGS`.
normlab/cli/wandb_charts.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.wandb_charts", run_name="__main__", alter_sys=True)
