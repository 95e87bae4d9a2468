"""Ghost batches (`config.bn_group_size`): the batch-statistics norms take their statistics per group of g
consecutive sentences of the batch. Checked against torch.nn.BatchNorm1d run on each group (outputs, gradients,
running statistics), against each group run alone (PowerNorm, the pooled-vector centring, the whole model on each
CPU kernel backend), for padding, under gradient checkpointing, and g >= the batch against the whole-batch path,
bit for bit."""

import copy

import pytest
import torch
import torch.nn as nn

import normlab.kernels
from model import NormLabConfig, NormLabForSequenceClassification
from model.norms import BATCH_STAT_NORMS, BatchCentering, build_norm, ghost_groups, sentence_groups
from tiny_model import padded_batch, width16_config

D = 8
LENGTHS = (6, 3, 5, 2, 4)  # five sentences; at g = 2 the groups are [0, 1] and [2, 3, 4]
GROUPS = [[0, 1], [2, 3, 4]]  # the last run of one sentence joins the group before it


def _batch(seed, lengths=LENGTHS, extra_pad=0):
    """x (B, L, D) with loud garbage at pad positions, mask (B, L) bool; the same real tokens for any extra_pad."""
    g = torch.Generator().manual_seed(seed)
    b, length = len(lengths), max(lengths) + extra_pad
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    real = 1.5 * torch.randn(b, max(lengths), D, generator=g) + 0.3
    x = torch.cat([real, torch.zeros(b, extra_pad, D)], dim=1)
    return torch.where(mask[..., None], x, 50 * torch.randn(b, length, D) + 20), mask


def _norm(name, group_size, **kw):
    if name == "batch_centering":
        return BatchCentering(D, momentum=0.2, group_size=group_size)
    config = NormLabConfig(norm=name, hidden_size=D, num_attention_heads=2, bn_group_size=group_size,
                           bn_momentum=0.2, **kw)
    return build_norm(config)


def _randomize(norm):
    """Non-trivial affine parameters and running statistics, so that their use is really tested."""
    with torch.no_grad():
        for name, t in [*norm.named_parameters(), *norm.named_buffers()]:
            if name in ("weight", "running_var", "running_psi2"):
                t.uniform_(0.5, 2.0)
            elif name in ("bias", "running_mean"):
                t.normal_(0.0, 0.5)


def test_groups_are_consecutive_sentences_and_a_short_last_run_joins_the_previous_group():
    assert sentence_groups(5, 2).tolist() == [0, 0, 1, 1, 1]
    assert sentence_groups(6, 2).tolist() == [0, 0, 1, 1, 2, 2]
    assert sentence_groups(32, 8).bincount().tolist() == [8, 8, 8, 8]
    assert sentence_groups(3, 4).tolist() == [0, 0, 0]  # fewer sentences than g: one group, the whole batch
    assert [ghost_groups(5, 2), ghost_groups(3, 4), ghost_groups(32, None)] == [2, 1, 1]


