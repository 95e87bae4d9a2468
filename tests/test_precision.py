"""Mixed precision as GPU runs use it, reproduced on the CPU: a model cast to bfloat16/float16, bf16/fp16 autocast,
FSDP's bf16 mixed-precision policy (gloo, one process), and the padding bias in half precision.

The batch-statistics norms must compute their statistics in float32 and keep float32 running statistics whatever
the module's dtype; the runs below are compared against the same training in float32."""

import copy
import functools
import os
import tempfile

import pytest
import torch

from model import NormLabConfig, NormLabForSequenceClassification
from model.configuration_normlab import NORM_TYPES
from model.modeling_normlab import NormLabBlock
from model.norms import BATCH_STAT_NORMS, uses_batch_statistics

VOCAB = 50
STEPS = 4
STAT_BUFFERS = ("running_mean", "running_var", "running_psi2", "ema_gz")


def tiny_model(norm, seed=0, **kw):
    torch.manual_seed(seed)
    config = NormLabConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=32, num_labels=2, norm=norm,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           powernorm_warmup_steps=2, **kw)  # PowerNorm: past its warmup within STEPS
    return NormLabForSequenceClassification(config)


def batches(n=STEPS, seed=1):
    """Padded batches (one sequence of each has padding), fixed by the seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (6, 12), generator=g)
        mask = torch.ones(6, 12, dtype=torch.long)
        for row, length in enumerate((12, 9, 7, 12, 4, 10)):
            mask[row, length:] = 0
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "labels": torch.randint(0, 2, (6,), generator=g)})
    return out


def train_steps(model, data, autocast_dtype=None, lr=1e-3):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    losses = []
    for batch in data:
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def running_stats(model) -> dict:
    """Every BN-family running statistic, by name (FSDP's wrapper prefixes stripped)."""
    return {name.replace("_fsdp_wrapped_module.", ""): buf for name, buf in model.named_buffers()
            if name.rsplit(".", 1)[-1] in STAT_BUFFERS}


def assert_stats_close(got: dict, ref: dict, rtol, atol):
    assert got.keys() == ref.keys() and got
    for name, ref_buf in ref.items():
        assert got[name].dtype == torch.float32, f"{name} is {got[name].dtype}, not float32"
        torch.testing.assert_close(got[name], ref_buf, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# Tolerances: bf16 weights/activations differ from fp32 by ~2**-8 relative per op; over 4 steps of a 2-layer
# model the running statistics (averages over 60 tokens) stay within a few percent of the fp32 run's.
BF16_TOL = dict(rtol=0.05, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", NORM_TYPES)
def test_model_cast_to_half_trains_and_keeps_float32_statistics(norm, dtype):
    data = batches()
    ref = tiny_model(norm)
    model = copy.deepcopy(ref).to(dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ref_losses = train_steps(ref, data)
    losses = train_steps(model, data)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses == pytest.approx(ref_losses, rel=0.05, abs=0.02)
    if uses_batch_statistics(norm):
        assert_stats_close(running_stats(model), running_stats(ref), **BF16_TOL)


@pytest.mark.parametrize("norm", BATCH_STAT_NORMS)
def test_bf16_autocast_statistics_match_float32(norm):
    data = batches()
    ref = tiny_model(norm)
    model = copy.deepcopy(ref)
    ref_losses = train_steps(ref, data)
    losses = train_steps(model, data, autocast_dtype=torch.bfloat16)
    assert losses == pytest.approx(ref_losses, rel=0.05, abs=0.02)
    assert_stats_close(running_stats(model), running_stats(ref), **BF16_TOL)


def test_statistics_are_float32_when_built_and_loaded_in_bfloat16(tmp_path):
    tiny_model("powernorm").save_pretrained(tmp_path)
    loaded = NormLabForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.classifier.weight.dtype == torch.bfloat16
    stats = running_stats(loaded)
    assert stats and all(b.dtype == torch.float32 for b in stats.values())


def test_buffer_cast_by_someone_else_returns_to_float32():
    """FSDP casts buffers with `buffer.data = buffer.to(buffer_dtype)`, bypassing Module._apply."""
    model = tiny_model("masked_batchnorm")
    norm = next(iter(model.batch_statistics_norms().values()))
    held = norm.running_var  # the object FSDP/DDP keep a reference to
    held.data = held.data.to(torch.bfloat16)
    train_steps(model, batches(1))
    assert norm.running_var is held and held.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# FSDP with accelerate's bf16 policy (param, reduce and buffer dtype bf16), one process on the CPU (gloo)
# ---------------------------------------------------------------------------------------------------------------


def _fsdp_worker(rank, init_file, norm, out_file):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = FSDP(
            tiny_model(norm),
            # what accelerate's FullyShardedDataParallelPlugin.set_mixed_precision("bf16") builds, and the wrap
            # policy of configs/accelerate/fsdp.yaml
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                           buffer_dtype=torch.bfloat16),
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={NormLabBlock}),
            use_orig_params=True, device_id=torch.device("cpu"),
        )
        losses = train_steps(model, batches(), autocast_dtype=torch.bfloat16)
        torch.save({"losses": losses, "stats": {k: v.clone() for k, v in running_stats(model).items()}}, out_file)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("norm", BATCH_STAT_NORMS)
def test_fsdp_bf16_trains_and_keeps_float32_statistics(norm):
    ref = tiny_model(norm)
    ref_losses = train_steps(ref, batches())
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "out.pt")
        torch.multiprocessing.start_processes(_fsdp_worker, args=(os.path.join(tmp, "init"), norm, out_file),
                                              nprocs=1, join=True, start_method="fork")
        result = torch.load(out_file)
    assert result["losses"] == pytest.approx(ref_losses, rel=0.05, abs=0.02)
    assert_stats_close(result["stats"], running_stats(ref), **BF16_TOL)


# ---------------------------------------------------------------------------------------------------------------
# The padding bias under autocast
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padding_bias_is_finite_where_attention_computes_and_a_padded_row_stays_finite(monkeypatch, dtype, unpad):
    """SDPA casts the additive mask to the query dtype under autocast. float32's finfo.min is -inf in bf16/fp16,
    and CUDA's SDPA kernels return NaN for a query row that sees only -inf (a fully padded sequence): the bias
    must be finite in the dtype SDPA computes in. (CPU kernels cope with -inf rows, so the mask SDPA receives is
    checked here; scripts/gpu/gpu_check.sh runs the same forward on CUDA.)"""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(torch.isfinite(attn_mask.to(q.dtype)).all().item())
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny_model("layernorm").eval()
    model.normlab.unpad = unpad
    ids = torch.randint(1, VOCAB, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1] = 0  # a fully padded row
    mask[2, 3:] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        out = model(input_ids=ids * mask, attention_mask=mask, output_hidden_states=True)
    assert seen and all(seen), "SDPA got a bias with -inf in its compute dtype"
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(h).all() for h in out.hidden_states)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):  # the written-out attention too
        weights = model(input_ids=ids * mask, attention_mask=mask, output_attentions=True).attentions
    assert all(torch.isfinite(w).all() for w in weights)
