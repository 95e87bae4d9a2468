"""The benchmarks behind scripts/bench.py (its docstring says what each section measures and why).

timer.py (interleaved repetitions, device sync, medians) is shared by every timed section; layernorm.py,
throughput.py, padding.py and memory.py are one section each; data.py and models.py give the last three the
training batches and the contestant models; report.py prints the results as a table.
"""
