"""The written-out attention (attn_implementation="eager", or output_attentions) under fp16 autocast with attention
scores far from 0: fp16's largest finite value is 65504, so a score below -16 plus the padding bias (-65504) rounds
to -inf in fp16, and a query whose every key is padding would get a softmax of all -inf (NaN). A freshly
initialized model's scores are near 0 and cannot show this: here every query-key score of real tokens is -SCORE.
A fully padded sequence must still come out finite: the model's padded layout zeroes the projections at padded
positions, so their scores are exactly 0 and the bias alone remains (finite in fp16)."""

import pytest
import torch

from model import NormLabConfig, NormLabForSequenceClassification
from normlab.train.probes import StabilityProbe

SCORE = 1000.0  # |q.k| / sqrt(head_dim) of every query-key pair: well inside fp16's range, far past -16


def model_with_negative_scores(attn_implementation: str):
    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    model = NormLabForSequenceClassification(config).eval()
    model.set_attn_implementation(attn_implementation)
    attention = model.normlab.encoder.layers[0].attention
    d, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    u = torch.full((d,), (SCORE * head_dim**0.5 / head_dim) ** 0.5)  # q.k = -|u|^2 per head = -SCORE*sqrt(head_dim)
    with torch.no_grad():  # q = u and k = -u for every token, whatever its input
        attention.qkv.weight[: 2 * d] = 0
        attention.qkv.bias[:d], attention.qkv.bias[d: 2 * d] = u, -u
    return model


@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("attn_implementation,output_attentions", [("eager", False), ("sdpa", True)])
def test_fp16_fully_padded_row_with_large_scores_stays_finite(attn_implementation, output_attentions, unpad):
    model = model_with_negative_scores(attn_implementation)
    model.normlab.unpad = unpad
    ids = torch.randint(1, 50, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1] = 0  # a fully padded sequence
    mask[2, 3:] = 0
    probe = StabilityProbe(model)  # the largest score over real queries and keys
    probe.arm()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = model(input_ids=ids * mask, attention_mask=mask, output_attentions=output_attentions,
                    output_hidden_states=True)
    probe.read_forward(mask)
    assert probe.logit_max[0].item() == pytest.approx(-SCORE, rel=1e-2)  # the scores reach fp16's range
    if output_attentions:
        (weights,) = out.attentions
        assert weights.dtype == torch.float16
        assert torch.isfinite(weights).all()
        assert weights[2, :, :3, 3:].eq(0).all()  # padded keys get exactly no weight in a partly padded row
    assert all(torch.isfinite(h).all() for h in out.hidden_states)
    assert torch.isfinite(out.logits).all()
