"""`python scripts/study.py ARGS` runs `python -m normlab.cli.study ARGS` (= `normlab-study ARGS`).
normlab/cli/study.py's docstring and --help give the usage."""

import runpy

runpy.run_module("normlab.cli.study", run_name="__main__", alter_sys=True)
