"""Every normalization layer NormLab can put in a block, behind one interface (`Norm`) and one registry.

Every norm is called as `norm(x, mask=None)`: x (B, L, D) or any (*, D), mask (B, L) with 1/True at real tokens.
Per-token norms ignore the mask; the batch-statistics family (`BatchStatNorm`) uses it, except the naive
`batchnorm`, whose point is that padding enters its statistics. The registry at the end (`register_norm`) holds
each name's class and preset arguments, NormLab's own and those registered from outside (a decorator, or a
`module:Class` name in the config); the valid `config.norm` names, `build_norm` and the one answer to "is this a
batch-statistics norm?" (each class's `batch_stats`: `uses_batch_statistics(name)`, `batch_statistics_norms(module)`)
derive from it. docs/model.md explains the norms and how to plug in your own.
"""

import importlib
import inspect
from collections.abc import Sequence

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
    def from_config(cls, config, dim: int, **preset) -> nn.Module:
        """`preset`: the registry entry's constructor arguments (`register_norm`); they win over the config's."""
        return cls(dim, **{"eps": config.norm_eps, **preset})

    def initial_values(self) -> dict[str, float]:
        return {"weight": 1.0, "bias": 0.0}


# --- LayerNorm, torch's and ours -------------------------------------------------------------------------------


class LayerNorm(Norm, nn.LayerNorm):
    """torch.nn.LayerNorm that accepts (and ignores) the padding mask: its statistics are per token."""

    name = "layernorm"

    def forward(self, x, mask=None):
        return super().forward(x)


class CustomLayerNorm(Norm, nn.LayerNorm):
    """The project's own LayerNorm: torch.nn.LayerNorm's constructor and parameters, its forward the operator
    `normlab::layer_norm` (layer_norm_op.py; a kernel package may register a faster one). Half-precision inputs
    are normalized in float32. No double backward. docs/model.md, "CustomLayerNorm", has the math."""

    name = "custom_layernorm"

    def forward(self, x, mask=None):
        nd = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - nd:]) != self.normalized_shape:
            raise ValueError(f"CustomLayerNorm expects input (*, {self.normalized_shape}), got {tuple(x.shape)}")
        if nd == 1:  # the usual case: the op normalizes the last dim, no reshapes
            return layer_norm(x, self.weight, self.bias, self.eps)[0]
        flat = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731 - (M,) parameters for the op
        y, _, _ = layer_norm(x.flatten(-nd), flat(self.weight), flat(self.bias), self.eps)
        return y.view(x.shape)


# --- Per-token norms without mean subtraction, and no norm ------------------------------------------------------


class RMSNorm(Norm, nn.RMSNorm):
    """torch.nn.RMSNorm (x / sqrt(mean(x^2) + eps) * weight) accepting (and ignoring) the padding mask."""

    name = "rmsnorm"

    def forward(self, x, mask=None):
        return super().forward(x)


class DyT(Norm, nn.Module):
    """Dynamic Tanh (Zhu et al., 2025, "Transformers without Normalization"): weight * tanh(alpha * x) + bias.
    No statistics at all; a learnable scalar alpha sets how early tanh squashes outliers."""

    name = "dyt"

    @classmethod
    def from_config(cls, config, dim, **preset):
        return cls(dim, **{"alpha_init": config.dyt_alpha_init, **preset})

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
    def from_config(cls, config, dim, **preset):
        return cls(**preset)

    def initial_values(self):
        return {}

    def forward(self, x, mask=None):
        return x


# --- The batch-statistics family -------------------------------------------------------------------------------


def _dist_world_size():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _all_reduce_sum(t, sync=True):
    """Sum over processes, differentiably (as SyncBatchNorm); `sync` only in training, which runs in lockstep."""
    if sync and _dist_world_size() > 1:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t)
    return t


def _recomputing() -> bool:
    """True while the autograd engine runs a backward pass: a norm's forward then is gradient checkpointing's
    recomputation, which must update no state. torch has no public query; torch.utils.checkpoint reads the same."""
    if torch.compiler.is_compiling():  # compiled backward graphs never rerun the Python forward
        return False
    return torch._C._current_graph_task_id() != -1


def _log_ratio_rms(var_b, var_r, eps):
    return torch.sqrt(torch.mean((torch.log(var_b + eps) - torch.log(var_r + eps)) ** 2))


