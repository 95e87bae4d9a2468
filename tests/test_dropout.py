"""normlab::dropout (normlab/kernels/dropout.py, C++ kernel in dropout_cpu.cpp) and `normlab.kernels.use`, which
puts it in place of a model's nn.Dropout: the C++ kernel against the PyTorch reference bit for bit, the mask's
statistics, the gradient, seeds, opcheck, torch.compile, train/eval, and a swapped model's saved checkpoint."""

import math

import pytest
import torch
import torch.nn as nn

import normlab.kernels
from normlab.kernels.dropout import Dropout, dropout_reference, keep_mask

SEED = torch.tensor(1234)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cpp_kernel_is_the_reference_bit_for_bit(cpp, dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 70001, dtype=dtype)[:, ::3]  # non-contiguous; more than one parallel chunk of elements
    for p in (0.1, 0.5, 0.9):
        y = torch.ops.normlab.dropout(x, SEED, p)
        assert y.is_contiguous() and y.dtype == dtype and y.shape == x.shape
        assert torch.equal(y, dropout_reference(x, SEED, p))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_scale(backend, p):
    n = 200_000
    y = torch.ops.normlab.dropout(torch.ones(n), SEED, p)
    kept = y != 0
    # binomial(n, 1 - p): 5 standard deviations (a correct mask fails this with probability < 1e-6)
    assert abs(kept.sum().item() - n * (1 - p)) < 5 * math.sqrt(n * p * (1 - p))
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / (1 - p)))  # survivors scaled by 1 / (1 - p)
    # and the mask is not a pattern: both halves and odd/even positions keep alike
    for part in (kept[: n // 2], kept[n // 2:], kept[::2], kept[1::2]):
        m = part.numel()
        assert abs(part.sum().item() - m * (1 - p)) < 5 * math.sqrt(m * p * (1 - p))


def test_gradient_is_mask_times_scale(backend):
    torch.manual_seed(0)
    x = torch.randn(64, 130, requires_grad=True)
    g = torch.randn(64, 130)
    p = 0.3
    y = torch.ops.normlab.dropout(x, SEED, p)
    y.backward(g)
    keep = keep_mask(int(SEED), x.numel(), p).view(x.shape)
    scale = torch.tensor(1 / (1 - p))
    assert torch.equal(x.grad, g * torch.where(keep, scale, torch.zeros(())))
    assert torch.equal(y, x.detach() * torch.where(keep, scale, torch.zeros(())))
    # the backward is the operator again, so it is differentiable too (double backward): the same mask
    g.requires_grad_(True)
    (dx,) = torch.autograd.grad(torch.ops.normlab.dropout(x, SEED, p), x, g, create_graph=True)
    (dg,) = torch.autograd.grad(dx.sum(), g)
    assert torch.equal(dg, torch.where(keep, scale, torch.zeros(())))


def test_same_seed_same_mask_other_seed_other_mask(backend):
    x = torch.ones(10_000)
    a, b = (torch.ops.normlab.dropout(x, torch.tensor(s), 0.5) for s in (7, 7))
    c = torch.ops.normlab.dropout(x, torch.tensor(8), 0.5)  # a neighbouring seed: an unrelated mask
    assert torch.equal(a, b)
    assert 0.4 < ((a != 0) == (c != 0)).float().mean().item() < 0.6


def test_module_draws_its_seed_from_torchs_generator(backend):
    drop = Dropout(0.5).train()
    x = torch.ones(4096)
    torch.manual_seed(3)
    first = drop(x)
    second = drop(x)  # the generator moved on: another mask
    torch.manual_seed(3)
    assert torch.equal(drop(x), first) and not torch.equal(first, second)


def test_module_train_eval_and_the_edges(backend):
    x = torch.randn(8, 16)
    assert torch.equal(Dropout(0.5).eval()(x), x)  # eval: identity, as nn.Dropout
    assert torch.equal(Dropout(0.0).train()(x), x)
    assert torch.equal(Dropout(1.0).train()(x), torch.zeros_like(x))  # nn.Dropout's p = 1
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        dropout_reference(x, SEED, 1.0)


def test_opcheck(backend):
    x = torch.randn(5, 33, requires_grad=True)
    torch.library.opcheck(torch.ops.normlab.dropout, (x, SEED, 0.25))
    torch.library.opcheck(torch.ops.normlab.dropout, (x.detach().double().t(), SEED, 0.5))


def test_torch_compile_fullgraph(backend):
    """Inside torch.compile(fullgraph=True) the seed is drawn in the graph (from torch's generator: reproducible
    under torch.manual_seed) and the op is one opaque call; its gradient is the same mask, scaled."""
    drop = Dropout(0.2).train()
    compiled = torch.compile(drop, backend="aot_eager", fullgraph=True)
    x = torch.ones(3000, requires_grad=True)
    torch.manual_seed(5)
    y = compiled(x)
    y.sum().backward()
    kept = y != 0
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / 0.8)) and 0.7 < kept.float().mean().item() < 0.9
    assert torch.equal(x.grad, y.detach())  # d(sum(x * mask * scale))/dx = mask * scale = y at x = 1
    torch.manual_seed(5)
    assert torch.equal(compiled(x), y)


def _tiny_model():
    from model import NormLabConfig, NormLabForSequenceClassification

    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, norm="custom_layernorm", num_labels=2)
    return NormLabForSequenceClassification(config)


def _dropouts(model):
    return [type(m) for m in model.modules() if isinstance(m, nn.Dropout)]


def test_use_swaps_with_cpp_and_back_with_reference(cpp):
    model = _tiny_model().eval()
    n = len(_dropouts(model))
    assert n > 0 and set(_dropouts(model)) == {nn.Dropout}
    normlab.kernels.use(model, "auto", "cpu")  # "cpp"
    assert _dropouts(model) == [Dropout] * n
    assert not any(m.training for m in model.modules())  # the swap keeps the mode
    torch.manual_seed(1)
    ids = torch.randint(1, 50, (4, 9))
    model.train()
    loss = model(input_ids=ids, labels=torch.tensor([0, 1, 1, 0])).loss
    loss.backward()
    assert math.isfinite(loss.item())
    normlab.kernels.use(model, "reference", "cpu")  # "torch": nn.Dropout again
    assert _dropouts(model) == [nn.Dropout] * n


def test_reference_leaves_nn_dropout(restore_cpu_backend):
    model = _tiny_model()
    before = [id(m) for m in model.modules()]
    assert normlab.kernels.use(model, "reference", "cpu")["normlab::dropout"] == "torch"
    assert [id(m) for m in model.modules()] == before and set(_dropouts(model)) == {nn.Dropout}


def test_saved_model_is_the_same_with_the_fast_dropout(cpp, tmp_path):
    """save_pretrained after the swap writes what it writes without it: the same config, weights and remote code
    (dropout and the attention function have no state, and transformers does not save the attention
    implementation), and the loaded model has plain nn.Dropout and SDPA."""
    from model import NormLabForSequenceClassification

    plain, swapped = _tiny_model(), _tiny_model()
    normlab.kernels.use(swapped, "auto", "cpu")
    assert Dropout in _dropouts(swapped)
    plain.save_pretrained(tmp_path / "plain")
    swapped.save_pretrained(tmp_path / "swapped")
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "swapped").iterdir())
    for name in names:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "swapped" / name).read_bytes(), name
    loaded = NormLabForSequenceClassification.from_pretrained(tmp_path / "swapped")
    assert set(_dropouts(loaded)) == {nn.Dropout}
    assert swapped.config._attn_implementation == "normlab_cpu" and loaded.config._attn_implementation == "sdpa"
