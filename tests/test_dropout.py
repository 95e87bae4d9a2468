"""modeling_normlab.Dropout: the C++ CPU kernel against the definition of (inverted) dropout and nn.Dropout."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import NormLabForSequenceClassification, cpu_kernels
from model.modeling_normlab import Dropout, NormLabAttention, TokenLayout
from tests.test_modeling import tiny_config


@pytest.fixture(autouse=True)
def _kernels_built():
    """Without the extension every test below would silently test nn.Dropout: fail instead."""
    assert cpu_kernels.cpu_kernels() is not None, cpu_kernels._STATE["broken"]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keeps_each_element_with_probability_1_minus_p_and_rescales(p):
    torch.manual_seed(0)
    n = 400_000
    y = Dropout(p).train()(torch.ones(n))
    kept = y != 0
    # every kept value is exactly 1 / (1 - p), as nn.Dropout's
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)), atol=0, rtol=1e-6)
    sigma = math.sqrt(p * (1 - p) / n)  # binomial standard deviation of the keep rate
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma
    # no structure along the row: keep rates per column of a (n/128, 128) view are binomial too
    col = kept.view(-1, 128).float().mean(0)
    assert (col - (1 - p)).abs().max() < 5 * math.sqrt(p * (1 - p) / (n // 128))


def test_backward_applies_the_forward_mask_and_scale():
    torch.manual_seed(0)
    x = torch.randn(64, 33, requires_grad=True)
    drop = Dropout(0.3).train()
    y = drop(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    mask = (y != 0).float()  # x has no exact zeros
    torch.testing.assert_close(x.grad, dy * mask / 0.7, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y, x.detach() * mask / 0.7, atol=1e-6, rtol=1e-6)


def test_seeded_reproducible_fresh_each_call_and_thread_count_free():
    x = torch.ones(50_000)
    drop = Dropout(0.5).train()
    torch.manual_seed(1)
    a, b = drop(x), drop(x)
    torch.manual_seed(1)
    assert torch.equal(drop(x), a)  # torch.manual_seed reproduces the masks (it draws from torch's generator)
    assert not torch.equal(a, b)  # and each call draws a new one
    threads = torch.get_num_threads()
    try:
        masks = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            torch.manual_seed(1)
            masks.append(drop(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(m, masks[0]) for m in masks)


def test_identity_where_nn_dropout_is():
    x = torch.randn(8, 16)
    assert torch.equal(Dropout(0.5).eval()(x), x)
    assert torch.equal(Dropout(0.0).train()(x), x)
    assert torch.equal(Dropout(1.0).train()(x), F.dropout(x, 1.0, True))  # all zeros: nn.Dropout's path
    with pytest.raises(RuntimeError, match="double backward"):
        xg = torch.randn(8, 16, requires_grad=True)
        torch.autograd.grad(Dropout(0.5).train()(xg).pow(2).sum(), xg, create_graph=True)


def test_written_out_attention_equals_sdpa_when_nothing_is_dropped(monkeypatch):
    # In CPU training with attention dropout, NormLabAttention writes attention out (to use this dropout);
    # with the dropout made the identity it must compute exactly what SDPA computes.
    torch.manual_seed(0)
    config = tiny_config(attention_probs_dropout_prob=0.1)
    attn = NormLabAttention(config)
    x = torch.randn(3, 7, config.hidden_size)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    layout = TokenLayout(mask, packed=False, dtype=x.dtype)
    want, _ = attn.eval()(x, layout)
    monkeypatch.setattr(attn.attn_dropout, "forward", lambda t: t)
    got, _ = attn.train()(x, layout)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_training_step_uses_the_kernel_and_learns():
    # The whole model in train mode: every dropout is the C++ node, and a few steps on a fixed batch fit it.
    torch.manual_seed(0)
    config = tiny_config(num_labels=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = NormLabForSequenceClassification(config).train()
    ids = torch.randint(5, 50, (8, 12))
    labels = torch.tensor([0, 1] * 4)
    out = model(input_ids=ids, labels=labels)
    nodes, stack, seen = set(), [out.loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    assert any("DropoutFunction" in n for n in nodes)
    assert not any("NativeDropout" in n for n in nodes)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = out.loss.item()
    for _ in range(30):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_under_torch_compile_it_is_one_op_with_the_forward_mask_in_the_backward():
    """Inside torch.compile the kernel runs as the op normlab::dropout (Inductor's own CPU dropout costs about
    half a training step); its seed comes from the compiled graph's RNG, so torch.manual_seed reproduces it."""
    graphs = []

    def capture(gm, example_inputs):  # a dynamo backend that keeps the traced graph, then runs it eagerly
        graphs.append(gm)
        return gm.forward

    drop = Dropout(0.3).train()
    x = torch.randn(64, 33, requires_grad=True)
    torch.compile(lambda t: drop(t) * 2, backend=capture, fullgraph=True)(x)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.normlab.dropout in targets and F.dropout not in targets

    f = torch.compile(lambda t: drop(t) * 2, backend="aot_eager", fullgraph=True)  # fake kernel + autograd formula
    torch.manual_seed(0)
    y = f(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    mask = (y != 0).float()
    torch.testing.assert_close(y, x.detach() * mask * 2 / 0.7, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, dy * mask * 2 / 0.7, atol=1e-6, rtol=1e-6)
    assert abs(mask.mean().item() - 0.7) < 0.05
    torch.manual_seed(0)
    assert torch.equal(f(x), y)
