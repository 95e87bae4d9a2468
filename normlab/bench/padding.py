"""Section 3: the pad fraction of random batches against the length-grouped batches training uses."""

import statistics

from normlab.bench.data import loader_for

GOAL = 0.05  # pad fraction of length-grouped batches, at most


def bench_padding(cfg, tokenizer, tokenized) -> dict:
    """Pad fraction over one epoch (epoch 0) of each sampler, counted on the collated attention masks, i.e. on
    exactly what the model receives: 1 - real tokens / (batch rows x padded length), summed over batches."""
    from normlab.data.batching import pad_fraction

    out = {"what": "padded positions / all positions over one epoch of train batches (lower is better)",
           "goal": f"<= {GOAL}", "batch_size": cfg.train.batch_size, "seed": cfg.seed,
           "epoch": 0, "examples": len(tokenized[cfg.data.train_split])}
    for name, grouped in (("random", False), ("length_grouped", True)):
        real = slots = 0
        per_batch = []
        for batch in loader_for(cfg, tokenizer, tokenized, grouped):
            m = batch["attention_mask"]
            real += int(m.sum())
            slots += m.numel()
            per_batch.append(pad_fraction(m))
        out[name] = {"pad_fraction": 1.0 - real / slots, "mean_batch_pad_fraction": statistics.mean(per_batch),
                     "batches": len(per_batch), "real_tokens": real, "padded_slots": slots}
    out["reduction"] = out["random"]["pad_fraction"] / max(out["length_grouped"]["pad_fraction"], 1e-12)
    return out
