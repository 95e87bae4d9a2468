"""`python scripts/study.py ARGS` runs `python -m normlab.cli.study ARGS` (= `normlab-study ARGS`).
normlab/cli/study.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.study")
