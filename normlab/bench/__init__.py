"""The benchmarks behind scripts/bench.py: one module per section (layernorm, throughput, padding, memory), sharing
timer.py; data.py and models.py give them the training batches and the contestant models; report.py prints them."""
