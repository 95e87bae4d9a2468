"""`python scripts/padding.py ARGS` runs `python -m normlab.cli.padding ARGS`.
normlab/cli/padding.py's docstring gives the usage."""

import runpy

runpy.run_module("normlab.cli.padding", run_name="__main__", alter_sys=True)
