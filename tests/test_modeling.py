"""NormLab's modeling code: every norm x placement, padding invariance (the project's central claim), the
placements' structure, DeepNet's constants, QK-norm, the logit-max probe, the heads' losses, config errors."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model import NormLabConfig, NormLabForMaskedLM, NormLabForSequenceClassification, NormLabModel
from model.configuration_normlab import NORM_PLACEMENTS, NORM_TYPES
from model.modeling_normlab import AttentionLogitsTap, NormLabAttention, Tap, TokenLayout, deepnorm_alpha, deepnorm_beta
from model.norms import BATCH_STAT_NORMS, NORM_REGISTRY
from normlab.train.probes import StabilityProbe

VOCAB = 60
PAD = 0


def tiny_config(**overrides):
    kw = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )
    kw.update(overrides)
    return NormLabConfig(**kw)


def padded_batch(lengths=(7, 4, 2), extra_pad=0, seed=0):
    """Right-padded batch: input_ids (B, max_len + extra_pad), attention_mask of 1 (real) / 0 (pad)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths) + extra_pad
    lengths = torch.tensor(lengths)
    attention_mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(1, VOCAB, (len(lengths), L), generator=g) * attention_mask  # pads are PAD=0
    return input_ids, attention_mask


def repad(input_ids, attention_mask, extra_pad):
    """The same batch with `extra_pad` more pad columns on the right."""
    B = input_ids.shape[0]
    return (torch.cat([input_ids, torch.full((B, extra_pad), PAD)], dim=1),
            torch.cat([attention_mask, torch.zeros(B, extra_pad, dtype=attention_mask.dtype)], dim=1))


# ------------------------------------------------------------------------------------------------------------
# every norm x placement builds, runs forward and backward
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
@pytest.mark.parametrize("norm", NORM_TYPES)
def test_every_norm_and_placement_forward_backward(norm, placement):
    torch.manual_seed(0)
    config = tiny_config(norm=norm, norm_placement=placement, hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1)
    model = NormLabForSequenceClassification(config).train()
    input_ids, attention_mask = padded_batch()
    out = model(input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 2, 1]), output_hidden_states=True)
    assert out.logits.shape == (3, 3)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert all(h.shape == (3, 7, 32) for h in out.hidden_states)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"


# ------------------------------------------------------------------------------------------------------------
# padding invariance: the central claim of the project
# ------------------------------------------------------------------------------------------------------------


def _real_tokens_and_logits(model, input_ids, attention_mask):
    """One forward of a classifier: (last_hidden_state on real tokens (T, D), logits (B, C))."""
    captured = {}
    hook = model.normlab.register_forward_hook(lambda mod, args, out: captured.update(h=out.last_hidden_state))
    try:
        logits = model(input_ids, attention_mask=attention_mask).logits
    finally:
        hook.remove()
    return captured["h"][attention_mask.bool()], logits


PADDING_CASES = [(norm, placement, "cls", True) for norm in NORM_TYPES if not NORM_REGISTRY[norm].sees_padding
                 for placement in NORM_PLACEMENTS]
PADDING_CASES += [("masked_batchnorm", "pre", "mean", True), ("layernorm", "post", "mean", True)]
# the padded layout (NormLabModel.unpad = False) must be padding-invariant too: it is what runs without packing
PADDING_CASES += [(norm, "pre", "mean", False) for norm in ("layernorm", "masked_batchnorm", "powernorm", "dyt")]
PADDING_CASES = [(*case, {}) for case in PADDING_CASES]
# a final norm of another type than the blocks', the pooled vector's batch centring (study v5's arms), its
# standardization with a gain (study v6's)
PADDING_CASES += [("layernorm", "pre", "cls", True, dict(final_norm="masked_batchnorm")),
                  ("masked_batchnorm", "pre", "cls", True, dict(final_norm="layernorm", embedding_norm=True)),
                  ("layernorm", "pre", "cls", True, dict(center_pooled=True)),
                  ("layernorm", "pre", "cls", True, dict(pooled_norm="standardize", pooled_gain=4.0)),
                  ("layernorm", "sandwich", "mean", False, dict(final_norm="powernorm"))]


