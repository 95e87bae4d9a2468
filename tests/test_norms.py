"""Every norm against a reference (torch's modules or a direct reimplementation), and the padding argument.

The central claim of the project is checked here: for every norm except the naive `batchnorm`, the outputs on
real tokens do not depend on how much padding the batch carries.
"""

import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from model.configuration_normlab import NORM_TYPES, NormLabConfig
from model.modeling_normlab import _init_norm
from model.norms import (
    BATCH_STAT_NORMS,
    NORM_REGISTRY,
    BatchCentering,
    BatchStatNorm,
    CustomLayerNorm,
    MaskedBatchNorm,
    NaiveBatchNorm,
    PowerNorm,
    build_norm,
    register_norm,
    set_batch_stats_in_eval,
    uses_batch_statistics,
)

D = 16
LN_SHAPES = [(24,), (4, 6), (2, 3, 4)]
LN_AFFINE = [dict(elementwise_affine=True, bias=True), dict(elementwise_affine=False), dict(bias=False)]


def _config(norm, **kw):
    return NormLabConfig(norm=norm, hidden_size=D, num_attention_heads=2, **kw)


def _assert_close(a, b, atol, rtol=0.0):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------------------------
# CustomLayerNorm: the operator normlab::layer_norm on every CPU backend
# ---------------------------------------------------------------------------------------------------------------


def _ln_pair(normalized_shape, dtype=torch.float32, **affine):
    ref = nn.LayerNorm(normalized_shape, eps=1e-5, dtype=dtype, **affine)
    ours = CustomLayerNorm(normalized_shape, eps=1e-5, dtype=dtype, **affine)
    with torch.no_grad():  # non-trivial affine parameters, so their use (and gradients) are really tested
        for p in ref.parameters():
            p.normal_(0.5, 0.5)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _fwd_bwd(module, x, dy):
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("normalized_shape", LN_SHAPES)
@pytest.mark.parametrize("affine", LN_AFFINE, ids=["affine", "no_affine", "no_bias"])
def test_custom_layernorm_matches_torch(backend, normalized_shape, affine):
    torch.manual_seed(0)
    ref, ours = _ln_pair(normalized_shape, **affine)
    x = torch.randn(3, 5, *normalized_shape) * 2 + 0.5  # (B, L, *normalized_shape), moderate scale
    dy = torch.randn_like(x)
    y_ref, dx_ref, grads_ref = _fwd_bwd(ref, x, dy)
    y, dx, grads = _fwd_bwd(ours, x, dy)
    _assert_close(y, y_ref, atol=1e-6, rtol=1e-6)
    _assert_close(dx, dx_ref, atol=1e-6, rtol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        _assert_close(grads[name], grads_ref[name], atol=1e-6, rtol=1e-6)


def test_custom_layernorm_empty_batch(backend):
    ref, ours = _ln_pair(24)
    x, dy = torch.randn(0, 24), torch.randn(0, 24)
    y_ref, dx_ref, grads_ref = _fwd_bwd(ref, x, dy)
    y, dx, grads = _fwd_bwd(ours, x, dy)
    assert y.shape == (0, 24) and dx.shape == (0, 24)
    for name in grads:  # no rows: parameter gradients are exactly zero, as torch's
        _assert_close(grads[name], grads_ref[name], atol=0.0)


def test_custom_layernorm_single_element(backend):
    # One normalized element: variance 0, xhat 0, so the output is the bias and no gradient reaches x.
    torch.manual_seed(0)
    ref, ours = _ln_pair(1)
    x, dy = torch.randn(6, 1) * 3, torch.randn(6, 1)
    y_ref, dx_ref, grads_ref = _fwd_bwd(ref, x, dy)
    y, dx, grads = _fwd_bwd(ours, x, dy)
    _assert_close(y, ours.bias.detach().expand(6, 1), atol=0.0)
    _assert_close(y, y_ref, atol=1e-6)
    # The exact input gradient is 0; torch's kernel leaves rounding noise of order rstd * ulp(x) = 316 * 1e-7
    # (seeded: an unseeded draw once exceeded the bound below).
    _assert_close(dx, torch.zeros_like(dx), atol=0.0)
    _assert_close(dx, dx_ref, atol=1e-4)
    _assert_close(grads["weight"], torch.zeros(1), atol=0.0)  # xhat is exactly 0; torch's is ~1e-6
    _assert_close(grads["weight"], grads_ref["weight"], atol=1e-4)
    _assert_close(grads["bias"], grads_ref["bias"], atol=1e-6)


@pytest.mark.parametrize("normalized_shape", [(6,), (2, 3)])
def test_custom_layernorm_gradcheck_float64(backend, normalized_shape):
    torch.manual_seed(0)
    _, ours = _ln_pair(normalized_shape, dtype=torch.float64)
    x = torch.randn(2, 3, *normalized_shape, dtype=torch.float64, requires_grad=True)
    w = ours.weight.detach().clone().requires_grad_(True)
    b = ours.bias.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w, b: functional_call(ours, {"weight": w, "bias": b}, (x,)),
                                    (x, w, b))


