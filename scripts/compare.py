"""`python scripts/compare.py ARGS` runs `python -m normlab.cli.compare ARGS` (= `normlab-compare ARGS`).
normlab/cli/compare.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.compare")