@pytest.mark.parametrize("norm,placement,pooling,unpad,extra", PADDING_CASES)
def test_real_token_outputs_do_not_depend_on_padding(norm, placement, pooling, unpad, extra):
    torch.manual_seed(0)
    # powernorm: a 1-step warmup, so step 0 uses batch statistics and step 1 the running ones
    model = NormLabForSequenceClassification(tiny_config(norm=norm, norm_placement=placement, pooling=pooling,
                                                         powernorm_warmup_steps=1, **extra))
    model.normlab.unpad = unpad
    input_ids, attention_mask = padded_batch()
    more_ids, more_mask = repad(input_ids, attention_mask, extra_pad=5)

    for step in range(2):  # train mode; each forward on an identical copy so running statistics agree
        model.train()
        a, b = copy.deepcopy(model), copy.deepcopy(model)
        ha, la = _real_tokens_and_logits(a, input_ids, attention_mask)
        hb, lb = _real_tokens_and_logits(b, more_ids, more_mask)
        torch.testing.assert_close(hb, ha, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
        model(more_ids, attention_mask=more_mask)  # advance running statistics / PowerNorm's step counter

    model.eval()
    with torch.no_grad():
        ha, la = _real_tokens_and_logits(model, input_ids, attention_mask)
        hb, lb = _real_tokens_and_logits(model, more_ids, more_mask)
    torch.testing.assert_close(hb, ha, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_naive_batchnorm_outputs_depend_on_padding(placement):
    """The cautionary variant: pad positions enter the batch statistics, so adding padding changes real tokens."""
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(norm="batchnorm", norm_placement=placement)).train()
    input_ids, attention_mask = padded_batch()
    more_ids, more_mask = repad(input_ids, attention_mask, extra_pad=5)
    ha, la = _real_tokens_and_logits(copy.deepcopy(model), input_ids, attention_mask)
    hb, lb = _real_tokens_and_logits(copy.deepcopy(model), more_ids, more_mask)
    assert (ha - hb).abs().max() > 1e-2
    assert (la - lb).abs().max() > 1e-4


@pytest.mark.parametrize("norm", ["layernorm", "masked_batchnorm", "powernorm"])
def test_packed_and_padded_layouts_agree(norm):
    """Computing only the real tokens (packed) and computing the whole (B, L) grid (padded) are the same function:
    outputs, gradients and running statistics agree on real tokens."""
    torch.manual_seed(0)
    packed = NormLabForSequenceClassification(tiny_config(norm=norm, norm_placement="pre"))
    padded = copy.deepcopy(packed)
    padded.normlab.unpad = False
    input_ids, attention_mask = padded_batch()
    labels = torch.tensor([0, 1, 2])
    outs = {}
    for name, model in (("packed", packed), ("padded", padded)):
        out = model(input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True)
        out.loss.backward()
        outs[name] = out
    real = attention_mask.bool()
    for hp, hq in zip(outs["packed"].hidden_states, outs["padded"].hidden_states):
        torch.testing.assert_close(hp[real], hq[real], atol=1e-5, rtol=1e-5)
        assert hp[~real].abs().max() == 0  # packed: pad positions are never computed, returned as zeros
        assert hq[~real].abs().max() == 0  # padded: the same convention
    torch.testing.assert_close(outs["packed"].logits, outs["padded"].logits, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(packed.named_parameters(), padded.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    for (name, b), c in zip(packed.named_buffers(), padded.buffers()):
        torch.testing.assert_close(b, c, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("norm", ["layernorm", "batchnorm"])
def test_pad_rows_are_zeros_in_every_layout_and_under_torch_export(norm):
    """One convention for pad positions wherever the model runs: eager packed, eager padded (unpad=False; the
    naive batchnorm always), and a torch.export'ed graph (padded: packing has data-dependent shapes)."""
    torch.manual_seed(0)
    model = NormLabModel(tiny_config(norm=norm)).eval()
    input_ids, attention_mask = padded_batch()
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    with torch.no_grad():
        eager = model(**inputs).last_hidden_state
        model.unpad = False
        padded = model(**inputs).last_hidden_state
    exported = torch.export.export(model, (), inputs).module()(**inputs).last_hidden_state.detach()
    pad = ~attention_mask.bool()
    for got in (eager, padded, exported):
        assert got[pad].abs().max() == 0
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("unpad", [True, False])
def test_returned_hidden_states_are_the_tensors_the_blocks_read(unpad):
    """retain_grad() / autograd.grad w.r.t. a returned hidden state reach the loss (it is not a detached copy)."""
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(norm_placement="pre"))
    model.normlab.unpad = unpad
    input_ids, attention_mask = padded_batch()
    out = model(input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 1, 2]), output_hidden_states=True,
                output_attentions=True)
    grads = torch.autograd.grad(out.loss, [*out.hidden_states, *out.attentions], allow_unused=True)
    assert all(g is not None for g in grads)
    assert all(g[~attention_mask.bool()].abs().max() == 0 for g in grads[: len(out.hidden_states)])


def test_attention_weights_are_returned_when_asked():
    torch.manual_seed(0)
    model = NormLabModel(tiny_config(num_hidden_layers=3)).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True)
        plain = model(input_ids, attention_mask=attention_mask)
    assert len(out.attentions) == 3 and all(a.shape == (3, 4, 7, 7) for a in out.attentions)
    real = attention_mask.bool()
    for a in out.attentions:
        torch.testing.assert_close(a.sum(-1), torch.ones(3, 4, 7))  # every query row is a distribution
        assert a.transpose(1, 3)[~real].abs().max() == 0  # no weight on pad keys
    torch.testing.assert_close(out.last_hidden_state, plain.last_hidden_state, atol=1e-6, rtol=1e-5)
    assert plain.attentions is None


