"""Every path a run can take computes what the reference computes. The reference is the default: eager, the packed
token layout (the real tokens only; `NormLabModel.unpad`), no checkpointing, whole-batch statistics. Each other path
trains the same float64 model from the same state on the same padded batches for 3 SGD steps (so that running
statistics and PowerNorm's backward statistic `ema_gz` have moved) and must give the same gradients at every step,
and the same weights and buffers after, within float64 rounding: a gap that rounding explains is ~1e-15 here, where
a different computation stays as large as it is in float32.

Generated for every registered norm (`NORM_TYPES` is read from the registry, a user's registered norm included),
in the pre and the post placement. The batches are two copies of the same four sentences (10, 3, 6 and 6 real
tokens of 10, then again): a ghost group of the first four has exactly the statistics of the whole batch, so ghost
groups smaller than the batch have the reference to meet too (docs/model.md, "Every path and its test")."""

import copy

import pytest
import torch

import normlab.kernels
from model import NormLabForSequenceClassification
from model.norms import NORM_TYPES, PowerNorm
from tiny_model import VOCAB, width16_config

pytestmark = pytest.mark.usefixtures("restore_cpu_backend")  # a test may switch the CPU kernels
RTOL, ATOL = 1e-9, 1e-12  # float64: rounding differences are ~1e-15; today's PowerNorm bug was ~1e-1
STEPS = 3
LENGTHS = ((10, 3, 6, 6), (7, 2, 5, 7), (4, 8, 3, 8))  # a new padded width each step: compile's dynamic shapes


def _batches():
    g = torch.Generator().manual_seed(1)
    for lengths in LENGTHS:
        lengths = torch.tensor(lengths * 2)  # the same four sentences twice: each half is a ghost group of the whole
        mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (4, mask.shape[1]), generator=g).repeat(2, 1) * mask
        yield ids, mask, torch.tensor([0, 1, 1, 0] * 2)


def _model(norm, placement, **overrides):
    torch.manual_seed(0)
    config = width16_config(norm=norm, norm_placement=placement, problem_type="single_label_classification",
                            powernorm_warmup_steps=1, **overrides)  # PowerNorm: steps 2-3 use its running psi^2
    return NormLabForSequenceClassification(config).to(torch.float64).train()


def _train(model):
    """(each step's gradients, the state dict after STEPS SGD steps). SGD: Adam's division by sqrt(v) would blow
    rounding up on near-zero gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for ids, mask, labels in _batches():
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return grads, {n: t.detach().clone() for n, t in model.state_dict().items()}


# What each path changes from the reference. group_size: config.bn_group_size, in sentences of the 8.
PATHS = {
    "padded": dict(unpad=False),  # the layout ghost batches, compilation and naive BN run in
    "checkpointed": dict(checkpointing=True),  # the blocks recomputed in backward
    "checkpointed_padded": dict(checkpointing=True, unpad=False),
    "ghost_whole_batch": dict(group_size=8),  # one group: the packed layout, no process sync
    "ghost_halves": dict(group_size=4),  # two groups, each with the whole batch's statistics here
    "cpp_kernels": dict(kernels=True),  # train.kernels=auto on CPU
    "compiled_aot_eager": dict(backend="aot_eager"),  # padded, as compilation needs static-rank shapes
    "compiled_inductor": dict(backend="inductor"),
}


def _path_model(norm, placement, path, state):
    """The model as `path` runs it, from the reference's initial `state`."""
    how = PATHS[path]
    model = _model(norm, placement, bn_group_size=how.get("group_size"))
    model.load_state_dict(state)
    model.normlab.unpad = how.get("unpad", True)
    if how.get("checkpointing"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    if how.get("kernels"):
        normlab.kernels.use(model, "auto", "cpu")  # the C++ LayerNorm, attention and dropout (the `cpp` fixture)
    if "backend" in how:
        torch._dynamo.reset()
        model.compile(backend=how["backend"], dynamic=True)
    return model


def _assert_same(got, ref, skip=()):
    (grads, state), (ref_grads, ref_state) = got, ref
    for step, (g, r) in enumerate(zip(grads, ref_grads, strict=True), 1):
        for name in r:
            torch.testing.assert_close(g[name], r[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {name}: {m}")
    for name in (n for n in ref_state if not n.endswith(skip)):
        torch.testing.assert_close(state[name], ref_state[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _check(norm, placement, path):
    base = _model(norm, placement)
    state = copy.deepcopy(base.state_dict())
    normlab.kernels.use(base, "reference", "cpu")  # model/'s operators as written: the reference computation
    ref = _train(base)
    # The running variance is unbiased with each group's count (BatchNorm1d's on that group), not the batch's:
    # by design, and pinned against separate batches in test_ghost_batch.py.
    skip = ("running_var",) if PATHS[path].get("group_size", 8) < 8 else ()
    _assert_same(_train(_path_model(norm, placement, path, state)), ref, skip)
    if any(isinstance(m, PowerNorm) for m in base.modules()):  # the backward statistic moved: the test can see it
        assert all(t.abs().max() > 0 for n, t in ref[1].items() if n.endswith("ema_gz"))


QUICK_PATHS = ["padded", "checkpointed", "checkpointed_padded", "ghost_whole_batch", "ghost_halves"]


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("path", QUICK_PATHS)
@pytest.mark.parametrize("norm", NORM_TYPES)
def test_path_matches_packed_eager(norm, path, placement):
    """padded: the layout ghost batches, compilation and naive BN run in; checkpointed: the blocks recomputed in
    backward, in each layout; ghost_whole_batch: bn_group_size = the batch (one group); ghost_halves: two groups,
    whose statistics are the whole batch's here, so the grouped code must meet the reference too."""
    _check(norm, placement, path)


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("norm", NORM_TYPES)
def test_cpp_kernels_match_packed_eager(norm, placement, cpp, restore_cpu_backend):
    """The C++ CPU kernels (normlab.kernels) in place of model/'s reference operators, in float64."""
    _check(norm, placement, "cpp_kernels")


@pytest.mark.parametrize(("norm", "placement"), [
    (n, p) if (n, p) == ("powernorm", "pre") else pytest.param(n, p, marks=pytest.mark.slow)
    for n in NORM_TYPES for p in ("pre", "post")])
def test_compiled_aot_eager_matches_packed_eager(norm, placement):
    """train.compile=true's capture (dynamo, AOTAutograd's forward and backward graphs, where a state change made in
    a backward would be lost) without inductor's code generation. Pre-LN PowerNorm in the quick tier (its backward
    updates a buffer); the rest, 20 s a case, in the slow tier."""
    _check(norm, placement, "compiled_aot_eager")


@pytest.mark.slow
def test_compiled_inductor_matches_packed_eager():
    """train.compile=true's default backend, generated code included: PowerNorm, whose backward updates a buffer,
    only (1-2.5 minutes of one core; every norm would cost CI 20 more). In float64 inductor's reordered sums are
    rounding, ~1e-15, so the reference's tolerance holds for it too."""
    _check("powernorm", "pre", "compiled_inductor")