def test_custom_layernorm_varying_batch_shapes_and_strides(backend):
    # Padded batches change B and L every step; every shape must stay exact.
    ref, ours = _ln_pair(24)
    for shape in [(3, 5, 24), (2, 7, 24), (4, 3, 24), (7, 24), (24,), (2, 3, 2, 24)]:
        x = torch.randn(*shape)
        dy = torch.randn_like(x)
        for got, want in zip(_fwd_bwd(ours, x, dy)[:2], _fwd_bwd(ref, x, dy)[:2]):
            _assert_close(got, want, atol=1e-6, rtol=1e-6)
    # Non-contiguous input and an expanded (stride-0) output gradient, as `.sum().backward()` produces.
    x = torch.randn(5, 3, 24).transpose(0, 1)
    grads = []
    for module in (ours, ref):
        xg = x.clone().requires_grad_(True)  # clone keeps the transposed strides
        module(xg).sum().backward()
        grads.append(xg.grad)
    _assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_opcheck_both_operators(backend, dtype):
    """torch.library.opcheck: schema, fake (shape-only) implementation against the real one, autograd
    registration, and AOT-autograd tracing (what torch.compile does with the operators)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8).to(dtype).requires_grad_(True)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)  # float32 parameters
    for args in [(x, w, b, 1e-5), (x, None, None, 1e-5), (x.detach().transpose(0, 1), w, None, 1e-3)]:
        torch.library.opcheck(torch.ops.normlab.layer_norm, args)
    y, mean, rstd = torch.ops.normlab.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert (y.dtype, mean.dtype, rstd.dtype, mean.shape) == (dtype, compute, compute, (3, 4))
    for weight in (w.detach(), None):
        dy = torch.randn_like(x)
        torch.library.opcheck(torch.ops.normlab.layer_norm_backward, (dy, x.detach(), weight, mean, rstd))


def test_half_precision_is_normalized_in_float32(backend):
    # bfloat16 / float16 inputs: the statistics and the arithmetic in float32, the result rounded once
    torch.manual_seed(0)
    ref, ours = _ln_pair(64)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(4, 64) * 3 + 100).to(dtype)  # |mean| >> std: a half-precision sum would lose it
        want = ref(x.float()).to(dtype)
        _assert_close(ours(x), want, atol=0.0, rtol=torch.finfo(dtype).eps)  # at most one rounding step apart
        assert ours(x).dtype == dtype


def test_torch_compile_fullgraph_and_autocast(backend):
    """The module inside torch.compile(fullgraph=True) (the operators stay single opaque calls) and under CPU
    bf16 autocast (a custom operator is not cast: the fp32 residual stream stays fp32; a bf16 input is normalized
    in fp32 and returned in bf16)."""
    torch.manual_seed(0)
    ref, ours = _ln_pair(32)
    x, dy = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    (y, dx, _), (y_ref, dx_ref, grads_ref) = _fwd_bwd(compiled, x, dy), _fwd_bwd(ref, x, dy)
    for got, want in [(y, y_ref), (dx, dx_ref), (ours.weight.grad, grads_ref["weight"]),
                      (ours.bias.grad, grads_ref["bias"])]:
        _assert_close(got, want, atol=1e-6, rtol=1e-6)
    lin = nn.Linear(32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(x).dtype == torch.float32
        h = lin(x)  # bf16 under autocast
        y = compiled(h)
    assert y.dtype == torch.bfloat16
    _assert_close(y, ref(h.float()).to(torch.bfloat16), atol=0.0, rtol=torch.finfo(torch.bfloat16).eps)


def test_no_double_backward(backend):
    _, ours = _ln_pair(8)
    x = torch.randn(4, 8, requires_grad=True)
    (dx,) = torch.autograd.grad(ours(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="layer_norm_backward.*no autograd formula"):
        dx.sum().backward()


def test_threads_split_parameter_gradients(backend):
    # Inputs above the grain (32768 elements per task) split rows across threads; dweight/dbias are summed per
    # task, so the result must still match torch's for any thread count.
    torch.manual_seed(0)
    ref, ours = _ln_pair(128)
    x, dy = torch.randn(16, 64, 128), torch.randn(16, 64, 128)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for got, want in zip(_fwd_bwd(ours, x, dy), _fwd_bwd(ref, x, dy)):
                want = want if isinstance(want, dict) else {"t": want}
                got = got if isinstance(got, dict) else {"t": got}
                for k in want:
                    _assert_close(got[k], want[k], atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_naive_std_layernorm_is_wrong_on_low_variance_input():
    # The often-copied version: unbiased std, eps outside the square root.
    def naive(x, eps=1e-5):
        return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + eps)

    torch.manual_seed(0)
    ref, ours = nn.LayerNorm(64, elementwise_affine=False), CustomLayerNorm(64, elementwise_affine=False)
    x = 0.01 + 1e-3 * torch.randn(8, 64)  # std ~1e-3: eps=1e-5 on the variance is 10x the variance itself
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731 - a one-line local helper
    assert rel(naive(x), ref(x)) > 1.0  # more than 100% off (about 3.3x too large)
    assert rel(ours(x), ref(x)) < 1e-5
    # Even at unit variance the unbiased std leaves a systematic ~1/(2M) relative error.
    x = torch.randn(8, 64)
    assert rel(naive(x), ref(x)) > 3e-3
    assert rel(ours(x), ref(x)) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Per-token norms and the registry
# ---------------------------------------------------------------------------------------------------------------


def test_registry_matches_norm_types_and_build_norm():
    assert tuple(NORM_REGISTRY) == tuple(NORM_TYPES)
    for name in NORM_TYPES:
        norm = build_norm(_config(name))
        assert isinstance(norm, NORM_REGISTRY[name])
        assert isinstance(norm, BatchStatNorm) == uses_batch_statistics(name) == (name in BATCH_STAT_NORMS)
        x = torch.randn(2, 3, D)
        assert norm(x, torch.ones(2, 3)).shape == (2, 3, D)
    assert build_norm(_config("layernorm"), dim=8).normalized_shape == (8,)
    assert build_norm(_config("masked_batchnorm", norm_eps=1e-6, bn_momentum=0.2)).momentum == 0.2
    assert build_norm(_config("rmsnorm", norm_eps=1e-6)).eps == 1e-6


@pytest.mark.parametrize("name", NORM_TYPES)
def test_init_restores_the_values_each_norm_declares(name):
    """The model's weight init resets a norm to `initial_values()`; they must match what its constructor makes
    and name every tensor the norm owns (a new norm that forgets one fails here with a KeyError)."""
    norm = build_norm(_config(name, dyt_alpha_init=0.7))
    fresh = copy.deepcopy(norm.state_dict(keep_vars=False))
    with torch.no_grad():
        for t in [*norm.parameters(), *norm.buffers()]:
            t.add_(torch.ones_like(t) if not t.is_floating_point() else torch.randn_like(t))
    _init_norm(norm)
    for key, value in norm.state_dict().items():
        torch.testing.assert_close(value, fresh[key], msg=lambda m: f"{name}.{key}: {m}")
    assert name != "dyt" or norm.alpha.item() == pytest.approx(0.7)


def test_rmsnorm_matches_torch():
    torch.manual_seed(0)
    ours, ref = build_norm(_config("rmsnorm", norm_eps=1e-6)), nn.RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, D) * 3
    _assert_close(ours(x, torch.ones(2, 5)), ref(x), atol=1e-6, rtol=1e-6)


def test_preset_entries_are_their_class_with_the_preset_arguments():
    """A registry entry may fix constructor arguments (HF's ACT2CLS idea): the weightless RMSNorm and the
    LayerNorm without shift are RMSNorm and LayerNorm, built with the config's eps plus the preset."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, D) * 3
    plain = build_norm(_config("rmsnorm_noweight", norm_eps=1e-6))
    assert isinstance(plain, NORM_REGISTRY["rmsnorm"]) and not list(plain.parameters()) and plain.eps == 1e-6
    _assert_close(plain(x, torch.ones(2, 5)), nn.RMSNorm(D, eps=1e-6, elementwise_affine=False)(x), atol=1e-6)
    ln = build_norm(_config("layernorm_nobias", norm_eps=1e-6))
    assert ln.bias is None and ln.eps == 1e-6
    with torch.no_grad():
        ln.weight.normal_()
    _assert_close(ln(x), F.layer_norm(x, (D,), ln.weight, None, 1e-6), atol=1e-6)
    with pytest.raises(ValueError, match="unexpected keyword argument 'alpah_init'"):
        register_norm(NORM_REGISTRY["dyt"], name="dyt_typo", alpah_init=1.0)
    assert "dyt_typo" not in NORM_TYPES


def test_dyt_formula_and_identity():
    dyt = build_norm(_config("dyt", dyt_alpha_init=0.7))
    assert dyt.alpha.item() == pytest.approx(0.7)
    with torch.no_grad():
        dyt.weight.normal_(), dyt.bias.normal_()
    x = torch.randn(2, 5, D) * 4
    _assert_close(dyt(x), dyt.weight * torch.tanh(0.7 * x) + dyt.bias, atol=1e-7)
    assert build_norm(_config("none"))(x, torch.ones(2, 5)) is x


# ---------------------------------------------------------------------------------------------------------------
# Padding invariance: the central argument
# ---------------------------------------------------------------------------------------------------------------


def _batch(seed, lengths=(6, 4, 2), extra_pad=0):
    """x (B, L, D) with garbage at pad positions, mask (B, L); the same real tokens for any extra_pad."""
    g = torch.Generator().manual_seed(seed)
    b, length = len(lengths), max(lengths)
    x = 1.5 * torch.randn(b, length, D, generator=g) + 0.3
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
    garbage = lambda *s: 50 * torch.randn(*s) + 20  # noqa: E731 - pads must not leak: make them loud
    x = torch.where(mask[..., None], x, garbage(b, length, D))
    x = torch.cat([x, garbage(b, extra_pad, D)], dim=1)
    mask = torch.cat([mask, torch.zeros(b, extra_pad, dtype=torch.bool)], dim=1)
    return x, mask.long()  # long, as HF attention masks are


def _real_outputs_and_grads(norm, x, mask, loss_weight):
    """Output and input gradient at real tokens (packed (R, D)) for a loss over real tokens only, and the input
    gradient at the pads (P, D)."""
    x = x.clone().requires_grad_(True)
    y = norm(x, mask)
    real = mask.bool()
    (y[real] * loss_weight).sum().backward()
    return y[real].detach(), x.grad[real], x.grad[~real]


def _pad_config(name):
    return _config(name, powernorm_warmup_steps=2)  # so a few steps cover PowerNorm's warmup and after


@pytest.mark.parametrize("name", NORM_TYPES)
def test_padding_does_not_change_real_tokens_in_train(name):
    torch.manual_seed(0)
    short = build_norm(_pad_config(name)).train()
    padded = copy.deepcopy(short)
    for step in range(4):  # several steps: running statistics and PowerNorm's warmup switch play their part
        x, mask = _batch(step)
        xp, maskp = _batch(step, extra_pad=5)
        c = torch.randn(int(mask.sum()), D)
        y, dx, _ = _real_outputs_and_grads(short, x, mask, c)
        yp, dxp, pad_grad = _real_outputs_and_grads(padded, xp, maskp, c)
        if NORM_REGISTRY[name].sees_padding:  # the naive batchnorm: what its class declares
            assert (y - yp).abs().max() > 1e-3  # the pads leak into the statistics: the harm, shown
            return
        _assert_close(yp, y, atol=1e-5, rtol=1e-5)
        _assert_close(dxp, dx, atol=1e-5, rtol=1e-5)
        # a pad is not a token: no gradient flows back through it into what wrote it (a bias added to every row)
        assert torch.equal(pad_grad, torch.zeros_like(pad_grad)), f"step {step}: gradient at pad rows"
    for (n, a), (_, b) in zip(short.named_buffers(), padded.named_buffers()):  # running statistics too
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=lambda m: f"buffer {n}: {m}")
    for (n, a), (_, b) in zip(short.named_parameters(), padded.named_parameters()):
        _assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", NORM_TYPES)