def test_inputs_embeds_replace_the_word_embeddings():
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config()).eval()
    input_ids, attention_mask = padded_batch()
    embeds = model.get_input_embeddings()(input_ids)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=embeds, attention_mask=attention_mask).logits,
                                   model(input_ids, attention_mask=attention_mask).logits)
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        model(input_ids, inputs_embeds=embeds)


def test_gradient_checkpointing_gives_the_same_gradients():
    """The BN family under checkpointing: tests/test_checkpointing.py."""
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable()
    input_ids, attention_mask = padded_batch()
    for m in (model, checkpointed):
        torch.manual_seed(1)  # the same dropout masks (the recomputation replays the RNG state)
        m.train()(input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 1, 2])).loss.backward()
    for (name, p), q in zip(model.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_naive_batchnorm_always_sees_the_padding():
    """Packing would silently turn `batchnorm` into `masked_batchnorm`: it must stay on the padded layout."""
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(norm="batchnorm")).train()
    masked = NormLabForSequenceClassification(tiny_config(norm="masked_batchnorm")).train()
    masked.load_state_dict(model.state_dict())
    input_ids, attention_mask = padded_batch()
    ha, _ = _real_tokens_and_logits(model, input_ids, attention_mask)
    hb, _ = _real_tokens_and_logits(masked, input_ids, attention_mask)
    assert (ha - hb).abs().max() > 1e-2


def test_unpadded_batch_equals_padded_batch_for_each_sequence():
    """A sequence alone (no padding, no attention_mask) gives the same outputs as inside a padded batch (eval)."""
    torch.manual_seed(0)
    model = NormLabModel(tiny_config(norm="layernorm", norm_placement="pre")).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        batched = model(input_ids, attention_mask=attention_mask).last_hidden_state
        for i, n in enumerate(attention_mask.sum(1).tolist()):
            alone = model(input_ids[i : i + 1, :n]).last_hidden_state[0]
            torch.testing.assert_close(batched[i, :n], alone, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# structure of the placements
# ------------------------------------------------------------------------------------------------------------


def test_final_norm_is_the_blocks_unless_set_and_only_where_a_placement_has_one():
    assert tiny_config().final_norm == "layernorm"  # None resolves to the block norm: old configs keep their model
    model = NormLabModel(tiny_config(final_norm="masked_batchnorm"))
    assert type(model.encoder.final_norm).__name__ == "MaskedBatchNorm"
    assert type(model.encoder.layers[0].attn_norm).__name__ == "LayerNorm"
    assert list(model.batch_statistics_norms()) == ["encoder.final_norm"] and model.config.uses_batch_statistics
    with pytest.raises(ValueError, match="final_norm='rmsnorm' needs a placement with a final norm"):
        tiny_config(norm_placement="post", final_norm="rmsnorm")
    with pytest.raises(ValueError, match="final_norm='bn' is not valid; choose one of: layernorm"):
        tiny_config(final_norm="bn")


def test_a_naive_batchnorm_final_norm_keeps_the_padded_layout_and_sees_the_padding():
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(final_norm="batchnorm")).train()
    input_ids, attention_mask = padded_batch()
    more_ids, more_mask = repad(input_ids, attention_mask, extra_pad=5)
    _, la = _real_tokens_and_logits(copy.deepcopy(model), input_ids, attention_mask)
    _, lb = _real_tokens_and_logits(copy.deepcopy(model), more_ids, more_mask)
    assert (la - lb).abs().max() > 1e-4


