"""The run config: its typed schema (schema.py) and the loader that validates a YAML file and key=value
overrides against it (loader.py)."""
