"""What the classifier reads: the pooled vector's batch centring or standardization (`model.pooled_norm`) and a fixed
gain (`model.pooled_gain`), against torch's BatchNorm1d; `center_pooled` keeps meaning what it meant."""

import copy
import json

import pytest
import torch
from torch import nn

from model import NormLabForSequenceClassification
from model.norms import BatchStandardization
from tiny_model import padded_batch, width16_config
from train_utils import run_here

D = 16


def tiny_config(**overrides):
    return width16_config(**{"norm": "layernorm", "norm_placement": "pre", **overrides})


def classifier_input(model, ids, mask):
    """(pooled vector as pooled, what the classifier's linear layer reads), in the model's current mode."""
    seen = {}
    hooks = [model.classifier.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0].detach())),
             model.normlab.register_forward_hook(lambda mod, args, out: seen.update(h=out.last_hidden_state.detach()))]
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    return seen["h"][:, 0], seen["x"]


def test_standardization_matches_batchnorm1d_without_affine_in_training_and_eval():
    """Outputs, input gradients and running statistics over 3 training batches, then eval, equal torch's
    BatchNorm1d(affine=False) with the same eps and momentum."""
    torch.manual_seed(0)
    ours, ref = BatchStandardization(D, eps=1e-5, momentum=0.1), nn.BatchNorm1d(D, eps=1e-5, momentum=0.1, affine=False)
    assert not list(ours.parameters())  # parameter-free
    for step in range(3):
        x = (torch.randn(6, D) * (step + 1) + 3).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        y, y_ref = ours.train()(x), ref.train()(x_ref)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        (y * torch.arange(D)).sum().backward(), (y_ref * torch.arange(D)).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    x = torch.randn(5, D) + 1
    torch.testing.assert_close(ours.eval()(x), ref.eval()(x), atol=1e-6, rtol=1e-5)


def test_ghost_groups_standardize_each_group_as_batchnorm1d_run_on_it_alone():
    """group_size=2 on 4 sentences: each pair standardized by its own statistics; the running statistics move
    towards the mean of what two BatchNorm1d copies, one per group, would move them to."""
    torch.manual_seed(0)
    ours = BatchStandardization(D, group_size=2).train()
    x = torch.randn(4, D) * torch.tensor([1.0, 1.0, 5.0, 5.0])[:, None]
    y = ours(x)
    refs = [nn.BatchNorm1d(D, affine=False).train() for _ in range(2)]
    for rows, ref in zip(([0, 1], [2, 3]), refs):
        torch.testing.assert_close(y[rows], ref(x[rows]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.running_var, (refs[0].running_var + refs[1].running_var) / 2)
    torch.testing.assert_close(ours.running_mean, (refs[0].running_mean + refs[1].running_mean) / 2)


def test_the_classifier_reads_the_standardized_pooled_vector_in_training_and_eval():
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(pooled_norm="standardize"))
    assert model.config.uses_batch_statistics and list(model.batch_statistics_norms()) == ["standardize"]
    assert not any(n.startswith("standardize") for n, _ in model.named_parameters())
    ref = nn.BatchNorm1d(D, affine=False, eps=model.config.norm_eps, momentum=model.config.bn_momentum)
    ids, mask = padded_batch((7, 4, 2, 5))
    pooled, x = classifier_input(model.train(), ids, mask)
    torch.testing.assert_close(x, ref.train()(pooled), atol=1e-5, rtol=1e-5)
    pooled, x = classifier_input(model.eval(), ids, mask)
    torch.testing.assert_close(x, ref.eval()(pooled), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooled_norm", [None, "center", "standardize"])
def test_the_gain_scales_what_the_classifier_reads_exactly(pooled_norm):
    """pooled_gain=c: the classifier's input is exactly c times the gain-1 model's, in training and in eval."""
    torch.manual_seed(0)
    plain = NormLabForSequenceClassification(tiny_config(pooled_norm=pooled_norm))
    gained = NormLabForSequenceClassification(tiny_config(pooled_norm=pooled_norm, pooled_gain=7.5))
    gained.load_state_dict(plain.state_dict())
    ids, mask = padded_batch((7, 4, 2, 5))
    for mode in (True, False):
        (_, a), (_, b) = classifier_input(plain.train(mode), ids, mask), classifier_input(gained.train(mode), ids, mask)
        assert torch.equal(b, a * 7.5), mode


def test_center_pooled_is_pooled_norm_center_and_old_checkpoints_load(tmp_path):
    """The first spelling builds the same module under the same name, so a saved model of either spelling loads
    into the other with its running mean; the two spellings cannot contradict each other."""
    old, new = tiny_config(center_pooled=True), tiny_config(pooled_norm="center")
    assert (old.pooled_norm, new.center_pooled, old.pooled_gain) == ("center", True, 1.0)
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(old).train()
    model(*padded_batch((7, 4, 2)))  # moves the running mean off zero
    assert list(model.batch_statistics_norms()) == ["center"]
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["center_pooled"], saved["pooled_norm"]) == (True, "center")
    loaded = NormLabForSequenceClassification.from_pretrained(tmp_path)
    assert torch.equal(loaded.center.running_mean, model.center.running_mean)
    assert model.center.running_mean.abs().max() > 0
    with pytest.raises(ValueError, match=r"center_pooled=True means pooled_norm='center', which contradicts"):
        tiny_config(center_pooled=True, pooled_norm="standardize")
    with pytest.raises(ValueError, match=r"pooled_norm='scale' is not valid; choose one of: center, standardize"):
        tiny_config(pooled_norm="scale")
    with pytest.raises(ValueError, match=r"pooled_gain=0 must be a finite number > 0"):
        tiny_config(pooled_gain=0)


