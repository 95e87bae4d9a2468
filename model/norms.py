"""Every normalization layer NormLab can put in a block, behind one interface and one registry.

All norms take `forward(x, mask=None)` with x (B, L, D) (any (*, D) works) and mask (B, L) where 1/True marks a
real token. Norms that compute statistics per token (LayerNorm, RMSNorm) or none at all (DyT, identity) ignore the
mask: a token's output depends on that token only, so padding can never leak in. The batch-statistics family
(`BatchStatNorm`: batchnorm, masked_batchnorm, powernorm) must be told which positions are real; the naive
`batchnorm` deliberately is not, to measure the harm of padding leaking into the statistics.

Each norm class declares what the rest of NormLab needs to know about it (`Norm`: its registry name, whether
its statistics come from the batch, whether it must see the padding, how it is built from the config and the
values it starts from); `NORM_REGISTRY` at the end lists the classes, and everything else derives from it: the
valid `config.norm` names (`NORM_TYPES`), the batch-statistics family (`BATCH_STAT_NORMS`), `build_norm`, the
weight initialization and the study's reports. This module imports only the operator files (ops.py,
layer_norm_op.py), which import nothing else from the package, so the config can read the names from it.
"""

from numbers import Integral

import torch
import torch.nn as nn

from .layer_norm_op import layer_norm
from .ops import compute_dtype


def real_token_mask(x, mask):
    """mask (B, L) of 1/True for real tokens -> bool (B*L,) aligned with x.reshape(-1, D); None = all real."""
    if mask is None:
        return torch.ones(x.shape[:-1].numel(), dtype=torch.bool, device=x.device)
    if mask.shape != x.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match x shape {tuple(x.shape)} without its last dim")
    return mask.reshape(-1).to(device=x.device, dtype=torch.bool)


class Norm:
    """What every norm class declares (a mixin next to its torch base class).

    name           its `config.norm` name
    batch_stats    statistics come from the batch: running statistics, a train/eval gap, `bn/*` metrics
    sees_padding   must run on the padded (B, L, D) layout, pad positions included (the naive BatchNorm)
    from_config    how `build_norm` builds it from a NormLabConfig
    initial_values the value every parameter and buffer of its own starts from; the model's `_init_weights`
                   applies them (with transformers' init functions, which skip tensors loaded from a checkpoint)
    """

    name: str
    batch_stats = False
    sees_padding = False

    @classmethod
    def from_config(cls, config, dim: int) -> nn.Module:
        return cls(dim, eps=config.norm_eps)

    def initial_values(self) -> dict[str, float]:
        return {"weight": 1.0, "bias": 0.0}


# ---------------------------------------------------------------------------------------------------------------
# LayerNorm, torch's and ours
# ---------------------------------------------------------------------------------------------------------------


class LayerNorm(Norm, nn.LayerNorm):
    """torch.nn.LayerNorm that accepts (and ignores) the padding mask: its statistics are per token."""

    name = "layernorm"

    def forward(self, x, mask=None):
        return super().forward(x)


class CustomLayerNorm(Norm, nn.Module):
    """The project's hand-written LayerNorm: same constructor, parameters and results as torch.nn.LayerNorm.

    y = (x - mean) / sqrt(var + eps) * weight + bias over the last len(normalized_shape) dims, with the *biased*
    variance and eps *inside* the square root, unlike the often-copied `(x - mean) / (x.std() + eps)` (docs/model.md
    says why that matters). The math is the operator `normlab::layer_norm` (model/layer_norm_op.py): its reference
    implementation unless a kernel package registered a faster one for the input's device. Half-precision inputs
    are normalized in float32 and returned in their own dtype. No double backward (create_graph=True).
    """

    name = "custom_layernorm"

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(s) for s in normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

    def forward(self, x, mask=None):
        nd = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - nd:]) != self.normalized_shape:
            raise ValueError(f"CustomLayerNorm expects input (*, {self.normalized_shape}), got {tuple(x.shape)}")
        if nd == 1:  # the usual case: the op normalizes the last dim, no reshapes
            return layer_norm(x, self.weight, self.bias, self.eps)[0]
        flat = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731 - (M,) parameters for the op
        y, _, _ = layer_norm(x.flatten(-nd), flat(self.weight), flat(self.bias), self.eps)
        return y.view(x.shape)


