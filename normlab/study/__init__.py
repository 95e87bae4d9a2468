"""NormLab's norm study (v3): what a run ended as, seed-level statistics, LR selection on the dev split, and the
warm worker that trains many small runs in one process. scripts/study.py is the entry point."""
