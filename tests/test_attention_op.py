"""normlab::attention (normlab/kernels/attention.py, C++ kernels in attention_cpu.cpp) and the transformers attention
function that calls it: the C++ kernels against the PyTorch reference (the forward and the dropout mask exactly,
the backward to rounding), against float64 truth and torch's SDPA, gradcheck, opcheck, torch.compile, the cases
handed to SDPA, and `normlab.kernels.use` selecting it for a model and putting SDPA back."""

import math

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import normlab.kernels
from normlab.kernels.attention import (
    ATTN_IMPLEMENTATION,
    attention_backward_reference,
    attention_reference,
    normlab_attention_forward,
)
from normlab.kernels.dropout import dropout_reference

SEED = torch.tensor(77)


def _inputs(B=3, H=2, L=7, S=None, D=8, dtype=torch.float32):
    """q (B, H, L, D) as the model makes it (a view of one projection: not contiguous), k, v (B, H, S, D) (views
    like q's where S == L), and the model's padding bias (B, 1, 1, S): the second sequence has 3 pad keys, the last
    only one real key."""
    torch.manual_seed(0)
    S = L if S is None else S
    q, k, v = torch.randn(B, L, 3, H, D, dtype=dtype).permute(2, 0, 3, 1, 4).unbind(0)
    if S != L:
        k, v = torch.randn(2, B, H, S, D, dtype=dtype).unbind(0)
    real = torch.ones(B, S, dtype=torch.bool)
    real[1, S - 3:] = False
    real[-1, 1:] = False
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    bias = torch.zeros(B, S, dtype=compute).masked_fill(~real, torch.finfo(compute).min)[:, None, None, :]
    return q, k, v, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_cpp_forward_is_the_reference(cpp, dtype, p):
    q, k, v, bias = _inputs(dtype=dtype)
    out, probs = torch.ops.normlab.attention(q, k, v, bias, SEED, p, 0.35)
    ref_out, ref_probs = attention_reference(q, k, v, bias, SEED, p, 0.35)
    assert out.dtype == dtype and probs.dtype == dtype and out.shape == (3, 2, 7, 8) and probs.shape == (3, 2, 7, 7)
    # torch's GEMM and softmax in both, the same mask: equal to rounding (bit for bit where both take the same GEMM
    # variant, as here on one thread; the reference's strided k^T is copied, the kernel's is not)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(probs, ref_probs, **tol)
    torch.testing.assert_close(out, ref_out, **tol)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_is_normlab_dropouts(backend, p):
    """With v the identity, out = the dropped weights themselves: exactly normlab::dropout of probs (same seed, flat
    index, scale), so the attention drops what the model's other dropouts would."""
    q, k, _, bias = _inputs(L=40, D=8)
    v = torch.eye(40).expand(3, 2, 40, 40)
    out, probs = torch.ops.normlab.attention(q, k, v, bias, SEED, p, 0.35)
    expected = dropout_reference(probs, SEED, p)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    assert torch.equal(out == 0, expected == 0)
    n, kept = probs.numel(), (expected != 0).sum().item()  # (every weight is > 0: the finite pad bias underflows
    pad_weights = (probs == 0).sum().item()  # to exactly 0, and those count as dropped here)
    assert abs(kept - (n - pad_weights) * (1 - p)) < 5 * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_cpp_backward_is_the_reference(cpp, p):
    q, k, v, bias = _inputs(S=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, probs = torch.ops.normlab.attention(q, k, v, bias, SEED, p, 0.35)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = attention_backward_reference(grad, q, k, v, probs, SEED, p, 0.35)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradcheck(backend):
    q, k, v, bias = _inputs(B=2, L=5, D=4, dtype=torch.float64)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: torch.ops.normlab.attention(q, k, v, bias, SEED, 0.4, 0.5)[0], (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_against_float64_truth_is_torchs(backend, dtype):
    """Judged as flash-attention's tests judge: against the float64 result, the error is at most twice that of torch's
    own SDPA given the same inputs (without dropout: SDPA's masks are not ours), plus a small atol. bfloat16 inputs
    compute in float32: probs in float32, the output rounded to bfloat16 once."""
    q, k, v, bias = _inputs(L=33, D=16, dtype=dtype)
    truth = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                             attn_mask=bias.double(), scale=0.25)
    ours, probs = torch.ops.normlab.attention(q, k, v, bias, SEED, 0.0, 0.25)
    torchs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(dtype), scale=0.25)
    assert ours.dtype == dtype and probs.dtype == torch.float32
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    assert (ours.double() - truth).abs().max() <= 2 * (torchs.double() - truth).abs().max() + atol


