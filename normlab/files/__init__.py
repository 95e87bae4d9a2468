"""Files on disk: JSON/YAML/JSON Lines read and written atomically (formats.py), guarded writes with one-line
errors (writes.py), caches NormLab can always rebuild (cache.py)."""
