"""What a run reports: metrics.jsonl, Weights & Biases runs, their records and reports, the model card."""
