"""NormLabAttention's two paths as Hugging Face runs them (SDPA by default, written-out "eager" attention on request
or when the weights are asked for), the model's dropout (torch's nn.Dropout everywhere), and the attention-logit
probe (float32, scaled: no fp16 overflow)."""

import copy
import math

import pytest
import torch
import torch.nn as nn

from model import NormLabForSequenceClassification
from model.modeling_normlab import NormLabAttention, TokenLayout
from normlab.train.probes import attention_logit_max
from tests.test_modeling import padded_batch, tiny_config


def _attention_and_batch(**overrides):
    torch.manual_seed(0)
    config = tiny_config(**overrides)
    attn = NormLabAttention(config)
    x = torch.randn(3, 7, config.hidden_size)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    return attn, x, mask


@pytest.mark.parametrize("packed", [False, True], ids=["padded_layout", "packed_layout"])
def test_eager_path_equals_sdpa_and_returns_the_weights(packed):
    attn, x, mask = _attention_and_batch()
    layout = TokenLayout(mask, packed=packed, dtype=x.dtype)
    x = layout.pack(x)
    attn.eval()
    y_sdpa, none = attn(x, layout)
    y_eager, weights = attn(x, layout, output_attentions=True)
    assert none is None
    torch.testing.assert_close(y_eager, y_sdpa, atol=1e-6, rtol=1e-5)
    assert weights.shape == (3, 4, 7, 7)  # (B, H, L, L) on the padded grid, whatever the layout
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 7), atol=1e-6, rtol=0)  # a distribution per query
    assert weights.masked_select(~mask[:, None, None, :]).abs().max() == 0  # pad keys get exactly nothing
    attn.config._attn_implementation = "eager"  # what from_pretrained(..., attn_implementation="eager") sets
    y_config, weights_config = attn(x, layout)
    torch.testing.assert_close(y_config, y_eager, atol=0, rtol=0)
    assert weights_config is None  # the weights come back only when output_attentions asks for them


def test_attn_implementation_sdpa_is_the_default_and_eager_is_honoured(tmp_path):
    torch.manual_seed(0)
    config = tiny_config()
    sdpa = NormLabForSequenceClassification(copy.deepcopy(config)).eval()
    assert sdpa.config._attn_implementation == "sdpa"
    sdpa.save_pretrained(tmp_path)
    input_ids, attention_mask = padded_batch()
    for impl in ("sdpa", "eager"):
        loaded = NormLabForSequenceClassification.from_pretrained(tmp_path, attn_implementation=impl).eval()
        assert loaded.config._attn_implementation == impl
        with torch.no_grad():
            got = loaded(input_ids, attention_mask=attention_mask).logits
            torch.testing.assert_close(got, sdpa(input_ids, attention_mask=attention_mask).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="Flash Attention 2"):  # declared unsupported: a clear error, not a fallback
        NormLabForSequenceClassification.from_pretrained(tmp_path, attn_implementation="flash_attention_2")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_dropout_in_training_only(impl):
    # With the same weights, training-mode attention (dropout on the attention weights) differs from eval, is
    # reproduced by the seed, and with p = 0 equals eval.
    attn, x, mask = _attention_and_batch(attention_probs_dropout_prob=0.5)
    attn.config._attn_implementation = impl
    layout = TokenLayout(mask, packed=False, dtype=x.dtype)
    y_eval = attn.eval()(x, layout)[0]
    attn.train()
    torch.manual_seed(1)
    y_train = attn(x, layout)[0]
    torch.manual_seed(1)
    assert torch.equal(attn(x, layout)[0], y_train)
    assert (y_train - y_eval).abs().max() > 1e-2
    attn.attn_dropout.p = 0.0
    torch.testing.assert_close(attn(x, layout)[0], y_eval, atol=1e-6, rtol=1e-5)


def test_every_dropout_is_torch_dropout_and_seeded():
    torch.manual_seed(0)
    config = tiny_config(num_labels=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = NormLabForSequenceClassification(config)
    drops = [m for m in model.modules() if "Dropout" in type(m).__name__]
    assert drops and all(type(m) is nn.Dropout for m in drops)
    input_ids, attention_mask = padded_batch()
    model.train()
    torch.manual_seed(3)
    a = model(input_ids, attention_mask=attention_mask).logits
    b = model(input_ids, attention_mask=attention_mask).logits
    torch.manual_seed(3)
    assert torch.equal(model(input_ids, attention_mask=attention_mask).logits, a)
    assert not torch.equal(a, b)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids, attention_mask=attention_mask).logits,
                           model(input_ids, attention_mask=attention_mask).logits)


def test_training_step_under_torch_compile_fullgraph():
    # The whole model with dropout, compiled as one graph (padded layout, as under train.compile=true).
    torch.manual_seed(0)
    config = tiny_config(num_labels=2, norm="custom_layernorm", hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1)
    model = NormLabForSequenceClassification(config).train()
    input_ids, attention_mask = padded_batch()
    labels = torch.tensor([0, 1, 1])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------------------------------------------
# the attention-logit probe
# ------------------------------------------------------------------------------------------------------------


def test_logit_probe_does_not_overflow_in_float16():
    # q.k = 16 * 70 * 70 = 78400 overflows float16 (max 65504); the scaled logit 78400 / 4 = 19600 does not.
    attn, _, mask = _attention_and_batch(hidden_size=64, num_attention_heads=4)  # head_dim 16
    layout = TokenLayout(mask, packed=False, dtype=torch.float16)
    q = torch.full((3, 4, 7, 16), 70.0, dtype=torch.float16)
    assert torch.isinf((q[0, 0] @ q[0, 0].T)).all()  # what unscaled half-precision logits give
    got = attention_logit_max(q, q.clone(), layout, attn.scale)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(19600.0)


def test_logit_probe_is_float32_under_autocast_and_ignores_padding():
    attn, x, mask = _attention_and_batch()
    layout = TokenLayout(mask, packed=False, dtype=x.dtype)
    q, k = torch.randn(2, 3, 4, 7, 8).unbind(0)
    k[2, :, 3] = 1e4  # a huge logit at a pad key of sequence 2: must not count
    real_logits = [q[b, :, :n] @ k[b, :, :n].transpose(-1, -2) for b, n in enumerate((7, 4, 2))]  # (H, n, n)
    want = max(t.max().item() for t in real_logits) / math.sqrt(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention_logit_max(q, k, layout, attn.scale)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want, rel=1e-6)