def test_centred_pooled_vectors_have_a_zero_batch_mean_in_training_and_the_running_mean_removed_in_eval():
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(center_pooled=True))
    assert model.config.uses_batch_statistics and list(model.batch_statistics_norms()) == ["center"]
    assert not any(n.startswith("center") for n, _ in model.named_parameters())  # parameter-free
    seen = {}
    model.classifier.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0].detach()))
    input_ids, attention_mask = padded_batch()
    model.train()(input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(seen["x"].mean(0), torch.zeros(32), atol=1e-6, rtol=0)
    model.eval()(input_ids, attention_mask=attention_mask)
    pooled = model.normlab(input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
    torch.testing.assert_close(seen["x"], pooled - model.center.running_mean, atol=1e-6, rtol=1e-6)


def test_final_norm_only_where_the_residual_stream_is_unnormalized():
    for placement, has_final in [("post", False), ("pre", True), ("sandwich", True), ("deepnorm", False)]:
        model = NormLabModel(tiny_config(norm_placement=placement))
        assert (model.encoder.final_norm is not None) == has_final, placement
    sandwich_block = NormLabModel(tiny_config(norm_placement="sandwich")).encoder.layers[0]
    assert hasattr(sandwich_block, "attn_out_norm") and hasattr(sandwich_block, "ffn_out_norm")


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_final_norm_and_hidden_states_follow_transformers_convention(placement):
    """pre/sandwich normalize the last block's output; hidden_states[-1] is last_hidden_state (as transformers 5
    ties them) and holds N + 1 states."""
    torch.manual_seed(0)
    model = NormLabModel(tiny_config(norm_placement=placement)).eval()
    input_ids, attention_mask = padded_batch()
    seen = {}
    model.encoder.layers[-1].register_forward_hook(lambda mod, args, out: seen.update(block=out[0]))
    out = model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert out.hidden_states[-1] is out.last_hidden_state
    real = attention_mask.bool()
    block_out = seen["block"][0] if seen["block"].dim() == 3 and seen["block"].shape[0] == 1 else seen["block"][real]
    if placement in ("pre", "sandwich"):  # final norm weights are (1, 0)
        expected = F.layer_norm(block_out, (32,), eps=model.config.norm_eps)
    else:
        expected = block_out
    torch.testing.assert_close(out.last_hidden_state[real], expected)


@pytest.mark.parametrize("placement,expected", [("post", True), ("pre", False), ("sandwich", False),
                                                ("deepnorm", True)])
def test_embedding_norm_default_follows_placement(placement, expected):
    config = tiny_config(norm_placement=placement)
    assert config.embedding_norm is expected
    assert (NormLabModel(config).embeddings.norm is not None) is expected
    # and the explicit setting wins
    flipped = tiny_config(norm_placement=placement, embedding_norm=not expected)
    assert (NormLabModel(flipped).embeddings.norm is not None) is (not expected)


def _zero_sublayers(block):
    with torch.no_grad():
        for lin in (block.attention.out_proj, block.ffn.fc_out):
            lin.weight.zero_()
            lin.bias.zero_()


@pytest.mark.parametrize("placement,scale", [("post", 1.0), ("deepnorm", None), ("pre", 1.0), ("sandwich", 1.0)])
def test_residual_scale(placement, scale):
    """With both sublayers outputting 0 and no norm, a block multiplies its input by alpha twice (deepnorm) or
    leaves it unchanged."""
    config = tiny_config(norm="none", norm_placement=placement, num_hidden_layers=3)
    block = NormLabModel(config).encoder.layers[0]
    _zero_sublayers(block)
    alpha = deepnorm_alpha(3) if scale is None else scale
    assert block.residual_scale == pytest.approx(alpha)
    x = torch.randn(2, 5, 32)
    out, _ = block(x, TokenLayout(None, packed=False, dtype=x.dtype))
    torch.testing.assert_close(out, x * alpha * alpha)


def test_deepnorm_constants():
    assert deepnorm_alpha(6) == pytest.approx(12**0.25)
    assert deepnorm_beta(6) == pytest.approx(48**-0.25)


def test_deepnorm_init_gains():
    """ffn, value and output projections start with std beta * initializer_range; q and k with the plain std."""
    torch.manual_seed(0)
    N, D, std = 3, 128, 0.02
    beta = deepnorm_beta(N)
    for placement, gain in [("deepnorm", beta), ("post", 1.0)]:
        model = NormLabModel(tiny_config(norm_placement=placement, num_hidden_layers=N, hidden_size=D,
                                         intermediate_size=256, initializer_range=std))
        for block in model.encoder.layers:
            w = block.attention.qkv.weight  # rows [q; k; v]
            assert w[: 2 * D].std().item() == pytest.approx(std, rel=0.05)
            assert w[2 * D :].std().item() == pytest.approx(std * gain, rel=0.05)
            for lin in (block.attention.out_proj, block.ffn.fc_in, block.ffn.fc_out):
                assert lin.weight.std().item() == pytest.approx(std * gain, rel=0.05)
                assert lin.bias.abs().max().item() == 0.0
        assert model.embeddings.word_embeddings.weight[1:].std().item() == pytest.approx(std, rel=0.05)
        assert model.embeddings.word_embeddings.weight[PAD].abs().max().item() == 0.0


# ------------------------------------------------------------------------------------------------------------
# attention: QK-norm and the logit-max probe
# ------------------------------------------------------------------------------------------------------------


def _direct_logit_max(attention, x, attention_mask):
    """max over heads, real queries and real keys of q.k / sqrt(Dh), computed from the weights directly."""
    B, L, D = x.shape
    H, Dh = attention.num_heads, attention.head_dim
    q, k, _ = F.linear(x, attention.qkv.weight, attention.qkv.bias).split(D, dim=-1)
    q = q.view(B, L, H, Dh).transpose(1, 2)
    k = k.view(B, L, H, Dh).transpose(1, 2)
    if isinstance(attention.q_norm, nn.LayerNorm):
        q = F.layer_norm(q, (Dh,), attention.q_norm.weight, attention.q_norm.bias, attention.q_norm.eps)
        k = F.layer_norm(k, (Dh,), attention.k_norm.weight, attention.k_norm.bias, attention.k_norm.eps)
    best = -math.inf
    for b in range(B):
        n = int(attention_mask[b].sum())
        logits = q[b, :, :n] @ k[b, :, :n].transpose(-1, -2) / math.sqrt(Dh)  # (H, n, n)
        best = max(best, logits.max().item())
    return best


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_dropout"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_logit_max_recording_matches_direct_computation(qk_norm, train, attn):
    torch.manual_seed(0)
    drop = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1) if train else {}
    config = tiny_config(norm_placement="post", qk_norm=qk_norm, **drop)
    model = NormLabForSequenceClassification._from_config(config, attn_implementation=attn)
    model.train(train)  # the probe reads q and k, whatever the attention path and its dropout do with them
    input_ids, attention_mask = padded_batch()
    probe = StabilityProbe(model)
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    assert not probe.recorder.armed and all(m is None for m in probe.recorder.logit_max)  # unarmed: nothing
    probe.arm()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    recorded = list(probe.recorder.logit_max)
    for i, layer in enumerate(model.normlab.encoder.layers):  # post-LN: block i's attention sees hidden_states[i]
        got = recorded[i]
        assert got.dim() == 0 and not got.requires_grad
        expected = _direct_logit_max(layer.attention, out.hidden_states[i], attention_mask)
        assert got.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    probe.read_forward(attention_mask)
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    assert all(a is b for a, b in zip(probe.recorder.logit_max, recorded, strict=True))  # disarmed: nothing new


def test_qk_norm_bounds_attention_logits():
    """With QK-norm (unit LayerNorm gains) |q.k|/sqrt(Dh) <= sqrt(Dh) however large the projections grow."""
    torch.manual_seed(0)
    input_ids, attention_mask = padded_batch()
    maxima = {}
    for qk_norm in (False, True):
        torch.manual_seed(0)
        model = NormLabModel(tiny_config(norm_placement="post", qk_norm=qk_norm)).eval()
        attention = model.encoder.layers[0].attention
        assert isinstance(attention, NormLabAttention) and isinstance(attention.q_norm, nn.LayerNorm) == qk_norm
        with torch.no_grad():
            attention.qkv.weight.mul_(100.0)
        probe = StabilityProbe(model)
        probe.arm()
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask)
        probe.read_forward(attention_mask)
        maxima[qk_norm] = probe.logit_max[0].item()
    head_dim = 32 // 4
    assert maxima[True] <= math.sqrt(head_dim) + 1e-4
    assert maxima[False] > 10 * math.sqrt(head_dim)


