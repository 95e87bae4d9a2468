"""`python scripts/init_study.py ARGS` runs `python -m normlab.cli.init_study ARGS`.
normlab/cli/init_study.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.init_study", run_name="__main__", alter_sys=True)
