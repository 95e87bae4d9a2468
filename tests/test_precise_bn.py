"""Precise BN (normlab/train/evaluation.py `precise_bn`, model/norms.py `population_statistics`): the running
statistics recomputed as the exact population statistics of N training batches, and training left as it was."""

import copy
import functools

import pytest
import torch
from torch.utils.data import DataLoader

from model import NormLabConfig, NormLabForSequenceClassification
from model.norms import real_token_mask
from normlab.data.batching import LengthGroupedBatchSampler, pad_rows
from normlab.train.evaluation import evaluate, precise_bn, precise_bn_batches
from train_utils import run_here

VOCAB = 50


def tiny_model(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=16, num_labels=2, norm="masked_batchnorm", final_norm="powernorm",
              center_pooled=True, powernorm_warmup_steps=1, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    kw.update(overrides)
    return NormLabForSequenceClassification(NormLabConfig(**kw))


def train_rows(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (k,), generator=g).tolist(), "labels": i % 2, "index": i}
            for i, k in enumerate(lengths)]


def train_loader(rows, batch_size=4):
    sampler = LengthGroupedBatchSampler([len(r["input_ids"]) for r in rows], batch_size, seed=3, mega_batch_mult=2)
    return DataLoader(rows, batch_sampler=sampler, collate_fn=functools.partial(pad_rows, pad_id=0))