# ------------------------------------------------------------------------------------------------------------
# heads
# ------------------------------------------------------------------------------------------------------------


def test_classification_losses_follow_hf_problem_types():
    torch.manual_seed(0)
    input_ids, attention_mask = padded_batch()

    model = NormLabForSequenceClassification(tiny_config(num_labels=1))  # regression
    labels = torch.tensor([0.5, -1.0, 2.0])
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert model.config.problem_type == "regression"
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(), labels))

    model = NormLabForSequenceClassification(tiny_config(num_labels=3))  # single label: integer labels
    labels = torch.tensor([2, 0, 1])
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert model.config.problem_type == "single_label_classification"
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))

    model = NormLabForSequenceClassification(tiny_config(num_labels=3))  # multi label: float multi-hot labels
    labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert model.config.problem_type == "multi_label_classification"
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, labels))


def test_mean_pooling_averages_real_tokens_only():
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(pooling="mean")).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        h = model.normlab(input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = torch.stack([h[b, : int(n)].mean(0) for b, n in enumerate(attention_mask.sum(1))])
        expected = model.classifier(pooled)
        torch.testing.assert_close(model(input_ids, attention_mask=attention_mask).logits, expected)


def test_return_dict_false_gives_tuples():
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config()).eval()
    input_ids, attention_mask = padded_batch()
    loss, logits = model(input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 1, 2]),
                         return_dict=False)
    out = model(input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 1, 2]))
    torch.testing.assert_close(logits, out.logits)
    torch.testing.assert_close(loss, out.loss)
    logits, hidden, attentions = model(input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                       output_attentions=True, return_dict=False)
    assert len(hidden) == 3 and len(attentions) == 2


