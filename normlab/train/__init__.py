"""The parts of one training run that train.py assembles: accelerator and CPU share, step, optimizer, probes,
spikes, checkpoints, evaluation, preflight, and the end-of-run summary."""
