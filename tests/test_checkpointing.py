"""Gradient checkpointing with the BatchNorm family: a checkpointed block is run again in the backward pass, and
that rerun must normalize as the first run did and update no running statistics. Several training steps with and
without checkpointing (transformers' non-reentrant default and the reentrant variant) give the same losses,
gradients, running statistics and eval outputs, on one process and under accelerate's 2-process CPU run."""

import copy
import json
import sys

import pytest
import torch

from model import NormLabConfig, NormLabForSequenceClassification
from model.norms import BATCH_STAT_NORMS
from train_utils import REPO, free_port, run_cmd

STEPS = 4
LABELS = torch.tensor([0, 1, 2])


def tiny_config(norm):
    # PowerNorm: steps 1-2 normalize with the batch's psi^2, steps 3-4 with the running one
    return NormLabConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32, num_labels=3, norm=norm,
                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, powernorm_warmup_steps=2)


def padded_batch(lengths=(7, 4, 2), seed=0):
    """Right-padded input_ids (3, 7) and attention_mask of 1 (real) / 0 (pad)."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(1, 60, (3, 7), generator=g) * attention_mask, attention_mask


def train_steps(model, checkpointing):
    """STEPS SGD steps on different padded batches; returns each step's loss and gradients."""
    if checkpointing is not None:
        model.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        input_ids, attention_mask = padded_batch(lengths=(7, 4, 2 + step), seed=step)
        torch.manual_seed(100 + step)  # the same dropout masks (the recomputation replays the RNG state too)
        loss = model.train()(input_ids, attention_mask=attention_mask, labels=LABELS).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def eval_outputs(model):
    """Eval mode: logits from the running statistics, and a backward through them (not checkpointed in eval)."""
    input_ids, attention_mask = padded_batch(lengths=(6, 3, 5), seed=99)
    out = model.eval()(input_ids, attention_mask=attention_mask, labels=torch.tensor([2, 0, 1]))
    out.loss.backward()
    return out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("norm", BATCH_STAT_NORMS)
def test_checkpointed_steps_equal_plain_steps(norm, checkpointing):
    torch.manual_seed(0)
    base = NormLabForSequenceClassification(tiny_config(norm))
    plain, checkpointed = copy.deepcopy(base), copy.deepcopy(base)
    plain_losses, plain_grads = train_steps(plain, None)
    ckpt_losses, ckpt_grads = train_steps(checkpointed, checkpointing)
    assert all(layer.gradient_checkpointing for layer in checkpointed.normlab.encoder.layers)
    assert ckpt_losses == plain_losses
    for step, (a, b) in enumerate(zip(plain_grads, ckpt_grads)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=lambda m: f"step {step} {name}: {m}")
    state, ckpt_state = plain.state_dict(), checkpointed.state_dict()
    assert int(state["normlab.encoder.layers.0.attn_norm.num_batches_tracked"]) == STEPS  # once per step, not twice
    for name, value in state.items():  # running statistics (PowerNorm's ema_gz too), step counters, weights
        torch.testing.assert_close(ckpt_state[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    (logits, grads), (ckpt_logits, ckpt_eval_grads) = eval_outputs(plain), eval_outputs(checkpointed)
    assert torch.equal(ckpt_logits, logits)
    for name in grads:
        assert torch.equal(ckpt_eval_grads[name], grads[name]), name


def test_powernorm_recomputes_only_its_latest_forward():
    """A second training forward before the first one's backward (here one whose output is dropped): the running
    psi^2 the first one normalized with is gone, so its recomputation is refused rather than run with another
    step's statistics. Without checkpointing the same sequence trains."""
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config("powernorm")).train()
    plain = copy.deepcopy(model)
    model.activation_checkpointing_enable()
    for m in (plain, model):
        loss = m(*padded_batch(seed=0), labels=LABELS).loss
        m(*padded_batch(seed=1))  # e.g. a probe on another batch, in training mode
        if m is plain:
            loss.backward()
    with pytest.raises(RuntimeError, match="latest training forward"):
        loss.backward()


@pytest.mark.slow  # two accelerate processes, launched for real
def test_two_processes_keep_checkpointed_statistics_in_sync(tmp_path):
    """DDP via accelerate (2 CPU processes, no buffer broadcast): on each process the checkpointed steps equal the
    plain ones, and the synced running statistics are the same on both processes."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "configs/accelerate/cpu_2proc.yaml"), "--main_process_port", str(free_port()),
           str(REPO / "tests/checkpointing_2proc.py"), str(tmp_path)]
    result = run_cmd(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for norm in ("masked_batchnorm", "powernorm"):
        for rank in ranks:
            assert rank[norm]["loss_diff"] == rank[norm]["grad_diff"] == rank[norm]["state_diff"] == 0.0, norm
        running = ranks[0][norm]["running"]
        assert running == ranks[1][norm]["running"], norm
        steps = [v for k, v in running.items() if k.endswith("num_batches_tracked")]
        assert steps == [3] * 5, norm  # 2 blocks x 2 norms + the final norm (pre-LN), one count per step
