"""NormLab's post-LN and pre-LN blocks against Hugging Face's BERT and MegatronBERT (someone else's code).

Like minGPT's tests/test_huggingface_import.py: random small HF models, weights copied with model/convert.py,
hidden states compared on real tokens of a padded batch.
"""

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertModel, MegatronBertConfig, MegatronBertModel

from model.convert import bert_to_normlab, megatron_bert_to_normlab

SMALL = dict(
    vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)


def _padded_batch(seed, vocab_size=101, batch=4, length=11):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (batch, length), generator=g)
    lengths = torch.tensor([length, 7, 3, 9])[:batch]
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # right padding
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    token_type_ids = (torch.arange(length)[None, :] >= (lengths[:, None] // 2)).long() * attention_mask
    return input_ids, attention_mask, token_type_ids


def _assert_same_on_real_tokens(ours, theirs, attention_mask):
    real = attention_mask.bool()
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


def _randomize_norms(model, seed):
    """Default LayerNorms are (1, 0): randomize them so a swapped or missing norm copy cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))


def _assert_same_on_padded_batch(ours, hf, seed):
    """Both encoders on one random padded batch with token types: equal last_hidden_state on real tokens."""
    input_ids, attention_mask, token_type_ids = _padded_batch(seed)
    with torch.no_grad():
        expected = hf(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        got = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    _assert_same_on_real_tokens(got, expected, attention_mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bert_matches_hf(seed):
    torch.manual_seed(seed)
    hf = BertModel(BertConfig(**SMALL, layer_norm_eps=1e-6 * (seed + 1))).eval()
    _randomize_norms(hf, seed)
    ours = bert_to_normlab(hf)
    assert not ours.training
    cfg = ours.config
    assert (cfg.norm, cfg.norm_placement, cfg.embedding_norm) == ("layernorm", "post", True)
    assert cfg.norm_eps == hf.config.layer_norm_eps
    assert ours.encoder.final_norm is None

    _assert_same_on_padded_batch(ours, hf, seed)


def test_bert_from_task_model_and_without_padding():
    torch.manual_seed(3)
    hf = BertForSequenceClassification(BertConfig(**SMALL)).eval()  # the encoder lives at hf.bert
    ours = bert_to_normlab(hf)
    input_ids, _, _ = _padded_batch(3)
    with torch.no_grad():  # no attention_mask, no token types: both models' defaults
        torch.testing.assert_close(ours(input_ids).last_hidden_state, hf.bert(input_ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_megatron_bert_matches_hf(seed):
    torch.manual_seed(seed)
    hf = MegatronBertModel(MegatronBertConfig(**SMALL, layer_norm_eps=1e-5)).eval()
    _randomize_norms(hf, seed)
    ours = megatron_bert_to_normlab(hf)
    assert not ours.training
    cfg = ours.config
    assert (cfg.norm, cfg.norm_placement, cfg.embedding_norm) == ("layernorm", "pre", False)
    assert ours.embeddings.norm is None and ours.encoder.final_norm is not None

    _assert_same_on_padded_batch(ours, hf, seed)


def test_wrong_model_type_raises():
    hf = MegatronBertModel(MegatronBertConfig(**SMALL))
    with pytest.raises(ValueError, match="BertModel"):
        bert_to_normlab(hf)
    with pytest.raises(ValueError, match="MegatronBertModel"):
        megatron_bert_to_normlab(BertModel(BertConfig(**SMALL)))