@pytest.mark.parametrize("name", ["masked_batchnorm", "batchnorm"])
def test_grouped_batchnorm_equals_batchnorm1d_on_each_group(name):
    """Each group normalized as BatchNorm1d normalizes that group alone (masked: its real tokens; naive: every
    position of its sentences); running statistics = the mean of BatchNorm1d's updates, one per group, from the
    same start; gradients equal too."""
    torch.manual_seed(0)
    ours = _norm(name, group_size=2).train()
    _randomize(ours)
    for step in range(3):
        x, mask = _batch(step)
        counted = mask if name == "masked_batchnorm" else torch.ones_like(mask)
        c = torch.randn(x.shape)  # loss weights
        start = copy.deepcopy(ours)
        ours.zero_grad()
        xg = x.clone().requires_grad_(True)
        y = ours(xg, mask)
        (y * c * counted[..., None]).sum().backward()
        refs = []
        for rows in GROUPS:
            ref = nn.BatchNorm1d(D, eps=ours.eps, momentum=0.2)
            ref.load_state_dict(start.state_dict())
            xr = x[rows][counted[rows]].clone().requires_grad_(True)  # (tokens of the group, D)
            y_ref = ref(xr)
            (y_ref * c[rows][counted[rows]]).sum().backward()
            torch.testing.assert_close(y[rows][counted[rows]], y_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(xg.grad[rows][counted[rows]], xr.grad, atol=1e-5, rtol=1e-5)
            refs.append(ref)
        for buffer in ("running_mean", "running_var"):
            want = torch.stack([getattr(r, buffer) for r in refs]).mean(0)
            torch.testing.assert_close(getattr(ours, buffer), want, atol=1e-6, rtol=1e-5)
        for p in ("weight", "bias"):
            torch.testing.assert_close(getattr(ours, p).grad, sum(getattr(r, p).grad for r in refs), atol=1e-4,
                                       rtol=1e-5)
    assert int(ours.num_batches_tracked) == 3  # one update per forward, not one per group
    ours.eval()
    x, mask = _batch(9)
    with torch.no_grad():  # eval: the running statistics, whatever the groups
        want = (x - ours.running_mean) * torch.rsqrt(ours.running_var + ours.eps) * ours.weight + ours.bias
        torch.testing.assert_close(ours(x, mask), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["powernorm", "batch_centering"])
def test_grouped_norm_equals_the_norm_run_on_each_group_alone(name):
    """PowerNorm (warmup: the groups' psi^2; after it, the running one) and the pooled-vector centring: each group's
    outputs and gradients are those of the whole-batch norm given that group alone; the running statistics are
    the mean of those runs' (PowerNorm's gradient statistic: their token-weighted mean, a mean over the batch)."""
    torch.manual_seed(0)
    ours = _norm(name, group_size=2, powernorm_warmup_steps=2) if name == "powernorm" else _norm(name, 2)
    _randomize(ours)
    ours.train()
    for step in range(3):
        x, mask = _batch(step)
        if name == "batch_centering":  # pooled vectors (B, D): one row per sentence
            x, mask = x[:, 0], torch.ones(x.shape[0], dtype=torch.bool)
        c = torch.randn(x.shape)
        alone = copy.deepcopy(ours)
        alone.group_size = None
        ours.zero_grad()
        xg = x.clone().requires_grad_(True)
        y = ours(xg, mask)
        (y * c).sum().backward()
        runs = []
        for rows in GROUPS:
            run = copy.deepcopy(alone)
            xr = x[rows].clone().requires_grad_(True)
            y_r = run(xr, mask[rows])
            (y_r * c[rows]).sum().backward()
            real = mask[rows]
            torch.testing.assert_close(y[rows][real], y_r[real], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(xg.grad[rows][real], xr.grad[real], atol=1e-5, rtol=1e-5)
            assert int(run.num_batches_tracked) == int(ours.num_batches_tracked) == step + 1
            runs.append(run)
        stat = "running_psi2" if name == "powernorm" else "running_mean"
        want = torch.stack([getattr(r, stat) for r in runs]).mean(0)
        torch.testing.assert_close(getattr(ours, stat), want, atol=1e-6, rtol=1e-5)
        if name == "powernorm":
            tokens = torch.stack([mask[rows].sum() for rows in GROUPS]).float()
            want_gz = (torch.stack([r.ema_gz for r in runs]) * tokens[:, None]).sum(0) / tokens.sum()
            torch.testing.assert_close(ours.ema_gz, want_gz, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["masked_batchnorm", "powernorm"])
def test_grouped_statistics_ignore_padding(name):
    """Masked BN and PowerNorm count real tokens only in each group: more padding changes no real output, no
    gradient and no running statistic (3 steps: PowerNorm's warmup and after)."""
    torch.manual_seed(0)
    short = _norm(name, group_size=2, powernorm_warmup_steps=2).train()
    padded = copy.deepcopy(short)
    for step in range(3):
        x, mask = _batch(step)
        xp, maskp = _batch(step, extra_pad=4)
        c = torch.randn(x.shape)
        outs = []
        for norm, xi, mi in ((short, x, mask), (padded, xp, maskp)):
            xi = xi.clone().requires_grad_(True)
            y = norm(xi, mi)[:, : x.shape[1]]
            (y * c * mask[..., None]).sum().backward()
            outs.append((y[mask].detach(), xi.grad[:, : x.shape[1]][mask]))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for (n, a), (_, b) in zip(short.named_buffers(), padded.named_buffers()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=lambda m: f"buffer {n}: {m}")


def test_a_group_needs_two_real_tokens():
    norm = _norm("masked_batchnorm", group_size=1).train()
    x, mask = _batch(0, lengths=(3, 1))
    with pytest.raises(ValueError, match="at least 2 real tokens per group of 1 sentences"):
        norm(x, mask)


def test_bad_group_size_is_a_one_line_error():
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"^NormLabConfig.bn_group_size={bad} must be a positive integer "
                                             r"\(sentences per group, or None for the whole batch\)$"):
            NormLabConfig(bn_group_size=bad)


# ---------------------------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------------------------

def tiny_config(**overrides):
    return width16_config(**{"norm": "masked_batchnorm", "powernorm_warmup_steps": 1, **overrides})


def test_a_sentence_depends_only_on_its_own_group():
    """Training mode, g = 2: the logits of group 0 do not change when group 1's sentences do, even when they are
    longer and add padding to group 0's rows. The whole-batch model (g = None) does change: the test can fail."""
    torch.manual_seed(0)
    model = NormLabForSequenceClassification(tiny_config(bn_group_size=2, center_pooled=True)).train()
    whole = NormLabForSequenceClassification(tiny_config(center_pooled=True)).train()
    whole.load_state_dict(model.state_dict())
    ids, mask = padded_batch((5, 3, 4, 2), seed=0)
    other_ids, other_mask = padded_batch((5, 3, 9, 7), seed=1)
    other_ids[:2], other_mask[:2] = 0, 0
    other_ids[:2, :5], other_mask[:2, :5] = ids[:2], mask[:2]  # the same group 0, with more padding
    with torch.no_grad():
        for m, changes in ((model, False), (whole, True)):
            a = copy.deepcopy(m)(ids, attention_mask=mask).logits[:2]
            b = copy.deepcopy(m)(other_ids, attention_mask=other_mask).logits[:2]
            assert (not torch.allclose(a, b, atol=1e-4)) == changes


@pytest.mark.parametrize("norm", ["masked_batchnorm", "powernorm", "batchnorm"])
def test_ghost_model_equals_each_group_run_alone(norm, backend):
    """On each CPU backend (the reference and the C++ kernels, which the model's padded layout runs through): a
    training step of the g = 2 model on 4 sentences gives each group's logits, the mean of the gradients and the
    mean of the running statistics of the whole-batch model run on each group alone. Every batch-statistics
    module takes part: the blocks', the final norm, the pooled-vector centring."""
    mode = "auto" if backend == "cpp" else "reference"
    torch.manual_seed(0)
    ghost = NormLabForSequenceClassification(tiny_config(norm=norm, bn_group_size=2, center_pooled=True))
    alone = NormLabForSequenceClassification(tiny_config(norm=norm, center_pooled=True))
    alone.load_state_dict(ghost.state_dict())
    normlab.kernels.use(ghost, mode, "cpu"), normlab.kernels.use(alone, mode, "cpu")
    lengths = (5, 3, 5, 2) if norm == "batchnorm" else (5, 3, 4, 2)  # naive BN: both groups as wide as the batch
    ids, mask = padded_batch(lengths)
    labels = torch.tensor([0, 1, 1, 0])
    out = ghost.train()(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    runs = []
    for rows in ([0, 1], [2, 3]):
        run = copy.deepcopy(alone).train()
        width = int(mask[rows].sum(1).max())  # the group's own padded width, as a batch of it alone would have
        o = run(ids[rows, :width], attention_mask=mask[rows, :width], labels=labels[rows])
        o.loss.backward()
        torch.testing.assert_close(out.logits[rows], o.logits, atol=1e-5, rtol=1e-5)
        runs.append(run)
    for name, p in ghost.named_parameters():
        want = sum(dict(r.named_parameters())[name].grad for r in runs) / 2  # the loss: a mean over sentences
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for name, b in ghost.named_buffers():
        if b.is_floating_point() and "running" in name:
            want = sum(dict(r.named_buffers())[name] for r in runs) / 2
            torch.testing.assert_close(b, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _train(model, steps, batches, checkpointing=None):
    if checkpointing is not None:
        model.activation_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        ids, mask = batches[step]
        torch.manual_seed(100 + step)  # the same dropout masks
        loss = model.train()(ids, attention_mask=mask, labels=torch.tensor([0, 1, 1, 0])).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


BATCHES = [padded_batch((5, 3, 4, 2), seed=0), padded_batch((4, 6, 2, 3), seed=1), padded_batch((2, 2, 7, 3), 2)]


@pytest.mark.parametrize("norm", BATCH_STAT_NORMS)
def test_group_size_of_the_whole_batch_is_todays_behaviour_bit_for_bit(norm):
    """g = the batch size (4) gives one group: the same losses, gradients, state and eval logits as g = None."""
    torch.manual_seed(0)
    kw = dict(norm=norm, center_pooled=True, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    today = NormLabForSequenceClassification(tiny_config(**kw))
    ghost = NormLabForSequenceClassification(tiny_config(bn_group_size=4, **kw))
    ghost.load_state_dict(today.state_dict())
    (a_losses, a_grads), (b_losses, b_grads) = _train(today, 3, BATCHES), _train(ghost, 3, BATCHES)
    assert a_losses == b_losses
    for a, b in zip(a_grads, b_grads):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    for name, value in today.state_dict().items():
        assert torch.equal(ghost.state_dict()[name], value), name
    ids, mask = BATCHES[0]
    with torch.no_grad():
        assert torch.equal(ghost.eval()(ids, attention_mask=mask).logits, today.eval()(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("norm", ["masked_batchnorm", "powernorm"])
def test_ghost_batches_under_gradient_checkpointing(norm, checkpointing):
    """g = 2 on 4 sentences, with dropout: checkpointed steps (the blocks rerun in backward) give the same losses,
    gradients and state as plain ones, bit for bit (PowerNorm: step 1 in warmup, then its running psi^2)."""
    torch.manual_seed(0)
    kw = dict(norm=norm, bn_group_size=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    plain = NormLabForSequenceClassification(tiny_config(**kw))
    checkpointed = copy.deepcopy(plain)
    (a_losses, a_grads), (b_losses, b_grads) = _train(plain, 3, BATCHES), _train(checkpointed, 3, BATCHES,
                                                                                   checkpointing)
    assert all(layer.gradient_checkpointing for layer in checkpointed.normlab.encoder.layers)
    assert a_losses == b_losses
    for a, b in zip(a_grads, b_grads):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    state = plain.state_dict()
    assert int(state["normlab.encoder.layers.0.attn_norm.num_batches_tracked"]) == 3  # once per step, not twice
    for name, value in state.items():
        assert torch.equal(checkpointed.state_dict()[name], value), name


# ---------------------------------------------------------------------------------------------------------------
# Two processes (CPU, gloo): a group lives in one process's batch
# ---------------------------------------------------------------------------------------------------------------


def _two_process_worker(rank, world_size, init_file):
    torch.set_num_threads(1)  # forked from a process whose thread pool may be initialized
    torch.manual_seed(0)
    x, mask = _batch(0, lengths=(6, 3, 5, 2, 4, 6, 2, 3))  # the global batch: 4 sentences per process
    c = torch.randn(x.shape)
    # g = 2: two groups per process; g = 4: one per process, which must not be synced into one of 8 sentences
    cases = [(name, g) for name in ("masked_batchnorm", "powernorm") for g in (2, 4)]
    single = {}
    for name, g in cases:  # one process on the global batch, before the process group exists
        ref = _norm(name, group_size=g, powernorm_warmup_steps=1).train()
        _randomize(ref)
        norm = copy.deepcopy(ref)
        for _ in range(2):  # PowerNorm: step 2 after warmup
            xg = x.clone().requires_grad_(True)
            y = ref(xg, mask)
            (y * c).sum().backward()
        single[name, g] = (norm, y.detach(), xg.grad, ref)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        rows = slice(4 * rank, 4 * rank + 4)
        for (name, g), (norm, y_single, dx_single, ref) in single.items():
            for _ in range(2):
                xg = x[rows].clone().requires_grad_(True)
                y = norm(xg, mask[rows])
                (y * c[rows]).sum().backward()
            real = mask[rows]
            torch.testing.assert_close(y.detach()[real], y_single[rows][real], atol=1e-5, rtol=1e-5)
            for buffer in ("running_mean", "running_var", "running_psi2"):  # the mean over every process's groups
                if hasattr(ref, buffer):
                    torch.testing.assert_close(getattr(norm, buffer), getattr(ref, buffer), atol=1e-6, rtol=1e-5,
                                               msg=lambda m: f"{name} g={g} {buffer}: {m}")
            torch.testing.assert_close(xg.grad[real], dx_single[rows][real], atol=1e-5, rtol=1e-5)
            if name == "powernorm":  # its gradient statistic: a mean over the global batch's tokens
                torch.testing.assert_close(norm.ema_gz, ref.ema_gz, atol=1e-6, rtol=1e-5)
    finally:
        torch.distributed.destroy_process_group()


def test_groups_are_per_process_and_running_statistics_agree_across_processes(tmp_path):
    """Each process's groups are normalized alone (never all-reduced, even one group per process), and the running
    statistics move towards the mean over every process's groups: the outputs and running statistics of one
    process on the global batch."""
    torch.multiprocessing.start_processes(_two_process_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True,
                                          start_method="fork")