def warmed_up(model, loader, steps=4):
    """A few training steps, so that the running statistics are neither their start nor the population's."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _, batch in zip(range(steps), loader):
        out = model.train()(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_the_batches_are_the_first_of_the_training_order_and_the_rng_is_untouched():
    loader = train_loader(train_rows())
    loader.batch_sampler.set_epoch(5)  # the run is elsewhere in its epochs: the batches do not follow it
    rng = torch.get_rng_state()
    got = precise_bn_batches(loader, 3)
    assert torch.equal(torch.get_rng_state(), rng) and loader.batch_sampler.epoch == 5
    loader.batch_sampler.set_epoch(0)
    want = [b for _, b in zip(range(3), loader)]
    assert len(got) == 3
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("group_size", [None, 2])
def test_recomputed_statistics_are_the_population_statistics_of_the_batches(group_size):
    """Inside precise_bn every batch-statistics module's running statistics equal the mean and the unbiased
    variance (PowerNorm: the mean square of its group-scaled input) of every row it counted over the N batches, in
    the training-mode forwards (dropout on) that collected them: computed here directly from those rows. With ghost
    groups too: the population is every token, not a group."""
    torch.manual_seed(0)
    rows = train_rows()
    model = warmed_up(tiny_model(bn_group_size=group_size), train_loader(rows))
    batches = precise_bn_batches(train_loader(rows), 5)
    norms = model.batch_statistics_norms()
    assert set(norms) == {"normlab.encoder.layers.0.attn_norm", "normlab.encoder.layers.0.ffn_norm",
                          "normlab.encoder.layers.1.attn_norm", "normlab.encoder.layers.1.ffn_norm",
                          "normlab.encoder.final_norm", "center"}
    seen = {name: [] for name in norms}

    def record(name, module, args):
        x, mask = args[0], args[1] if len(args) > 1 else None
        rows = x.reshape(-1, module.num_features)[real_token_mask(x, mask)].double()
        if module.name == "powernorm":  # its statistic is taken after the per-token group scaling
            rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + module.eps)
        seen[name].append(rows)

    hooks = [m.register_forward_pre_hook(functools.partial(record, name)) for name, m in norms.items()]
    with precise_bn(None, model, batches):
        for h in hooks:
            h.remove()
        for name, m in norms.items():
            rows = torch.cat(seen[name])  # (every counted row of the 5 batches, D)
            assert len(rows) == (sum(int(b["attention_mask"].sum()) for b in batches) if name != "center" else 20)
            if m.name == "powernorm":
                torch.testing.assert_close(m.running_psi2.double(), rows.pow(2).mean(0), rtol=1e-6, atol=1e-7)
            else:
                torch.testing.assert_close(m.running_mean.double(), rows.mean(0), rtol=1e-6, atol=1e-7)
            if hasattr(m, "running_var"):
                torch.testing.assert_close(m.running_var.double(), rows.var(0), rtol=1e-6, atol=1e-7)


def test_training_state_is_unchanged_and_the_evaluation_uses_the_recomputed_statistics():
    """Weights, every buffer (running statistics, step counts, drift, PowerNorm's gradient statistic), the RNG and
    the train/eval mode are as before; the next training step is bit for bit the one without precise BN; and the
    evaluation inside differs from the one with the running statistics (they really were replaced)."""
    torch.manual_seed(0)
    rows = train_rows()
    model = warmed_up(tiny_model(), train_loader(rows))
    untouched = copy.deepcopy(model)
    batches = precise_bn_batches(train_loader(rows), 5)
    eval_loader = [pad_rows(rows[i : i + 8], pad_id=0) for i in range(0, 40, 8)]
    state, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    running = model.normlab.encoder.layers[0].attn_norm.running_mean.clone()
    with precise_bn(None, model, batches):
        assert not torch.equal(model.normlab.encoder.layers[0].attn_norm.running_mean, running)
        precise = evaluate(None, model, eval_loader, "classification", seed=0)
    plain = evaluate(None, model, eval_loader, "classification", seed=0)
    assert precise["eval/loss"] != plain["eval/loss"]
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(m._population is None for m in model.batch_statistics_norms().values())
    for name, value in state.items():
        assert torch.equal(model.state_dict()[name], value), name
    for name, b in model.named_buffers():  # the non-persistent ones too (last_stat_drift)
        assert torch.equal(b, dict(untouched.named_buffers())[name]), name
    losses = []
    for m in (model, untouched):
        torch.manual_seed(7)
        batch = batches[0]
        out = m.train()(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        losses.append((out.loss.item(), [p.grad.clone() for p in m.parameters()]))
    assert losses[0][0] == losses[1][0] and all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1]))


def test_an_error_inside_leaves_the_running_statistics_as_they_were():
    torch.manual_seed(0)
    rows = train_rows()
    model = warmed_up(tiny_model(), train_loader(rows))
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="boom"):
        with precise_bn(None, model, precise_bn_batches(train_loader(rows), 2)):
            raise RuntimeError("boom")
    for name, value in state.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert all(m._population is None for m in model.batch_statistics_norms().values())


@pytest.mark.slow  # two tiny training runs
def test_a_run_logs_precise_bn_accuracy_and_trains_as_without_it(tmp_path):
    """train.precise_bn_batches=3: every evaluation logs eval/accuracy_precise_bn and each block's statistics noise
    (bn/{i}/stat_noise), and every other logged number (losses, gradient norms, drift, accuracies) is the one of
    the same run without it."""
    import json

    common = ["model.norm=masked_batchnorm", "model.bn_group_size=4", "train.max_steps=6", "train.eval_steps=3",
              "train.save_steps=100"]
    assert run_here(tmp_path / "plain", *common) == 0
    assert run_here(tmp_path / "precise", *common, "train.precise_bn_batches=3") == 0
    read = lambda run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    plain, precise = read("plain"), read("precise")
    evals = [row for row in precise if "eval/accuracy" in row]
    assert [row["step"] for row in evals] == [3, 6]
    assert all(0.0 <= row["eval/accuracy_precise_bn"] <= 1.0 for row in evals)
    assert not any("eval/accuracy_precise_bn" in row for row in plain)
    noise = [f"bn/{i}/stat_noise" for i in range(2)]  # the tiny model's two blocks
    assert all(row[k] > 0 for row in evals for k in noise)
    assert not any(k.endswith("/stat_noise") for row in plain + [r for r in precise if r not in evals] for k in row)
    for a, b in zip(plain, precise):
        b = {k: v for k, v in b.items() if k != "eval/accuracy_precise_bn" and k not in noise}
        a.pop("train/tokens_per_s", None), b.pop("train/tokens_per_s", None)
        assert a == b


def group_distance(rows_by_group, population, eps):
    """The distance of each group's statistics (mean, biased variance) from the population's (mean, unbiased
    variance), written out: the RMS over features of the mean's offset in population SDs plus the RMS log-ratio."""
    mu, var = population.mean(0), population.var(0)
    out = []
    for rows in rows_by_group:
        m, v = rows.mean(0), rows.var(0, unbiased=False)
        out.append(((m - mu) ** 2 / (var + eps)).mean().sqrt() + ((torch.log(v + eps) - torch.log(var + eps)) ** 2)
                   .mean().sqrt())
    return torch.stack(out)


@pytest.mark.parametrize("group_size", [None, 2])
def test_the_statistics_noise_is_each_forwards_groups_against_the_population_of_the_same_weights(group_size):
    """After precise BN's forwards every block norm's `stat_noise` is the mean, over the groups of sentences (one
    group: the batch) of every forward, of the distance of the group's real-token mean and variance from the
    population's of all the forwards' rows: computed here from the rows each norm saw. The running statistics
    (lagging, here a few steps old) enter nowhere. PowerNorm and the pooled centring get one too."""
    torch.manual_seed(0)
    rows = train_rows()
    model = warmed_up(tiny_model(bn_group_size=group_size), train_loader(rows))
    batches = precise_bn_batches(train_loader(rows), 5)
    norms = model.batch_statistics_norms()
    blocks = {n: m for n, m in norms.items() if ".layers." in n}
    groups = {n: [] for n in blocks}

    def record(name, module, args):
        x, mask = args[0], args[1] if len(args) > 1 else None
        real = real_token_mask(x, mask).reshape(x.shape[0], -1)  # (B, L)
        g = group_size or x.shape[0]
        starts = list(range(0, x.shape[0] - g + 1, g))  # a last run shorter than g joins the group before it
        for i, s in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else x.shape[0]
            groups[name].append(x[s:end].reshape(-1, module.num_features)[real[s:end].reshape(-1)].double())

    hooks = [m.register_forward_pre_hook(functools.partial(record, name)) for name, m in blocks.items()]
    assert all(m.stat_noise is None for m in norms.values())
    with precise_bn(None, model, batches):
        for h in hooks:
            h.remove()
    for name, m in blocks.items():
        want = group_distance(groups[name], torch.cat(groups[name]), m.eps).mean()
        assert len(groups[name]) == 5 * (4 // (group_size or 4))
        assert m.stat_noise == pytest.approx(want.item(), rel=1e-5), name
    assert all(m.stat_noise > 0 for m in norms.values())  # PowerNorm's and the centring's too


def test_the_noise_of_two_sentence_groups_is_about_four_times_the_whole_batchs_for_iid_rows():
    """Rows drawn independently: a group of 2 of 32 sentences holds 1/16 of the tokens, so sampling theory puts its
    statistics' distance from the population's at sqrt(16) = 4 times the whole batch's (the mean's offset and the
    log-variance's spread both shrink as 1/sqrt(tokens))."""
    from model.norms import MaskedBatchNorm, population_statistics

    torch.manual_seed(0)
    batches = [torch.randn(32, 10, 16) for _ in range(20)]  # 320 tokens a batch, 20 a group of 2 sentences
    noise = {}
    for g in (2, 32):
        norm = MaskedBatchNorm(16, group_size=g).train()
        with torch.no_grad(), population_statistics([norm]):
            for x in batches:
                norm(x)
        noise[g] = norm.stat_noise
    assert noise[2] > noise[32]
    assert 3.6 < noise[2] / noise[32] < 4.4
