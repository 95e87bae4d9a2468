"""The run config: its typed schema (schema.py), the loader that validates a YAML file and key=value overrides
against it (loader.py), what a run derives from its length (run_length.py) and --help-config (help.py)."""