def test_opcheck(backend):
    q, k, v, bias = _inputs(B=2, L=4, D=4)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.normlab.attention, (q, k, v, bias, SEED, 0.25, 0.5))
    torch.library.opcheck(torch.ops.normlab.attention, (q.double(), k.double(), v.double(), None, SEED, 0.0, 0.5))
    out, probs = torch.ops.normlab.attention(q, k, v, bias, SEED, 0.25, 0.5)
    torch.library.opcheck(torch.ops.normlab.attention_backward,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), probs, SEED, 0.25, 0.5))


def test_a_bias_that_requires_grad_is_refused(backend):
    q, k, v, bias = _inputs()
    with pytest.raises((ValueError, RuntimeError), match="bias .attention mask. must not require grad"):
        torch.ops.normlab.attention(q.requires_grad_(), k, v, bias.requires_grad_(), SEED, 0.1, 0.35)


class _Module(torch.nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.is_causal = causal


def test_torch_compile_fullgraph(backend):
    q, k, v, bias = _inputs()
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def attend(q, k, v):
        return normlab_attention_forward(_Module(False), q, k, v, bias, dropout=0.2, scaling=0.35)[0]

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    torch.manual_seed(4)
    out = compiled(q, k, v)
    torch.manual_seed(4)
    assert torch.equal(compiled(q, k, v), out)  # the seed is drawn in the graph, from torch's generator
    torch.manual_seed(4)
    torch.testing.assert_close(out, attend(q, k, v), rtol=1e-6, atol=1e-7)  # and is the eager draw
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("case", ["causal", "bool_mask", "bfloat16", "grouped_kv_heads"])
def test_what_the_kernel_does_not_cover_is_sdpa(cpp, case):
    """A causal module, a boolean mask, a reduced-precision input or fewer key than query heads goes to
    transformers' SDPA function unchanged."""
    q, k, v, bias = _inputs(dtype=torch.bfloat16 if case == "bfloat16" else torch.float32)
    mask = {"causal": None, "bool_mask": bias == 0, "bfloat16": bias.bfloat16()}.get(case, bias)
    module = _Module(causal=case == "causal")
    if case == "grouped_kv_heads":
        k, v, module.num_key_value_groups = k[:, :1], v[:, :1], 2
    got, _ = normlab_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.35)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.35)
    assert torch.equal(got, expected)


def test_the_attention_function_returns_hf_layout(cpp):
    q, k, v, bias = _inputs()
    got, weights = normlab_attention_forward(_Module(False), q, k, v, bias, dropout=0.0, scaling=0.35)
    expected, _ = sdpa_attention_forward(_Module(False), q, k, v, bias, dropout=0.0, scaling=0.35)
    assert weights is None and got.shape == (3, 7, 2, 8) and got.is_contiguous()  # (B, L, H, Dh)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _tiny_model():
    from model import NormLabConfig, NormLabForSequenceClassification

    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, num_labels=2, attention_probs_dropout_prob=0.3)
    return NormLabForSequenceClassification(config)


def test_use_selects_it_and_puts_sdpa_back(cpp):
    model = _tiny_model()
    ids = torch.randint(1, 50, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        sdpa = model.eval()(input_ids=ids, attention_mask=mask).logits
    normlab.kernels.use(model, "auto", "cpu")
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, sdpa, rtol=1e-5, atol=1e-6)
    model.train()
    torch.manual_seed(1)
    a = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 1, 0]))
    a.loss.backward()
    torch.manual_seed(1)
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, a.logits)  # the seed decides the masks
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    normlab.kernels.use(model, "reference", "cpu")
    assert model.config._attn_implementation == "sdpa"


def test_use_keeps_eager(cpp):
    model = _tiny_model()
    model.set_attn_implementation("eager")
    normlab.kernels.use(model, "auto", "cpu")
    assert model.config._attn_implementation == "eager"
