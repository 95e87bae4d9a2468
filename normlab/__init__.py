"""NormLab's library: config, data, files, train, tracking, kernels, study, bench and the command lines (cli).
The module list: docs/architecture.md. model/ is a separate top-level package: it travels inside checkpoints."""