def test_masked_lm_ignores_minus_100_and_ties_weights():
    torch.manual_seed(0)
    model = NormLabForMaskedLM(tiny_config())
    assert model.lm_head.decoder.weight is model.normlab.embeddings.word_embeddings.weight
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    input_ids, attention_mask = padded_batch()
    labels = torch.full_like(input_ids, -100)
    labels[0, 1], labels[0, 4], labels[1, 2] = 5, 17, 33
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits.shape == (3, 7, VOCAB)
    sel = labels != -100
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[sel], labels[sel]))
    # an ignored position's logits do not enter the loss: its gradient through the logits is zero
    logits = out.logits.detach().requires_grad_(True)
    F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100).backward()
    assert logits.grad[~sel].abs().max() == 0
    # the tied matrix gets the gradient of both uses (embedding lookup and decoder)
    out.loss.backward()
    assert model.normlab.embeddings.word_embeddings.weight.grad is not None


# ------------------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    (dict(norm="layrnorm"), ["layrnorm", "layernorm", "masked_batchnorm"]),
    (dict(norm_placement="middle"), ["middle", "post", "deepnorm"]),
    (dict(hidden_size=30, num_attention_heads=4), ["30", "4"]),
    (dict(pooling="max"), ["max", "cls", "mean"]),
])
def test_bad_config_raises_value_error_at_build(kwargs, words):
    with pytest.raises(ValueError) as err:
        tiny_config(**kwargs)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("norm", BATCH_STAT_NORMS)
