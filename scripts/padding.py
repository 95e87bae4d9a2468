"""`python scripts/padding.py ARGS` runs `python -m normlab.cli.padding ARGS`.
normlab/cli/padding.py's docstring gives the usage."""

from _checkout import run

run("normlab.cli.padding")