def test_padding_does_not_change_real_tokens_in_eval(name):
    torch.manual_seed(0)
    norm = build_norm(_pad_config(name)).train()
    with torch.no_grad():
        for step in range(4):  # non-trivial running statistics (past PowerNorm's warmup)
            norm(*_batch(100 + step))
    norm.eval()
    short, padded = norm, copy.deepcopy(norm)
    x, mask = _batch(7)
    xp, maskp = _batch(7, extra_pad=5)
    real = mask.bool()
    with torch.no_grad():
        _assert_close(padded(xp, maskp)[:, : x.shape[1]][real], short(x, mask)[real], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The BatchNorm family against torch.nn.BatchNorm1d
# ---------------------------------------------------------------------------------------------------------------


def _copy_affine(src, dst):
    with torch.no_grad():
        src.weight.normal_(1.0, 0.3), src.bias.normal_(0.0, 0.3)
        dst.weight.copy_(src.weight), dst.bias.copy_(src.bias)


def test_masked_batchnorm_equals_batchnorm1d_on_real_tokens():
    torch.manual_seed(0)
    ours, ref = MaskedBatchNorm(D, eps=1e-5, momentum=0.2), nn.BatchNorm1d(D, eps=1e-5, momentum=0.2)
    _copy_affine(ours, ref)
    for step in range(3):
        x, mask = _batch(step)
        real = mask.bool()
        c = torch.randn(int(real.sum()), D)
        y, dx, _ = _real_outputs_and_grads(ours, x, mask, c)
        packed = x[real].clone().requires_grad_(True)  # (R, D): the real tokens only
        y_ref = ref(packed)
        (y_ref * c).sum().backward()
        _assert_close(y, y_ref.detach(), atol=1e-5, rtol=1e-5)
        _assert_close(dx, packed.grad, atol=1e-5, rtol=1e-5)
        _assert_close(ours.running_mean, ref.running_mean, atol=1e-6, rtol=1e-5)
        _assert_close(ours.running_var, ref.running_var, atol=1e-6, rtol=1e-5)  # unbiased, as torch's
    _assert_close(ours.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-5)
    _assert_close(ours.bias.grad, ref.bias.grad, atol=1e-4, rtol=1e-5)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 3
    ours.eval(), ref.eval()
    x, mask = _batch(9)
    with torch.no_grad():
        _assert_close(ours(x, mask)[mask.bool()], ref(x[mask.bool()]), atol=1e-5, rtol=1e-5)


def test_masked_batchnorm_train_output_equals_batchnorm1d():
    torch.manual_seed(0)
    ours, ref = MaskedBatchNorm(D), nn.BatchNorm1d(D)
    _copy_affine(ours, ref)
    x, mask = _batch(3)
    real = mask.bool()
    _assert_close(ours(x, mask)[real], ref(x[real]), atol=1e-5, rtol=1e-5)


def test_naive_batchnorm_equals_batchnorm1d_over_every_position():
    torch.manual_seed(0)
    ours, ref = NaiveBatchNorm(D, momentum=0.1), nn.BatchNorm1d(D, momentum=0.1)
    _copy_affine(ours, ref)
    x, mask = _batch(1)
    _assert_close(ours(x, mask).reshape(-1, D), ref(x.reshape(-1, D)), atol=1e-5, rtol=1e-5)
    _assert_close(ours.running_var, ref.running_var, atol=1e-4, rtol=1e-5)
    _assert_close(ours.running_mean, ref.running_mean, atol=1e-5, rtol=1e-5)


def test_batch_centering_is_batchnorm1d_times_the_batch_std_and_keeps_its_running_mean():
    """Centring is BN's first half: x - mean over the real tokens, no division and no parameters; its running mean
    and eval follow torch's BatchNorm1d (its running variance has no use here)."""
    torch.manual_seed(0)
    ours, ref = BatchCentering(D, momentum=0.2), nn.BatchNorm1d(D, momentum=0.2, affine=False)
    assert list(ours.parameters()) == []
    for step in range(3):
        x, mask = _batch(step)
        real = mask.bool()
        y = ours(x, mask)[real]
        std = x[real].var(dim=0, unbiased=False).add(ref.eps).sqrt()
        _assert_close(y, ref(x[real]) * std, atol=1e-5, rtol=1e-5)
        _assert_close(ours.running_mean, ref.running_mean, atol=1e-6, rtol=1e-5)
    ours.eval()
    x, mask = _batch(9)
    with torch.no_grad():
        _assert_close(ours(x, mask), x - ref.running_mean, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", BATCH_STAT_NORMS)
def test_single_real_token_raises_in_training(name):
    norm = build_norm(_config(name)).train()
    x = torch.randn(1, 3, D)
    mask = torch.tensor([[1, 0, 0]])
    if NORM_REGISTRY[name].sees_padding:  # counts every position: one position in all
        x, mask = x[:, :1], mask[:, :1]
    with pytest.raises(ValueError, match=f"{name} needs at least 2 real tokens"):
        norm(x, mask)
    norm.eval()
    assert norm(x, mask).shape == x.shape  # eval with running statistics is fine


@pytest.mark.parametrize("name", BATCH_STAT_NORMS)
def test_stat_drift_and_batch_stats_in_eval(name):
    torch.manual_seed(0)
    norm = build_norm(_config(name, powernorm_warmup_steps=1000)).train()
    scale, shift = torch.linspace(0.3, 3.0, D), torch.linspace(-1.0, 2.0, D)  # features on different scales
    with torch.no_grad():
        norm(torch.randn(8, 16, D) * scale + shift)
        first = norm.last_stat_drift  # fresh running stats (0, 1) are far from these
        for _ in range(40):
            norm(torch.randn(8, 16, D) * scale + shift)
        settled = norm.last_stat_drift
        norm(torch.randn(8, 16, D) * scale.flip(0) + shift.flip(0))  # a batch from another distribution
        shifted = norm.last_stat_drift
    assert first.dim() == 0 and not first.requires_grad
    assert settled < first / 3 and shifted > 5 * settled

    # Eval: running statistics by default; the batch's own with the flag, leaving running stats and drift alone.
    x, mask = _batch(5)
    train_copy = copy.deepcopy(norm).train()
    with torch.no_grad():
        y_train = train_copy(x, mask)
    norm.eval()
    buffers = {k: v.clone() for k, v in norm.named_buffers()}
    model = nn.Sequential(norm, nn.Linear(D, D))
    assert set_batch_stats_in_eval(model, True) == 1 and norm.use_batch_stats_in_eval
    with torch.no_grad():
        y_batch = norm(x, mask)
    real = mask.bool()
    _assert_close(y_batch[real], y_train[real], atol=1e-5, rtol=1e-5)
    for k, v in norm.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert norm.last_stat_drift is shifted
    set_batch_stats_in_eval(model, False)
    with torch.no_grad():
        assert not torch.allclose(norm(x, mask)[real], y_batch[real], atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# PowerNorm against a direct reimplementation of Algorithm 1 (as in the authors' code)
# ---------------------------------------------------------------------------------------------------------------


def _reference_powernorm(steps, weight, bias, eps, alpha_fwd, alpha_bkw, warmup, group_size=None):
    """Shen et al. 2020 Alg. 1 as MaskPowerNorm implements it, written out on packed real tokens (R, D). With ghost
    groups of `group_size` consecutive sentences, what NormLab defines: each
    token is scaled by its own group's psi^2, while `ema_gz` stays one statistic, moved once a step by the mean over
    all real tokens, and the running psi^2 moves towards the mean of the groups' psi^2."""
    running, ema_gz, results = torch.ones(D), torch.zeros(D), []
    for t, (x, mask, c) in enumerate(steps, start=1):
        real = mask.bool()
        sentence = torch.arange(x.shape[0])[:, None].expand_as(real)[real]  # (R,) each real token's sentence
        group = sentence // (group_size or x.shape[0])  # (R,); the batches here hold whole groups
        xr = x[real].clone().requires_grad_(True)  # (R, D)
        xs = xr / torch.sqrt((xr**2).mean(-1, keepdim=True) + eps)  # group scaling (group_num=1)
        psi2 = torch.stack([(xs.detach()[group == k] ** 2).mean(0) for k in range(int(group.max()) + 1)])  # (G, D)
        z = xs.detach() / torch.sqrt((psi2[group] if t <= warmup else running) + eps)
        y = weight * z + bias
        g = c * weight  # dL/dy = c
        approx = g - (1 - alpha_bkw) * ema_gz * z
        ema_gz = ema_gz + (approx * z).mean(0)
        (dx,) = torch.autograd.grad(xs, xr, approx / torch.sqrt(psi2[group] + eps))
        if t < warmup:
            running = running * (t - 1) / t + psi2.mean(0) / t
        running = alpha_fwd * running + (1 - alpha_fwd) * psi2.mean(0)
        results.append((y, dx, running.clone(), ema_gz.clone()))
    return results


@pytest.mark.parametrize("group_size", [None, 2])
def test_powernorm_matches_algorithm_1_before_and_after_warmup(group_size):
    """Whole-batch statistics, and ghost groups of 2 sentences (with groups of different psi^2: the reference's
    definition, with its one ema_gz, is what they must equal)."""
    torch.manual_seed(0)
    cfg = _config("powernorm", powernorm_alpha_fwd=0.8, powernorm_alpha_bkw=0.7, powernorm_warmup_steps=3,
                  bn_group_size=group_size)
    norm = build_norm(cfg).train()
    assert isinstance(norm, PowerNorm)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3), norm.bias.normal_(0.0, 0.3)
    steps = []
    for s in range(5):  # steps 1-3 use the batch psi^2 (warmup), 4-5 the running one
        x, mask = _batch(s, lengths=(6, 4, 2, 5))
        steps.append((x, mask, torch.randn(int(mask.sum()), D)))
    want = _reference_powernorm(steps, norm.weight.detach(), norm.bias.detach(), cfg.norm_eps, 0.8, 0.7, 3,
                                group_size)
    for (x, mask, c), (y_ref, dx_ref, running_ref, ema_ref) in zip(steps, want):
        y, dx, pad_grad = _real_outputs_and_grads(norm, x, mask, c)
        _assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        _assert_close(dx, dx_ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(pad_grad, torch.zeros_like(pad_grad))  # pads are dropped, as MaskPowerNorm drops them
        _assert_close(norm.running_psi2, running_ref, atol=1e-6, rtol=1e-5)
        _assert_close(norm.ema_gz, ema_ref, atol=1e-6, rtol=1e-5)
    assert int(norm.num_batches_tracked) == 5
    norm.eval()  # eval: the running psi^2
    x, mask = _batch(9)
    xs = x / torch.sqrt((x**2).mean(-1, keepdim=True) + cfg.norm_eps)
    with torch.no_grad():
        want = norm.weight * xs / torch.sqrt(norm.running_psi2 + cfg.norm_eps) + norm.bias
        _assert_close(norm(x, mask), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Synchronized statistics across processes (2 CPU processes, gloo)
# ---------------------------------------------------------------------------------------------------------------


def _sync_worker(rank, world_size, init_file):
    torch.set_num_threads(1)  # forked from a process whose thread pool may be initialized
    torch.manual_seed(0)
    norms = [MaskedBatchNorm(D, momentum=0.3), PowerNorm(D, warmup_steps=1)]
    for norm in norms:
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.3), norm.bias.normal_(0.0, 0.3)
    # Global batch: 4 sequences; rank r gets sequences 2r, 2r+1, and rank 1 gets extra padding as well.
    x, mask = _batch(0, lengths=(6, 3, 5, 2))
    c = torch.randn(*x.shape)  # loss weights, zero at pads below
    # Single-process reference on the whole batch, before the process group exists.
    single = []
    for norm in norms:
        ref = copy.deepcopy(norm)
        for step in range(2):  # step 2 of PowerNorm uses its running statistics and gradient statistic
            xg = x.clone().requires_grad_(True)
            y = ref(xg, mask)
            (y * c * mask[..., None]).sum().backward()
        single.append((y.detach(), xg.grad, ref))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world_size)
    try:
        rows = slice(2 * rank, 2 * rank + 2)
        pad = 3 * rank
        xl = torch.cat([x[rows], torch.full((2, pad, D), 7.0)], dim=1)
        ml = torch.cat([mask[rows], torch.zeros(2, pad, dtype=mask.dtype)], dim=1)
        cl = torch.cat([c[rows], torch.zeros(2, pad, D)], dim=1)
        length = x.shape[1]
        for norm, (y_single, dx_single, ref) in zip(norms, single):
            for step in range(2):
                xg = xl.clone().requires_grad_(True)
                y = norm(xg, ml)
                (y * cl * ml[..., None]).sum().backward()
            y = y.detach()
            real = ml.bool()[:, :length]
            _assert_close(y[:, :length][real], y_single[rows][real], atol=1e-5, rtol=1e-5)
            _assert_close(xg.grad[:, :length][real], dx_single[rows][real], atol=1e-5, rtol=1e-5)
            for (name, a), (_, b) in zip(norm.named_buffers(), ref.named_buffers()):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{norm.name}.{name}: {m}")
            for p, p_ref in zip(norm.parameters(), ref.parameters()):  # DDP would sum/average these
                total = p.grad.clone()
                torch.distributed.all_reduce(total)
                _assert_close(total, p_ref.grad, atol=1e-4, rtol=1e-5)
    finally:
        torch.distributed.destroy_process_group()


def test_masked_statistics_synchronized_across_processes():
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the workers start in milliseconds instead of re-importing torch and transformers (spawn).
        torch.multiprocessing.start_processes(_sync_worker, args=(2, os.path.join(tmp, "init")), nprocs=2,
                                              join=True, start_method="fork")
