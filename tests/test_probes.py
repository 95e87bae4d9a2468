"""StabilityProbe (normlab/train/probes.py) against the same quantities computed directly from the model."""

import pytest
import torch

from model import NormLabConfig, NormLabForSequenceClassification
from normlab.train.probes import StabilityProbe, clip_coefficient

VOCAB = 50


def _model(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)
    kw.update(overrides)
    torch.manual_seed(0)
    return NormLabForSequenceClassification(NormLabConfig(**kw))


def _batch():
    lengths = torch.tensor([9, 5, 2, 7])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()  # (4, 9), right-padded
    ids = torch.randint(1, VOCAB, mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1, 0])}


@pytest.mark.parametrize("norm,unpad", [("layernorm", True), ("layernorm", False), ("batchnorm", True)],
                         ids=["packed", "padded_layout", "naive_bn_padded"])
def test_probe_matches_hidden_states_weights_and_grads(norm, unpad):
    model = _model(norm=norm)
    model.normlab.unpad = unpad
    model.train()
    batch = _batch()
    real = batch["attention_mask"].bool()
    probe = StabilityProbe(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    probe.arm()
    last = {}  # the last block's output: hidden_states[-1] is after the final norm (last_hidden_state)
    model.normlab.encoder.layers[-1].register_forward_hook(lambda mod, args, o: last.update(x=o[0].detach()))
    out = model(**batch, output_hidden_states=True)  # hidden states only for the reference below
    probe.read_forward(batch["attention_mask"])
    # act_rms = sqrt(act_sumsq / act_count): the residual stream after each block, over real tokens only
    last_rows = last["x"][0] if last["x"].shape[:2] != real.shape else last["x"][real]  # packed (1, T, D) or (B, L, D)
    expected = torch.stack([h[real].square().sum() for h in out.hidden_states[1:-1]] + [last_rows.square().sum()])
    torch.testing.assert_close(probe.act_sumsq, expected, rtol=1e-5, atol=0)
    assert probe.act_count.item() == real.sum().item() * 32
    recorded = [*probe.recorder.sumsq, *probe.recorder.logit_max]
    assert not probe.recorder.armed  # disarmed: the next forward records nothing
    model(**batch)
    assert all(a is b for a, b in zip([*probe.recorder.sumsq, *probe.recorder.logit_max], recorded, strict=True))

    out.loss.backward()
    blocks = [[p for n, p in model.named_parameters() if f"encoder.layers.{i}." in n] for i in range(3)]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    coef = clip_coefficient(grad_norm.item(), 0.5)
    assert coef < 1.0  # clipping happened: the probe must undo it
    probe.read_grads(coef)
    expected_grads = torch.stack([torch.cat([p.grad.reshape(-1) for p in b]).norm() / coef for b in blocks])
    torch.testing.assert_close(probe.grad_norm, expected_grads, rtol=1e-5, atol=0)

    for _ in range(2):  # a second logged step reuses the snapshot buffer
        before = [torch.cat([p.detach().reshape(-1) for p in b]).clone() for b in blocks]
        probe.snapshot()
        optimizer.step()
        probe.read_update()
        after = [torch.cat([p.detach().reshape(-1) for p in b]) for b in blocks]
        expected_update = torch.stack([(a - b).norm() / b.norm() for a, b in zip(after, before)])
        assert (expected_update > 0).all()
        torch.testing.assert_close(probe.update_ratio, expected_update, rtol=1e-4, atol=0)


class _TwoProcesses:
    """accelerator.gather as on two processes: this process's values, then `other`'s (same keys and shapes)."""

    num_processes = 2

    def __init__(self, other: dict):
        self.other = other

    def gather(self, tensors: dict) -> dict:
        return {k: torch.cat([v, self.other[k].unsqueeze(0)]) for k, v in tensors.items()}


def test_collect_combines_each_quantity_over_processes_by_its_own_rule():
    """A logged step through the probe's context managers, then `collect` with a second process whose values are
    known: token counts and activation sums add up, the loss and BN drift average, logit maxima take the max."""
    model = _model(norm="batchnorm")
    model.train()
    batch = _batch()
    probe = StabilityProbe(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with probe.forward(batch["attention_mask"]):
        out = model(**batch)
    probe.count(out.loss, batch["attention_mask"])
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    with probe.update(grad_norm, 1.0):
        optimizer.step()
    mine = probe._local_values(measured=True)
    other = {k: v * 3 for k, v in mine.items()}  # the other process saw three times everything
    other["logit_max"] = mine["logit_max"] - torch.tensor([1.0, -1.0, 1.0])  # and larger logits in block 1

    row = probe.collect(_TwoProcesses(other), grad_norm, lr=0.01)
    real, slots = int(batch["attention_mask"].sum()), batch["attention_mask"].numel()
    assert row["train/loss"] == pytest.approx(2 * out.loss.item())  # mean of loss and 3 x loss
    assert row["train/pad_fraction"] == pytest.approx(1 - 4 * real / (4 * slots))
    assert row["train/grad_norm"] == grad_norm and row["train/lr"] == 0.01
    for i in range(3):
        act_rms = torch.sqrt(4 * mine["act_sumsq"][i] / (4 * mine["act_count"])).item()
        assert row[f"layers/{i}/act_rms"] == pytest.approx(act_rms, rel=1e-6)
        assert row[f"layers/{i}/attn_logit_max"] == pytest.approx(mine["logit_max"][i].item() + (i == 1))
        assert row[f"bn/{i}/stat_drift"] == pytest.approx(2 * mine["stat_drift"][i].item(), rel=1e-6)
        assert row[f"layers/{i}/grad_norm"] == pytest.approx(probe.grad_norm[i].item())
        assert row[f"layers/{i}/update_ratio"] == pytest.approx(probe.update_ratio[i].item())
        assert row[f"layers/{i}/update_ratio"] > 0
    assert probe.counters.loss_count == 0  # collect restarts the counters for the next logging interval


def test_probe_hooks_are_traced_by_torch_compile():
    """torch.compile traces the hooks present at its first call (it does not see hooks added later): the probe,
    built before the first forward as train.py builds it, measures the compiled model as it does the eager one,
    on every logged step, and records nothing while disarmed."""
    batch = _batch()
    measured = {}
    for compiled in (False, True):
        model = _model()
        model.normlab.unpad = False  # the layout torch.compile runs in
        if compiled:
            model.compile(backend="eager", dynamic=True)
        probe = StabilityProbe(model)
        for _ in range(2):  # armed, then disarmed and armed again: each state its own graph
            probe.arm()
            model(**batch)
            probe.read_forward(batch["attention_mask"])
            recorded = [*probe.recorder.sumsq, *probe.recorder.logit_max]
            model(**batch)
            assert all(a is b for a, b in zip([*probe.recorder.sumsq, *probe.recorder.logit_max], recorded))
        measured[compiled] = (probe.act_sumsq, probe.logit_max)
    assert torch.isfinite(measured[True][1]).all()
    torch.testing.assert_close(measured[True], measured[False], rtol=1e-6, atol=0)
