"""Shared by the tests of the pooled vector's norms and of ghost batches: a width-16, 2-layer config small enough
to check against torch's modules token by token, and a right-padded batch of random token ids."""

import torch

from model import NormLabConfig

VOCAB = 50


def width16_config(**overrides) -> NormLabConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)
    kw.update(overrides)
    return NormLabConfig(**kw)


def padded_batch(lengths, seed=0):
    """input_ids (B, max(lengths)) with pad id 0 after each sentence's length, and its attention_mask."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(1, VOCAB, (len(lengths), max(lengths)), generator=g) * attention_mask, attention_mask
