"""One training run: run.py (its main: setup, the loop, the end) and the parts it assembles: accelerator and CPU
share, step, optimizer, probes, spikes, checkpoints, evaluation, preflight, and the end-of-run summary."""
