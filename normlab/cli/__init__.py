"""The command lines' code: `normlab-evaluate`, `normlab-study`, `normlab-report`, `normlab-bench` (pyproject.toml),
`python -m normlab.cli.<name>`, and the shims `python scripts/<name>.py`."""