@pytest.mark.parametrize("pooled_norm", ["center", "standardize"])
def test_eval_logits_of_a_sentence_do_not_depend_on_its_batch_or_its_padding(pooled_norm):
    """In eval the running statistics are used: a sentence's logits are the same alone, with more padding, or
    beside other sentences. In training they depend on the batch (the test can fail)."""
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(pooled_norm=pooled_norm, pooled_gain=3.0))
    ids, mask = padded_batch((7, 4, 2, 5))
    model.train()(ids, attention_mask=mask)  # running statistics off their start
    alone_ids, alone_mask = torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long)
    alone_ids[0, :4], alone_mask[0, :4] = ids[1, :4], 1  # sentence 1 alone, 5 more pad positions
    with torch.no_grad():
        m = copy.deepcopy(model).eval()
        in_batch = m(ids, attention_mask=mask).logits[1]
        torch.testing.assert_close(m(alone_ids, attention_mask=alone_mask).logits[0], in_batch)
        # training: a batch of two copies of the sentence is centred (standardized) to zero, unlike the first batch
        twice = copy.deepcopy(model).train()(torch.cat([alone_ids] * 2), attention_mask=torch.cat([alone_mask] * 2))
        torch.testing.assert_close(twice.logits[0], model.classifier.bias.detach())
        assert not torch.allclose(copy.deepcopy(model).train()(ids, attention_mask=mask).logits[1], twice.logits[0])


@pytest.mark.slow  # one tiny training run
def test_a_tiny_run_trains_with_a_standardized_gained_pooled_vector(tmp_path):
    """End to end through train.py, with ghost groups: it completes, logs the pooled norm's drift and the
    batch-statistics and precise-BN accuracies, and its final/ reloads with the same running statistics."""
    out = tmp_path / "run"
    assert run_here(out, "model.pooled_norm=standardize", "model.pooled_gain=4", "model.bn_group_size=8",
                    "train.max_steps=6", "train.eval_steps=3", "train.save_steps=100",
                    "train.precise_bn_batches=2") == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all("eval/accuracy_batch_stats" in r and "eval/accuracy_precise_bn" in r for r in evals)
    final = NormLabForSequenceClassification.from_pretrained(out / "final")
    assert (final.config.pooled_norm, final.config.pooled_gain, final.config.bn_group_size) == ("standardize", 4.0, 8)
    assert final.standardize.num_batches_tracked == 6 and final.standardize.running_var.ne(1).all()
