"""NormLab's norm study: a study file is a typed spec (spec.py) that the runner trains (runner.py) and the one
analysis engine reports (engine.py, report.py). scripts/study.py and scripts/report.py are the entry points."""