class BatchStatNorm(Norm, nn.Module):
    """Base of the norms whose statistics come from the batch: batchnorm, masked_batchnorm, powernorm.

    Training normalizes with the batch's statistics and updates running ones (torch's momentum convention); eval
    uses the running ones, or the batch's when `use_batch_stats_in_eval` (to measure the train/eval gap).
    `last_stat_drift` is the batch's distance from the running statistics. A gradient-checkpointing rerun
    normalizes as the first run did and updates nothing. A training forward needs 2 real tokens at least. The
    running statistics stay float32 whatever the module's dtype. docs/model.md, "The batch-statistics norms".
    """

    name = "batch_stat_norm"  # each subclass has its registry name, used in error messages
    batch_stats = True
    affine = True  # a per-feature scale `weight` and shift `bias` after normalizing

    @classmethod
    def from_config(cls, config, dim, **preset):
        return cls(dim, **{"eps": config.norm_eps, "momentum": config.bn_momentum, **preset})

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self._stat_init = {}  # running-statistic buffer -> its initial value (`initial_values`)
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.use_batch_stats_in_eval = False
        if self.affine:
            self.weight = nn.Parameter(torch.ones(num_features))
            self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        # A buffer so it follows .to(device) and from_pretrained materialises it; not saved in checkpoints.
        self.register_buffer("last_stat_drift", torch.zeros((), dtype=torch.float32), persistent=False)

    def _stat_buffer(self, name, value: float):
        # explicit float32: from_pretrained(dtype=...) builds the model under another default dtype
        self.register_buffer(name, torch.full((self.num_features,), value, dtype=torch.float32))
        self._stat_init[name] = value

    def initial_values(self):
        affine = {"weight": 1.0, "bias": 0.0} if self.affine else {}
        return {**affine, "num_batches_tracked": 0, "last_stat_drift": 0.0, **self._stat_init}

    def _float32_buffers(self):
        """Half-precision floating buffers back to float32, in place (`.data`): every holder of the buffer object
        (FSDP, DDP's buffer broadcast) keeps seeing it."""
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
    """Mean/variance BatchNorm over the real positions of x (*, D); the naive one counts padding as real."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__(num_features, eps, momentum)
        self._stat_buffer("running_mean", 0.0)
        self._stat_buffer("running_var", 1.0)

    def forward(self, x, mask=None):
        self._float32_buffers()
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self._uses_batch_stats():
            real = real_token_mask(x, None if self.sees_padding else mask)  # (N,) bool
            mean, var, count = self._batch_stats(x2d, real)
            self._check_count(count)
            if self.training and not _recomputing():
                self._update_running(mean.detach(), var.detach(), count)
        else:
            mean, var = self.running_mean, self.running_var
        y = (x2d - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias
        return y.reshape(x.shape).to(x.dtype)

    def _batch_stats(self, x2d, real):
        """Mean and biased variance over the real rows, summed over processes when distributed. Two passes:
        E[x^2] - E[x]^2 loses all precision in float32 when |mean| >> std."""
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
    """BatchNorm over every position of the padded (B, L, D) tensor, padding included: the cautionary variant,
    kept to measure that harm. Never synchronized across processes (like torch.nn.BatchNorm1d)."""

    name = "batchnorm"
    sees_padding = True  # so the model keeps the padded layout for it: padding in the statistics is its point

    def _batch_stats(self, x2d, real):
        var, mean = torch.var_mean(x2d, dim=0, correction=0)
        return mean, var, x2d.shape[0]


class MaskedBatchNorm(_MeanVarBatchNorm):
    """BatchNorm with statistics over real tokens only, all-reduced across processes in training (autograd-aware,
    as SyncBatchNorm), so neither padding nor the number of processes changes the result; per-feature affine."""

    name = "masked_batchnorm"


class BatchCentering(BatchStatNorm):
    """x minus the per-feature mean over the batch's real rows: the part of batch normalization that subtracts what
    every sentence of a batch shares, with no division and no parameters. Not a block norm (it leaves each
    feature's scale alone, so it is not in the registry): the classifier's optional step between pooling and the
    linear layer (`config.center_pooled`), to test whether that subtraction alone is what BN does for the
    classifier. Running mean, eval and process sync as the other batch-statistics norms."""

    name = "batch_centering"
    affine = False

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__(num_features, eps, momentum)
        self._stat_buffer("running_mean", 0.0)

    def forward(self, x, mask=None):
        self._float32_buffers()
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self._uses_batch_stats():
            real = real_token_mask(x, mask).unsqueeze(-1)  # (N, 1)
            xr = torch.where(real, x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
            stats = _all_reduce_sum(torch.cat([xr.sum(dim=0), real.sum(dim=0).to(x2d.dtype)]), sync=self.training)
            count = stats[-1].item()
            self._check_count(count)
            mean = stats[:-1] / count
            if self.training and not _recomputing():
                self._update_running(mean.detach())
        else:
            mean = self.running_mean
        return (x2d - mean).reshape(x.shape).to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean):
        self.last_stat_drift = torch.sqrt(torch.mean((mean - self.running_mean) ** 2))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
        self.num_batches_tracked += 1


class _PowerFunction(torch.autograd.Function):
    """PowerNorm's forward y = weight * x / sqrt(psi2_used + eps) + bias, and the authors' approximate backward,
    which treats psi2 as a constant and corrects with the running statistic `ema_gz` (docs/model.md)."""

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
    """PowerNorm (Shen et al., ICML 2020, Alg. 1), masked: no mean subtraction, x / sqrt(psi^2 + eps) with psi^2
    the quadratic mean over real tokens per feature: the batch's during warmup, the running one after. Follows the
    authors' MaskPowerNorm (group scaling first, approximate backward in `_PowerFunction`); docs/model.md lists
    the details and the differences."""

    name = "powernorm"

    @classmethod
    def from_config(cls, config, dim, **preset):
        return cls(dim, **{"eps": config.norm_eps, "alpha_fwd": config.powernorm_alpha_fwd,
                           "alpha_bkw": config.powernorm_alpha_bkw, "warmup_steps": config.powernorm_warmup_steps,
                           **preset})

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
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self.group_scaling:  # each token divided by its own RMS first (the authors' GroupScaling1D)
            x2d = x2d * torch.rsqrt(x2d.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.training:
            real = real_token_mask(x, mask)
            psi2_b = self._batch_psi2(x2d, real)
            psi2_used = self._replayed_psi2(psi2_b) if _recomputing() else self._training_step(psi2_b)
            y = _PowerFunction.apply(x2d, real, self.weight, self.bias, psi2_used, psi2_b, self.ema_gz,
                                     self.alpha_bkw, self.eps)
        else:
            psi2 = self._batch_psi2(x2d, real_token_mask(x, mask)) if self._uses_batch_stats() else self.running_psi2
            y = x2d * torch.rsqrt(psi2 + self.eps) * self.weight + self.bias
        return y.reshape(x.shape).to(x.dtype)

    @torch.no_grad()  # psi^2 is a constant for autograd: _PowerFunction's backward accounts for it
    def _batch_psi2(self, x2d, real):
        """The batch's psi^2 (D,): mean of x^2 over the real rows, summed over processes in training."""
        xr = torch.where(real.unsqueeze(-1), x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
        stats = torch.cat([xr.pow(2).sum(dim=0), real.sum().to(x2d.dtype).reshape(1)])  # (D + 1,)
        stats = _all_reduce_sum(stats, sync=self.training)
        count = stats[-1].item()
        self._check_count(count)
        return stats[:-1] / count

    @torch.no_grad()
    def _training_step(self, psi2_b):
        """Count the step, update the running psi^2; returns the psi^2 this forward normalizes with."""
        self.num_batches_tracked += 1
        t = int(self.num_batches_tracked)
        psi2_used = psi2_b if t <= self.warmup_steps else self.running_psi2.to(psi2_b.dtype, copy=True)
        self._last_forward = (psi2_b, psi2_used)  # for a checkpointed recomputation: see _replayed_psi2
        self.last_stat_drift = _log_ratio_rms(psi2_b, self.running_psi2, self.eps)
        if t < self.warmup_steps:  # a cumulative average first, then the exponential one
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


def batch_statistics_norms(module: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: norm} of every norm in a module tree whose class declares `batch_stats`, in module order."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Norm) and m.batch_stats}


def set_batch_stats_in_eval(module: nn.Module, flag: bool) -> int:
    """Set `use_batch_stats_in_eval` on every batch-statistics norm in a module tree; returns how many were set."""
    norms = batch_statistics_norms(module).values()
    for m in norms:
        m.use_batch_stats_in_eval = bool(flag)
    return len(norms)


# --- Registry ----------------------------------------------------------------------------------------------------

NORM_REGISTRY: dict[str, type] = {}  # name -> class, in registration order (the order of error messages and docs)
NORM_PRESETS: dict[str, dict] = {}  # name -> the constructor arguments its entry fixes (empty for a plain class)


def register_norm(cls=None, *, name: str | None = None, **preset):
    """Register a norm class under `name` (default: its `name` attribute), built with the constructor arguments
    `preset` on top of what `from_config` reads from the config: a variant is an entry, not a new class (as HF's
    ACT2CLS). Works as a decorator, plain (`@register_norm`) or with arguments (`@register_norm(name=...)`), and
    from outside NormLab; a saved model carries the code of the entries it uses (norm_code.py). Returns `cls`."""
    if cls is None:
        return lambda c: register_norm(c, name=name, **preset)
    if not (isinstance(cls, type) and issubclass(cls, Norm) and issubclass(cls, nn.Module)):
        what = _origin(cls) if isinstance(cls, type) else repr(cls)
        raise ValueError(f"register_norm: {what} is not a norm class; subclass model.norms.Norm and torch.nn.Module")
    name = getattr(cls, "name", None) if name is None else name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_norm: {cls.__qualname__} has no registry name; set `name = ...` or pass name=")
    try:  # a misspelt argument fails here, not when a model is first built
        inspect.signature(cls).bind_partial(**preset)
    except TypeError as e:
        raise ValueError(f"register_norm: {name!r} presets {sorted(preset)}, but {cls.__qualname__} says: {e}") \
            from None
    old = NORM_REGISTRY.get(name)
    if old is not None and (_origin(old), NORM_PRESETS[name]) != (_origin(cls), preset):
        raise ValueError(f"register_norm: the norm name {name!r} is taken by {_origin(old)}; choose another name")
    NORM_REGISTRY[name], NORM_PRESETS[name] = cls, dict(preset)  # the same origin again: a reloaded module
    return cls


def _origin(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class RegisteredNames(Sequence):
    """The registered names (only the batch-statistics family's with `batch_stats_only`), read from the registry at
    each use: a norm registered after import (register_norm, a `module:Class` name) is a valid name from then on."""

    def __init__(self, batch_stats_only: bool = False):
        self.batch_stats_only = batch_stats_only

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, cls in NORM_REGISTRY.items() if cls.batch_stats or not self.batch_stats_only)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other):
        return isinstance(other, Sequence) and self._names() == tuple(other)

    def __repr__(self) -> str:
        return repr(self._names())


for _cls in (LayerNorm, CustomLayerNorm, RMSNorm, NaiveBatchNorm, MaskedBatchNorm, PowerNorm, DyT, Identity):
    register_norm(_cls)
# Variants: a registered class with preset constructor arguments.
register_norm(RMSNorm, name="rmsnorm_noweight", elementwise_affine=False)  # x / rms(x): no per-feature gain
register_norm(LayerNorm, name="layernorm_nobias", bias=False)  # gain, no shift (PaLM, nanoGPT's LayerNorm option)

BUILTIN_NORMS = frozenset(NORM_REGISTRY)  # the names this file defines: a checkpoint's own norms.py has them
NORM_TYPES = RegisteredNames()  # every valid `config.norm` name, at the time it is asked
BATCH_STAT_NORMS = RegisteredNames(batch_stats_only=True)  # to enumerate, not to ask


def _import_norm(path: str, key: str) -> type:
    """The class a `module:Class` name points to, imported (the module must be importable here) and registered
    under that name."""
    module_name, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return register_norm(obj, name=path)
    except (ImportError, AttributeError, ValueError) as e:
        problem = f"cannot import it ({e})" if not isinstance(e, ValueError) else str(e).removeprefix("register_norm: ")
        raise ValueError(f"{key}={path!r}: {problem}; give an importable module:Class of a norm (installed, or on "
                         f"PYTHONPATH) or one of: {', '.join(NORM_TYPES)}") from None


def norm_class(name: str, key: str = "norm") -> type:
    """The class registered as `name`; a `module:Class` name is imported and registered first. ValueError naming
    `key` and the valid names otherwise."""
    if name in NORM_REGISTRY:
        return NORM_REGISTRY[name]
    if isinstance(name, str) and ":" in name:
        return _import_norm(name, key)
    raise ValueError(f"{key}={name!r} is not valid; choose one of: {', '.join(NORM_TYPES)}, or give module:Class "
                     f"of a norm of your own")


def uses_batch_statistics(norm: str) -> bool:
    """Does the norm named `norm` (a `config.norm` name) normalize with batch statistics (running statistics, a
    train/eval gap, `bn/*` metrics)? What to ask where there is a config but no model yet."""
    return norm_class(norm).batch_stats


def build_norm(config, dim=None, norm: str | None = None) -> nn.Module:
    """The norm named `norm` (default config.norm) over the last dim `dim` (default config.hidden_size), with its
    registry entry's preset arguments."""
    name = norm or config.norm
    cls = norm_class(name)  # registers a module:Class name, and so its (empty) presets
    return cls.from_config(config, config.hidden_size if dim is None else dim, **NORM_PRESETS[name])


__all__ = [
    "NORM_REGISTRY", "NORM_PRESETS", "NORM_TYPES", "BATCH_STAT_NORMS", "BUILTIN_NORMS", "Norm", "register_norm",
    "norm_class", "build_norm", "BatchStatNorm",
    "uses_batch_statistics", "batch_statistics_norms", "set_batch_stats_in_eval", "real_token_mask", "CustomLayerNorm",
    "LayerNorm", "RMSNorm", "NaiveBatchNorm", "MaskedBatchNorm", "PowerNorm", "DyT", "Identity", "BatchCentering",
]
