"""The real SST-2 batches the benchmarks run on: the tokenized data, and batches from training's loader."""

import itertools

from normlab.train.step import MODEL_INPUTS


def load_data(cfg):
    """(tokenizer, tokenized splits, number of labels): training's data, as train.py loads it."""
    from normlab.data.sources import label_names
    from normlab.data.tokenizer import load_tokenized

    dsd, tokenizer, tokenized = load_tokenized(cfg)
    return tokenizer, tokenized, len(label_names(dsd, cfg.data))


def loader_for(cfg, tokenizer, tokenized, group_by_length: bool):
    """Training's loader of `cfg`, with or without length grouping, at epoch 0."""
    from normlab.config.loader import replace_keys
    from normlab.data.batching import build_dataloaders

    c = replace_keys(cfg, {"data.group_by_length": group_by_length})
    train_loader, _ = build_dataloaders(c, tokenizer, tokenized)
    train_loader.batch_sampler.set_epoch(0)
    return train_loader


def take_batches(cfg, tokenizer, tokenized, n: int, device) -> list[dict]:
    """The first `n` batches training would take (the model's inputs only), on `device`."""
    loader = loader_for(cfg, tokenizer, tokenized, cfg.data.group_by_length)
    return [{k: v.to(device) for k, v in batch.items() if k in MODEL_INPUTS} for batch in itertools.islice(loader, n)]
