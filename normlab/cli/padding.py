"""The padding of a config's training batches over one epoch, random against length-grouped: the share of pad
positions and the real tokens per batch, with the rows' lengths (and, for documents, how many have each size).

    python scripts/padding.py [--config FILE|NAME] [key=value ...]     e.g. --config sst2_docs train.batch_size=32
"""

import os
import sys
from collections import Counter

import numpy as np

PROG = "padding.py"


def describe(cfg, dsd, tokenized) -> list[str]:
    """Lines about the training rows: how many, their lengths in tokens, and the documents' sizes."""
    from normlab.data.documents import SENTENCE_IDS
    from normlab.data.sources import column

    d = cfg.data
    lengths = np.asarray(column(tokenized[d.train_split], "length"))
    rows = dsd[d.train_split]
    what = "sentences"
    if SENTENCE_IDS in rows.column_names:  # documents (data.doc_sizes)
        sizes = Counter(len(ids) for ids in column(rows, SENTENCE_IDS))
        what = "documents (" + ", ".join(f"{n:,} of {k}" for k, n in sorted(sizes.items())) + " sentences)"
    return [f"{len(rows):,} training {what}, {len(dsd[d.eval_split]):,} {d.eval_split} rows",
            f"tokens per row: mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, max {lengths.max()}; "
            f"{(lengths >= d.max_length).mean():.1%} reach data.max_length={d.max_length} (truncated)"]


def padding_lines(result: dict) -> list[str]:
    """normlab.bench.padding.bench_padding's result as one line per sampler."""
    lines = []
    for name in ("random", "length_grouped"):
        r = result[name]
        lines.append(f"{name.replace('_', '-') + ' batches:':24} pad fraction {r['pad_fraction']:.3f}, real tokens per "
                     f"batch {r['real_tokens'] / r['batches']:,.0f} of {r['padded_slots'] / r['batches']:,.0f} "
                     f"positions ({r['batches']:,} batches)")
    return lines


def main(argv=None) -> int:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    from normlab.bench.padding import bench_padding
    from normlab.command import error_exit
    from normlab.config.loader import load_config, parse_cli
    from normlab.data.tokenizer import load_tokenized

    try:
        config_file, overrides, _ = parse_cli(argv)
        cfg = load_config(config_file, overrides)
        dsd, tokenizer, tokenized = load_tokenized(cfg)
    except ValueError as e:  # ConfigError, DataError: one line
        return error_exit(PROG, e)
    result = bench_padding(cfg, tokenizer, tokenized)
    print(f"{config_file or 'default'}, batch {cfg.train.batch_size}, seed {cfg.seed}, epoch 0:")
    for line in describe(cfg, dsd, tokenized) + padding_lines(result):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
