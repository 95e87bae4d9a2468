"""`python scripts/evaluate.py ARGS` runs `python -m normlab.cli.evaluate ARGS` (= `normlab-evaluate ARGS`).
normlab/cli/evaluate.py's docstring and --help give the usage."""

from _checkout import run

run("normlab.cli.evaluate")