def test_batch_stat_norm_with_one_real_token_raises(norm):
    model = NormLabForSequenceClassification(tiny_config(norm=norm)).train()
    with pytest.raises(ValueError, match="2 real tokens"):
        model(torch.tensor([[5]]), attention_mask=torch.tensor([[1]]))
    if not NORM_REGISTRY[norm].sees_padding:  # the naive variant counts pad positions: 1 token only when masked
        with pytest.raises(ValueError, match="2 real tokens"):
            model(torch.tensor([[5, 0, 0]]), attention_mask=torch.tensor([[1, 0, 0]]))
    model.eval()  # eval uses running statistics: a single token is fine
    assert torch.isfinite(model(torch.tensor([[5]])).logits).all()


@pytest.mark.parametrize("norm", NORM_TYPES)
def test_batch_statistics_norms_are_the_layers_with_running_statistics(norm):
    """The one answer to "which norms use batch statistics?": the model's method lists by name exactly the modules
    that keep running statistics (every norm of the model, for the BN family; none otherwise), and the config,
    before any model exists, says the same."""
    model = NormLabForMaskedLM(tiny_config(norm=norm, norm_placement="pre"))
    with_stats = {name for name, m in model.named_modules()
                  if any(b.startswith("running_") for b, _ in m.named_buffers(recurse=False))}
    norms = [f"normlab.encoder.layers.{i}.{n}" for i in range(2) for n in ("attn_norm", "ffn_norm")]
    expected = {*norms, "normlab.encoder.final_norm", "lm_head.norm"} if with_stats else set()
    listed = model.batch_statistics_norms()
    assert set(listed) == with_stats == expected
    assert all(listed[name] is model.get_submodule(name) for name in listed)
    assert model.config.uses_batch_statistics == bool(listed) == (norm in BATCH_STAT_NORMS)


@pytest.mark.parametrize("norm", NORM_TYPES)
def test_only_the_batch_statistics_norms_change_between_train_and_eval(norm):
    """The third classic reason for LN over BN: with dropout off, `train()` and `eval()` give the same outputs for
    every norm without running statistics, and different ones for the BN family (batch statistics in training,
    running statistics in eval). Checked on the real tokens of a padded batch, so padding cannot be the cause."""
    torch.manual_seed(0)
    model = NormLabModel(tiny_config(norm=norm, norm_placement="pre", powernorm_warmup_steps=1))
    input_ids, attention_mask = padded_batch()
    real = attention_mask.bool()
    with torch.no_grad():
        trained = model.train()(input_ids, attention_mask=attention_mask).last_hidden_state[real]
        evaluated = model.eval()(input_ids, attention_mask=attention_mask).last_hidden_state[real]
    same = torch.allclose(trained, evaluated, rtol=1e-5, atol=1e-6)
    assert same == (norm not in BATCH_STAT_NORMS), (norm, (trained - evaluated).abs().max())


def test_taps_name_each_blocks_attention_logits_and_output():
    model = NormLabForSequenceClassification(tiny_config(qk_norm=True))
    taps = model.taps()
    assert list(taps) == [f"layers.{i}{what}" for i in range(2) for what in ("", ".attention_logits", ".output")]
    for i, block in enumerate(model.normlab.encoder.layers):
        assert taps[f"layers.{i}"] is block
        assert isinstance(taps[f"layers.{i}.attention_logits"], AttentionLogitsTap)
        assert taps[f"layers.{i}.attention_logits"].scale == block.attention.scale
        assert isinstance(taps[f"layers.{i}.output"], Tap)
    assert not any(True for _ in taps["layers.0.output"].parameters())  # taps add no weights: no new state keys


def test_too_long_input_raises():
    model = NormLabModel(tiny_config(max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 9, dtype=torch.long))