# ---------------------------------------------------------------------------------------------------------------
# Per-token norms without mean subtraction, and no norm
# ---------------------------------------------------------------------------------------------------------------


class RMSNorm(Norm, nn.RMSNorm):
    """torch.nn.RMSNorm (x / sqrt(mean(x^2) + eps) * weight) accepting (and ignoring) the padding mask."""

    name = "rmsnorm"

    def forward(self, x, mask=None):
        return super().forward(x)


class DyT(Norm, nn.Module):
    """Dynamic Tanh (Zhu et al., 2025, "Transformers without Normalization"): weight * tanh(alpha * x) + bias.

    No statistics at all; a learnable scalar alpha sets how early tanh squashes outliers.
    """

    name = "dyt"

    @classmethod
    def from_config(cls, config, dim):
        return cls(dim, alpha_init=config.dyt_alpha_init)

    def __init__(self, dim, alpha_init=0.5):
        super().__init__()
        self.alpha_init = float(alpha_init)
        self.alpha = nn.Parameter(torch.tensor(self.alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def initial_values(self):
        return {"alpha": self.alpha_init, "weight": 1.0, "bias": 0.0}

    def forward(self, x, mask=None):
        return self.weight * torch.tanh(self.alpha * x) + self.bias


class Identity(Norm, nn.Module):
    """No normalization: the ablation."""

    name = "none"

    @classmethod
    def from_config(cls, config, dim):
        return cls()

    def initial_values(self):
        return {}

    def forward(self, x, mask=None):
        return x


# ---------------------------------------------------------------------------------------------------------------
# The batch-statistics family
# ---------------------------------------------------------------------------------------------------------------


def _dist_world_size():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _all_reduce_sum(t, sync=True):
    """Sum over processes, differentiably (the backward all-reduces the gradients, as SyncBatchNorm does).

    Only training forwards sync (`sync`): every process runs them in lockstep, while eval loops may not.
    """
    if sync and _dist_world_size() > 1:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t)
    return t


def _recomputing() -> bool:
    """True while the autograd engine runs a backward pass: a norm's forward then is gradient checkpointing's
    recomputation of its block (reentrant or not), which must give the same output and update no state a second
    time. torch has no public query for this; torch.utils.checkpoint itself reads the same graph-task id."""
    if torch.compiler.is_compiling():  # compiled backward graphs never rerun the Python forward
        return False
    return torch._C._current_graph_task_id() != -1


def _log_ratio_rms(var_b, var_r, eps):
    return torch.sqrt(torch.mean((torch.log(var_b + eps) - torch.log(var_r + eps)) ** 2))


class BatchStatNorm(Norm, nn.Module):
    r"""Base of the norms whose statistics come from the batch: batchnorm, masked_batchnorm, powernorm.

    Training normalizes with the current batch's statistics and updates running statistics (momentum
    `momentum`, torch's convention: running = (1 - momentum) * running + momentum * batch); eval normalizes with
    the running statistics, unless `use_batch_stats_in_eval` is True (then with the current batch's, to measure
    the train/eval gap; running statistics are not touched).

    `last_stat_drift` (detached 0-dim tensor, updated at every training forward, *before* the running statistics
    absorb the batch) measures how far this batch's statistics are from the running statistics that eval would
    use, in scale-free units (invariant to rescaling any feature):
        drift = sqrt(mean_d (mu_b - mu_r)^2 / (var_r + eps)) + sqrt(mean_d (log(var_b + eps) - log(var_r + eps))^2)
    i.e. the RMS over features of the mean shift in running standard deviations, plus the RMS log-ratio of the
    variances. PowerNorm has no mean: only the second term, with psi^2 (quadratic mean) in place of var.

    Gradient checkpointing reruns a training forward inside the backward pass (`_recomputing`): that rerun
    normalizes exactly as the first run did and updates nothing (running statistics, `num_batches_tracked`,
    `last_stat_drift`), so a checkpointed step leaves the same state as a plain one.

    A training forward needs at least 2 real tokens (a variance of one value is 0 and its normalization is
    undefined) and raises ValueError otherwise.

    Precision: the statistics are computed in `compute_dtype`, and the running statistics stay float32 buffers
    whatever the module's dtype, because in bfloat16 most of a running average's small steps round away
    (docs/model.md). `model.to(torch.bfloat16)` / `.half()` leave them float32 (`_apply`), and a buffer that
    something else cast (FSDP's mixed precision) is turned back at the next training forward (`_float32_buffers`).
    """

    name = "batch_stat_norm"  # each subclass has its registry name, used in error messages
    batch_stats = True

    @classmethod
    def from_config(cls, config, dim):
        return cls(dim, eps=config.norm_eps, momentum=config.bn_momentum)

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self._stat_init = {}  # running-statistic buffer -> its initial value (`initial_values`)
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.use_batch_stats_in_eval = False
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        # A non-persistent buffer (not a plain attribute) so it follows .to(device) and is materialised by
        # from_pretrained instead of being left on the meta device; not saved in checkpoints.
        self.register_buffer("last_stat_drift", torch.zeros((), dtype=torch.float32), persistent=False)

    def _stat_buffer(self, name, value: float):
        """A float32 running-statistic buffer (explicit dtype: from_pretrained(dtype=...) builds the model under
        another default dtype)."""
        self.register_buffer(name, torch.full((self.num_features,), value, dtype=torch.float32))
        self._stat_init[name] = value

    def initial_values(self):
        return {"weight": 1.0, "bias": 0.0, "num_batches_tracked": 0, "last_stat_drift": 0.0, **self._stat_init}

    def _float32_buffers(self):
        """Half-precision floating buffers back to float32, in place (`.data`), so every holder of the buffer
        object (FSDP, DDP's buffer broadcast) keeps seeing it."""
        for buf in self._buffers.values():
            if buf is not None and buf.dtype in (torch.float16, torch.bfloat16):
                buf.data = buf.data.float()

    def _apply(self, fn, recurse=True):
        # .to(dtype), .half(), .bfloat16() cast parameters and buffers alike; the statistics stay float32
        super()._apply(fn, recurse)
        self._float32_buffers()
        return self

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"

    def _check_count(self, count):
        if count < 2:
            raise ValueError(
                f"{self.name} needs at least 2 real tokens to compute batch statistics (in training, or in eval with "
                f"use_batch_stats_in_eval), got {int(count)}; use a larger batch or a per-token norm"
            )

    def _uses_batch_stats(self):
        return self.training or self.use_batch_stats_in_eval


class _MeanVarBatchNorm(BatchStatNorm):
    """Mean/variance BatchNorm over the real positions of x (*, D); subclasses choose which positions are real."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__(num_features, eps, momentum)
        self._stat_buffer("running_mean", 0.0)
        self._stat_buffer("running_var", 1.0)

    def _real(self, x, mask):
        raise NotImplementedError

    def forward(self, x, mask=None):
        self._float32_buffers()
        shape = x.shape
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self._uses_batch_stats():
            real = self._real(x, mask)  # (N,) bool
            mean, var, count = self._batch_stats(x2d, real)
            self._check_count(count)
            if self.training and not _recomputing():
                self._update_running(mean.detach(), var.detach(), count)
        else:
            mean, var = self.running_mean, self.running_var
        y = (x2d - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias
        return y.reshape(shape).to(x.dtype)

    def _batch_stats(self, x2d, real):
        """Mean and biased variance over the real rows, summed over processes when distributed.

        Two passes (sum -> mean, then sum of squared deviations) rather than E[x^2] - E[x]^2, which loses all
        precision in float32 when |mean| >> std; in distributed training that costs a second tiny all-reduce.
        """
        m = real.to(x2d.dtype).unsqueeze(-1)  # (N, 1)
        xr = torch.where(real.unsqueeze(-1), x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
        stats = torch.cat([xr.sum(dim=0), m.sum(dim=0)])  # (D + 1,): per-feature sums, real-token count
        stats = _all_reduce_sum(stats, sync=self.training)
        count = stats[-1]
        mean = stats[:-1] / count.clamp(min=1)
        sq = (((xr - mean) * m) ** 2).sum(dim=0)  # (D,)
        var = _all_reduce_sum(sq, sync=self.training) / count.clamp(min=1)
        return mean, var, count.item()

    @torch.no_grad()
    def _update_running(self, mean, var, count):
        drift = torch.sqrt(torch.mean((mean - self.running_mean) ** 2 / (self.running_var + self.eps)))
        drift = drift + _log_ratio_rms(var, self.running_var, self.eps)
        self.last_stat_drift = drift.detach()
        unbiased = var * (count / (count - 1))  # torch's BatchNorm stores the unbiased running variance
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)
        self.num_batches_tracked += 1


class NaiveBatchNorm(_MeanVarBatchNorm):
    """BatchNorm over every position of the padded (B, L, D) tensor, padding included: the cautionary variant.

    Pad positions enter the mean and variance, so a sequence's outputs depend on how much padding its batch has.
    Kept to measure that harm. Never synchronized across processes (like torch.nn.BatchNorm1d).
    """

    name = "batchnorm"
    sees_padding = True  # so the model keeps the padded layout for it: padding in the statistics is its point

    def _real(self, x, mask):
        return torch.ones(x.shape[:-1].numel(), dtype=torch.bool, device=x.device)

    def _batch_stats(self, x2d, real):
        var, mean = torch.var_mean(x2d, dim=0, correction=0)
        return mean, var, x2d.shape[0]


class MaskedBatchNorm(_MeanVarBatchNorm):
    """BatchNorm with statistics over real tokens only (from the attention mask); per-feature affine.

    In training with torch.distributed initialized (world size > 1), the masked per-feature sums, the sums of
    squared deviations and the real-token counts are all-reduced with the autograd-aware
    torch.distributed.nn.functional.all_reduce, so the statistics (and their gradients) are those of the global
    batch, as with SyncBatchNorm: neither padding nor the number of processes changes the result.
    """

    name = "masked_batchnorm"

    def _real(self, x, mask):
        return real_token_mask(x, mask)


class _PowerFunction(torch.autograd.Function):
    """PowerNorm's forward and approximate backward (Shen et al. 2020, Alg. 1; the authors' PowerFunction).

    Forward: z = x / sqrt(psi2 + eps), psi2 the batch's quadratic mean (warmup) or the running one (after);
    y = weight * z + bias. Backward: the gradient is taken *through z as if psi2 were a constant*, with the
    (running) correction term  g~ = g - (1 - alpha_bkw) * ema_gz * z,  dx = g~ / sqrt(psi2_batch + eps), and
    ema_gz += mean over real tokens of (g~ * z). Statistics are over real tokens only.
    """

    @staticmethod
    def forward(ctx, x2d, real, weight, bias, psi2_used, psi2_batch, ema_gz, alpha_bkw, eps):
        z = x2d * torch.rsqrt(psi2_used + eps)  # (N, D)
        ctx.save_for_backward(z, real, weight, psi2_batch, ema_gz)
        ctx.alpha_bkw, ctx.eps = alpha_bkw, eps
        return z * weight + bias

    @staticmethod
    def backward(ctx, dy):
        z, real, weight, psi2_batch, ema_gz = ctx.saved_tensors
        g = dy * weight  # (N, D)
        approx_g = g - (1 - ctx.alpha_bkw) * ema_gz * z
        m = real.to(z.dtype).unsqueeze(-1)
        count = _all_reduce_sum(m.sum())  # plain tensors here: no autograd inside backward
        gz = _all_reduce_sum((approx_g * z * m).sum(dim=0)) / count
        ema_gz.add_(gz)  # the authors' running gradient statistic: accumulated, scaled by (1 - alpha_bkw) in use
        dx = approx_g * torch.rsqrt(psi2_batch + ctx.eps)
        dw = (dy * z).sum(dim=0)
        db = dy.sum(dim=0)
        return dx, None, dw, db, None, None, None, None, None


class PowerNorm(BatchStatNorm):
    r"""PowerNorm (Shen et al., ICML 2020, "PowerNorm: Rethinking Batch Normalization in Transformers", Alg. 1),
    masked: statistics over real tokens only.

    Follows the authors' implementation, MaskPowerNorm in github.com/sIncerass/powernorm
    (fairseq/modules/norms/mask_powernorm.py):
      - `group_scaling` (default True, as there with group_num=1): each token is first divided by its own RMS over
        features, x / sqrt(mean_d x^2 + eps) (their GroupScaling1D).
      - No mean subtraction: the statistic is the quadratic mean psi^2 = mean over real tokens of x^2, per feature.
      - Forward: step t (1-based, counted in `iters`) normalizes with the batch psi^2 while t <= warmup_steps,
        with the running psi^2 afterwards. Running psi^2: during warmup (t < warmup_steps) first a cumulative
        average, running = running * (t-1)/t + psi2_b / t, then always running = a_f * running + (1 - a_f) * psi2_b.
      - Backward (`_PowerFunction`): psi^2 is treated as a constant and the missing term of the exact gradient
        is approximated with a running statistic of mean(g * z) (`ema_gz`, weighted by 1 - alpha_bkw), so the
        gradient does not depend on the other tokens of the batch; dx is scaled by the batch psi^2 as in the
        authors' code.
    Differences from the authors' code: the gradient statistic is averaged over real tokens only (theirs
    averages over pad positions too), and across processes when distributed.
    Eval: running psi^2 (or the batch's when `use_batch_stats_in_eval`).
    Gradient checkpointing: the rerun normalizes with the psi^2 its first run used (`_replayed_psi2`), and
    `ema_gz` still moves once per backward.
    """

    name = "powernorm"

    @classmethod
    def from_config(cls, config, dim):
        return cls(dim, eps=config.norm_eps, alpha_fwd=config.powernorm_alpha_fwd,
                   alpha_bkw=config.powernorm_alpha_bkw, warmup_steps=config.powernorm_warmup_steps)

    def __init__(self, num_features, eps=1e-5, alpha_fwd=0.9, alpha_bkw=0.9, warmup_steps=1000, group_scaling=True):
        super().__init__(num_features, eps, momentum=1 - alpha_fwd)
        self.alpha_fwd = alpha_fwd
        self.alpha_bkw = alpha_bkw
        self.warmup_steps = warmup_steps
        self.group_scaling = group_scaling
        self._stat_buffer("running_psi2", 1.0)
        self._stat_buffer("ema_gz", 0.0)
        self._last_forward = None  # (batch psi^2, psi^2 used) of the latest training forward

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, "
                f"warmup_steps={self.warmup_steps}, group_scaling={self.group_scaling}")

    def forward(self, x, mask=None):
        self._float32_buffers()
        shape = x.shape
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self.group_scaling:
            x2d = x2d * torch.rsqrt(x2d.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if not self._uses_batch_stats():
            y = x2d * torch.rsqrt(self.running_psi2 + self.eps) * self.weight + self.bias
            return y.reshape(shape).to(x.dtype)
        real = real_token_mask(x, mask)
        with torch.no_grad():  # psi^2 is a constant for autograd: PowerNorm's backward handles it
            xr = torch.where(real.unsqueeze(-1), x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
            stats = torch.cat([xr.pow(2).sum(dim=0), real.sum().to(x2d.dtype).reshape(1)])  # (D + 1,)
            stats = _all_reduce_sum(stats, sync=self.training)
            count = stats[-1].item()
            self._check_count(count)
            psi2_b = stats[:-1] / count
        if not self.training:
            y = x2d * torch.rsqrt(psi2_b + self.eps) * self.weight + self.bias
            return y.reshape(shape).to(x.dtype)
        psi2_used = self._replayed_psi2(psi2_b) if _recomputing() else self._training_step(psi2_b)
        y = _PowerFunction.apply(x2d, real, self.weight, self.bias, psi2_used, psi2_b, self.ema_gz,
                                 self.alpha_bkw, self.eps)
        return y.reshape(shape).to(x.dtype)

    @torch.no_grad()
    def _training_step(self, psi2_b):
        """Count the step, update the running psi^2; returns the psi^2 this forward normalizes with."""
        self.num_batches_tracked += 1
        t = int(self.num_batches_tracked)
        psi2_used = psi2_b if t <= self.warmup_steps else self.running_psi2.to(psi2_b.dtype, copy=True)
        self._last_forward = (psi2_b, psi2_used)  # for a checkpointed recomputation: see _replayed_psi2
        self.last_stat_drift = _log_ratio_rms(psi2_b, self.running_psi2, self.eps)
        if t < self.warmup_steps:
            self.running_psi2.mul_((t - 1) / t).add_(psi2_b / t)
        self.running_psi2.lerp_(psi2_b.to(self.running_psi2.dtype), 1 - self.alpha_fwd)
        return psi2_used

    def _replayed_psi2(self, psi2_b):
        """The psi^2 of the forward being recomputed: after warmup the running psi^2 from *before* that forward
        updated it, which only the latest training forward kept. The batch's psi^2 tells that it is the same one."""
        kept_b, psi2_used = self._last_forward or (None, None)
        if kept_b is None or not torch.allclose(kept_b, psi2_b, rtol=1e-4, atol=1e-6):
            raise RuntimeError(
                "powernorm under gradient checkpointing can only recompute its latest training forward: run each "
                "training forward's backward before the next training forward (gradient accumulation does)"
            )
        return psi2_used


def set_batch_stats_in_eval(module: nn.Module, flag: bool) -> int:
    """Set `use_batch_stats_in_eval` on every BatchStatNorm in a module tree; returns how many were set."""
    n = 0
    for m in module.modules():
        if isinstance(m, BatchStatNorm):
            m.use_batch_stats_in_eval = bool(flag)
            n += 1
    return n


# ---------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------

# One line per norm; the order is the order of `NORM_TYPES` in error messages and docs.
NORM_REGISTRY = {cls.name: cls for cls in (
    LayerNorm,
    CustomLayerNorm,
    RMSNorm,
    NaiveBatchNorm,
    MaskedBatchNorm,
    PowerNorm,
    DyT,
    Identity,
)}
NORM_TYPES = tuple(NORM_REGISTRY)
BATCH_STAT_NORMS = tuple(name for name, cls in NORM_REGISTRY.items() if cls.batch_stats)


def build_norm(config, dim=None) -> nn.Module:
    """The norm named by config.norm over the last dim `dim` (default config.hidden_size)."""
    if config.norm not in NORM_REGISTRY:
        raise ValueError(f"norm={config.norm!r} is not valid; choose one of: {', '.join(NORM_TYPES)}")
    return NORM_REGISTRY[config.norm].from_config(config, config.hidden_size if dim is None else dim)


__all__ = [
    "NORM_REGISTRY", "NORM_TYPES", "BATCH_STAT_NORMS", "Norm", "build_norm", "BatchStatNorm", "set_batch_stats_in_eval",
    "real_token_mask", "CustomLayerNorm", "LayerNorm", "RMSNorm", "NaiveBatchNorm", "MaskedBatchNorm", "PowerNorm", "DyT",
    "Identity",
]
