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
from contextlib import contextmanager

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
    """(..., D) batch or group statistics against the running ones (D,) -> (...,): RMS log-ratio over features."""
    return torch.sqrt(torch.mean((torch.log(var_b + eps) - torch.log(var_r + eps)) ** 2, dim=-1))


# --- Ghost batches: statistics per group of sentences ------------------------------------------------------------


def ghost_groups(num_sentences: int, group_size: int | None) -> int:
    """How many groups of `group_size` sentences a batch of `num_sentences` holds (`config.bn_group_size`; None: one,
    the whole batch). A last run shorter than `group_size` joins the group before it, so that no group holds fewer
    than `group_size` sentences: none has noisier statistics than the size asked for."""
    return 1 if group_size is None else max(1, num_sentences // group_size)


def sentence_groups(num_sentences: int, group_size: int, device=None) -> torch.Tensor:
    """(B,) long: the group of each sentence of a batch, consecutive sentences together (see `ghost_groups`)."""
    last = ghost_groups(num_sentences, group_size) - 1
    return (torch.arange(num_sentences, device=device) // group_size).clamp(max=last)


def _group_sums(rows, group, num_groups):
    """rows (T, C), group (T,) -> (G, C): the sum of each group's rows (out-of-place index_add: differentiable)."""
    return rows.new_zeros(num_groups, rows.shape[-1]).index_add(0, group, rows)


def group_moments(x2d, real, group, num_groups):
    """Per group: count (G,) of the real rows, their mean (G, D) and biased variance (G, D). x2d (N, D), real (N,)
    bool, group (N,) long. Only the real rows enter, packed (T, D), each added to its group's sums; two passes (mean,
    then squared deviations from it) for the precision reason of `_MeanVarBatchNorm._batch_stats`."""
    xr, gr = x2d[real], group[real]  # (T, D), (T,)
    count = _group_sums(torch.ones_like(xr[:, :1]), gr, num_groups).squeeze(-1)  # (G,)
    mean = _group_sums(xr, gr, num_groups) / count.clamp(min=1).unsqueeze(-1)  # (G, D)
    var = _group_sums((xr - mean[gr]) ** 2, gr, num_groups) / count.clamp(min=1).unsqueeze(-1)  # (G, D)
    return count, mean, var


def _per_row(stat, groups):
    """A statistic for `_row_groups`' rows: (D,) stays (D,), for every row; (G, D) -> (N, D), each row's group's."""
    return stat if groups is None else stat[groups[0]]


class PopulationMoments:
    """Exact per-feature moments of every row given to `add`, over any number of batches: the count, the sum and the
    sum of squares, in float64 (E[x^2] - E[x]^2 in float32 loses the variance when |mean| >> std; in float64 it
    keeps ~1e-16 of it, whatever the number of tokens). What precise BN sets the running statistics to."""

    def __init__(self):
        self.count, self.sum, self.sum_sq = 0, 0.0, 0.0

    def add(self, rows):  # (n, D)
        r = rows.detach().double()
        self.count += r.shape[0]
        self.sum = self.sum + r.sum(dim=0)
        self.sum_sq = self.sum_sq + (r * r).sum(dim=0)

    def mean(self):
        return self.sum / self.count

    def var(self):  # unbiased, as the running variance
        return (self.sum_sq - self.sum**2 / self.count) / (self.count - 1)

    def mean_square(self):
        return self.sum_sq / self.count


class BatchStatNorm(Norm, nn.Module):
    """Base of the norms whose statistics come from the batch: batchnorm, masked_batchnorm, powernorm.

    Training normalizes with the batch's statistics and updates running ones (torch's momentum convention); eval
    uses the running ones, or the batch's when `use_batch_stats_in_eval` (to measure the train/eval gap).
    `last_stat_drift` is the batch's distance from the running statistics. A gradient-checkpointing rerun
    normalizes as the first run did and updates nothing. A training forward needs 2 real tokens at least. The
    running statistics stay float32 whatever the module's dtype. docs/model.md, "The batch-statistics norms".

    Ghost batches (`group_size`, config.bn_group_size): the statistics come from groups of `group_size` consecutive
    sentences of the batch (`sentence_groups`) instead of the whole batch; x's first dim indexes the sentences (the
    model runs such batches in the padded layout). Running statistics move once per forward, towards the mean of
    the groups' statistics (`_mean_over_groups`). docs/model.md, "Ghost batches".
    """

    name = "batch_stat_norm"  # each subclass has its registry name, used in error messages
    batch_stats = True
    affine = True  # a per-feature scale `weight` and shift `bias` after normalizing
    population = {}  # running-statistic buffer -> the PopulationMoments method precise BN sets it from

    @classmethod
    def from_config(cls, config, dim, **preset):
        return cls(dim, **{"eps": config.norm_eps, "momentum": config.bn_momentum,
                           "group_size": config.bn_group_size, **preset})

    def __init__(self, num_features, eps=1e-5, momentum=0.1, group_size=None):
        super().__init__()
        self._stat_init = {}  # running-statistic buffer -> its initial value (`initial_values`)
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.group_size = group_size  # sentences per group of statistics; None: the whole batch
        self.use_batch_stats_in_eval = False
        self._population = None  # a PopulationMoments while precise BN collects (`population_statistics`)
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
        groups = "" if self.group_size is None else f", group_size={self.group_size}"
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}{groups}"

    def _check_count(self, count):
        if torch.is_tensor(count):  # one per group (G,): the smallest decides
            count = float(count.min())
        if count < 2:
            where = "" if self.group_size is None else f" per group of {self.group_size} sentences (bn_group_size)"
            raise ValueError(
                f"{self.name} needs at least 2 real tokens{where} to compute batch statistics (in training, or in "
                f"eval with use_batch_stats_in_eval), got {int(count)}; use a larger batch or a per-token norm"
            )

    def _uses_batch_stats(self):
        return self.training or self.use_batch_stats_in_eval

    def _syncs(self) -> bool:
        """Whole-batch statistics are summed over processes in training (the global batch's); a ghost group lives
        in one process's batch, so its statistics are that process's alone."""
        return self.training and self.group_size is None

    def _row_groups(self, x):
        """(group of each row of x.reshape(-1, D) (N,), number of groups G), or None for one group: the whole
        batch, whose statistics take the plain path. x (B, ..., D): its first dim indexes the sentences."""
        B = x.shape[0] if x.dim() > 1 else 1
        if ghost_groups(B, self.group_size) == 1:
            return None
        rows_per_sentence = x[0].numel() // self.num_features  # L for (B, L, D), 1 for pooled vectors (B, D)
        group = sentence_groups(B, self.group_size, x.device).repeat_interleave(rows_per_sentence)  # (N,)
        return group, ghost_groups(B, self.group_size)

    def _mean_over_groups(self, *stats):
        """Each (G, D) -> (D,): the mean over the batch's groups, which running statistics move towards. The mean of
        what each group normalized with, once per forward: the update BatchNorm1d run on each group from the same
        running statistics would make, averaged; so `momentum` spans as many steps at every group size, and the
        group size changes only the noise of the normalization. With ghost groups, over every process's groups,
        so that the running statistics agree across processes."""
        num_groups = stats[0].new_tensor([stats[0].shape[0]])
        sums = _all_reduce_sum(torch.cat([s.sum(dim=0) for s in stats] + [num_groups]),
                               sync=self.training and self.group_size is not None)
        return (sums[:-1] / sums[-1]).split(self.num_features)

    def _after_training_forward(self, x2d, real, *stats):
        """A training forward's bookkeeping, skipped in a checkpointed rerun: while precise BN collects, add the
        forward's counted rows (x2d (N, D) where `real`) to the population; otherwise update the running
        statistics from `stats`."""
        if _recomputing():
            return
        if self._population is not None:
            self._population.add(x2d[real])
        else:
            self._update_running(*stats)

    def begin_population(self):
        """Precise BN: until `end_population`, training forwards normalize as in training but update no state; the
        rows whose statistics they use are added to exact population moments instead."""
        self._population = PopulationMoments()

    @torch.no_grad()
    def end_population(self, apply: bool = True):
        """Stop collecting; with `apply`, the running statistics become the population's (`population`)."""
        moments, self._population = self._population, None
        if not apply:
            return
        if moments is None or moments.count < 2:
            raise ValueError(f"{self.name}: precise BN needs at least 2 rows seen in training-mode forwards since "
                             f"begin_population, got {0 if moments is None else moments.count}")
        for buffer, moment in self.population.items():
            getattr(self, buffer).copy_(getattr(moments, moment)())


class _MeanVarBatchNorm(BatchStatNorm):
    """Mean/variance BatchNorm over the real positions of x (*, D); the naive one counts padding as real."""

    population = {"running_mean": "mean", "running_var": "var"}

    def __init__(self, num_features, eps=1e-5, momentum=0.1, group_size=None):
        super().__init__(num_features, eps, momentum, group_size)
        self._stat_buffer("running_mean", 0.0)
        self._stat_buffer("running_var", 1.0)

    def forward(self, x, mask=None):
        self._float32_buffers()
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self._uses_batch_stats():
            real = real_token_mask(x, None if self.sees_padding else mask)  # (N,) bool: the rows counted
            groups = self._row_groups(x)
            if groups is None:
                mean, var, count = self._batch_stats(x2d, real)  # (D,), (D,), a number
            else:
                count, mean, var = group_moments(x2d, real, *groups)  # (G,), (G, D), (G, D)
            self._check_count(count)
            if self.training:
                self._after_training_forward(x2d, real, mean.detach(), var.detach(), count)
            mean, var = _per_row(mean, groups), _per_row(var, groups)  # with groups, each row's group's (N, D)
        else:
            mean, var = self.running_mean, self.running_var
        y = (x2d - mean) * torch.rsqrt(var + self.eps)
        if self.affine:
            y = y * self.weight + self.bias
        return y.reshape(x.shape).to(x.dtype)

    def _batch_stats(self, x2d, real):
        """Mean and biased variance over the real rows, summed over processes when distributed. Two passes:
        E[x^2] - E[x]^2 loses all precision in float32 when |mean| >> std."""
        m = real.to(x2d.dtype).unsqueeze(-1)  # (N, 1)
        xr = torch.where(real.unsqueeze(-1), x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
        stats = torch.cat([xr.sum(dim=0), m.sum(dim=0)])  # (D + 1,): per-feature sums, real-token count
        stats = _all_reduce_sum(stats, sync=self._syncs())
        count = stats[-1]
        mean = stats[:-1] / count.clamp(min=1)
        sq = (((xr - mean) * m) ** 2).sum(dim=0)  # (D,)
        var = _all_reduce_sum(sq, sync=self._syncs()) / count.clamp(min=1)
        return mean, var, count.item()

    @torch.no_grad()
    def _update_running(self, mean, var, count):
        """mean, var: (D,) of the whole batch or (G, D) of its groups; count: their real tokens (a number or (G,))."""
        mean, var = mean.reshape(-1, self.num_features), var.reshape(-1, self.num_features)  # (G, D)
        count = torch.as_tensor(count, dtype=torch.float64, device=var.device).reshape(-1, 1)  # (G, 1)
        drift = torch.sqrt(torch.mean((mean - self.running_mean) ** 2 / (self.running_var + self.eps), dim=-1))
        drift = drift + _log_ratio_rms(var, self.running_var, self.eps)  # (G,): each group's distance
        self.last_stat_drift = drift.mean()
        unbiased = var * (count / (count - 1)).to(var.dtype)  # torch's BatchNorm stores the unbiased running variance
        new_mean, new_var = self._mean_over_groups(mean, unbiased)
        self.running_mean.lerp_(new_mean.to(self.running_mean.dtype), self.momentum)
        self.running_var.lerp_(new_var.to(self.running_var.dtype), self.momentum)
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
    population = {"running_mean": "mean"}

    def __init__(self, num_features, eps=1e-5, momentum=0.1, group_size=None):
        super().__init__(num_features, eps, momentum, group_size)
        self._stat_buffer("running_mean", 0.0)

    def forward(self, x, mask=None):
        self._float32_buffers()
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self._uses_batch_stats():
            real = real_token_mask(x, mask)  # (N,) bool
            groups = self._row_groups(x)
            if groups is None:
                xr = torch.where(real.unsqueeze(-1), x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
                stats = torch.cat([xr.sum(dim=0), real.sum().to(x2d.dtype).reshape(1)])  # (D + 1,)
                stats = _all_reduce_sum(stats, sync=self._syncs())
                count = stats[-1].item()
                mean = stats[:-1] / max(count, 1)  # (D,)
            else:
                count, mean, _ = group_moments(x2d, real, *groups)  # (G,), (G, D)
            self._check_count(count)
            if self.training:
                self._after_training_forward(x2d, real, mean.detach())
            mean = _per_row(mean, groups)
        else:
            mean = self.running_mean
        return (x2d - mean).reshape(x.shape).to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean):
        mean = mean.reshape(-1, self.num_features)  # (G, D)
        self.last_stat_drift = torch.sqrt(torch.mean((mean - self.running_mean) ** 2, dim=-1)).mean()
        (new_mean,) = self._mean_over_groups(mean)
        self.running_mean.lerp_(new_mean.to(self.running_mean.dtype), self.momentum)
        self.num_batches_tracked += 1


class BatchStandardization(_MeanVarBatchNorm):
    """Each feature minus its batch mean, divided by its batch standard deviation, over the real rows: masked BN
    without its per-feature scale and shift, so with no parameters. Like `BatchCentering`, not a block norm and not
    in the registry: the classifier's optional step between pooling and the linear layer
    (`config.pooled_norm="standardize"`), to test whether the batch's own scale of each feature, not only the
    subtraction of its mean, is what a BN final norm gives the classifier. Running statistics, eval, ghost groups
    and process sync as masked BN."""

    name = "batch_standardization"
    affine = False


class _PowerFunction(torch.autograd.Function):
    """PowerNorm's forward y = weight * x / sqrt(psi2_used + eps) + bias, and the authors' approximate backward,
    which treats psi2 as a constant and corrects with the running statistic `ema_gz` (docs/model.md). psi2_used
    and psi2_batch are (D,), or (N, D) with ghost batches: each row's group's."""

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
    population = {"running_psi2": "mean_square"}

    @classmethod
    def from_config(cls, config, dim, **preset):
        return cls(dim, **{"eps": config.norm_eps, "alpha_fwd": config.powernorm_alpha_fwd,
                           "alpha_bkw": config.powernorm_alpha_bkw, "warmup_steps": config.powernorm_warmup_steps,
                           "group_size": config.bn_group_size, **preset})

    def __init__(self, num_features, eps=1e-5, alpha_fwd=0.9, alpha_bkw=0.9, warmup_steps=1000, group_scaling=True,
                 group_size=None):
        super().__init__(num_features, eps, momentum=1 - alpha_fwd, group_size=group_size)
        self.alpha_fwd = alpha_fwd
        self.alpha_bkw = alpha_bkw
        self.warmup_steps = warmup_steps
        self.group_scaling = group_scaling
        self._stat_buffer("running_psi2", 1.0)
        self._stat_buffer("ema_gz", 0.0)
        self._last_forward = None  # (batch psi^2, psi^2 used) of the latest training forward

    def extra_repr(self):
        groups = "" if self.group_size is None else f", group_size={self.group_size}"
        return (f"{self.num_features}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, "
                f"warmup_steps={self.warmup_steps}, group_scaling={self.group_scaling}{groups}")

    def forward(self, x, mask=None):
        self._float32_buffers()
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self.group_scaling:  # each token divided by its own RMS first (the authors' GroupScaling1D)
            x2d = x2d * torch.rsqrt(x2d.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self._uses_batch_stats():
            real = real_token_mask(x, mask)
            groups = self._row_groups(x)
            psi2_b = self._batch_psi2(x2d, real, groups)  # (D,), or (G, D) one per group
        if self.training:
            if _recomputing():
                psi2_used = self._replayed_psi2(psi2_b)
            elif self._population is not None:  # precise BN: normalize as the next step would, update nothing
                self._population.add(x2d[real])
                psi2_used = self._psi2_to_use(psi2_b, int(self.num_batches_tracked) + 1)
            else:
                psi2_used = self._training_step(psi2_b)
            y = _PowerFunction.apply(x2d, real, self.weight, self.bias, _per_row(psi2_used, groups),
                                     _per_row(psi2_b, groups), self.ema_gz, self.alpha_bkw, self.eps)
        else:
            psi2 = _per_row(psi2_b, groups) if self._uses_batch_stats() else self.running_psi2
            y = x2d * torch.rsqrt(psi2 + self.eps) * self.weight + self.bias
        return y.reshape(x.shape).to(x.dtype)

    @torch.no_grad()  # psi^2 is a constant for autograd: _PowerFunction's backward accounts for it
    def _batch_psi2(self, x2d, real, groups=None):
        """The batch's psi^2 (D,): mean of x^2 over the real rows, summed over processes in training; with ghost
        groups, one per group (G, D), each from its own rows."""
        if groups is not None:
            count, mean_sq, _ = group_moments(x2d.pow(2), real, *groups)  # the mean of x^2 per group
            self._check_count(count)
            return mean_sq
        xr = torch.where(real.unsqueeze(-1), x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
        stats = torch.cat([xr.pow(2).sum(dim=0), real.sum().to(x2d.dtype).reshape(1)])  # (D + 1,)
        stats = _all_reduce_sum(stats, sync=self._syncs())
        count = stats[-1].item()
        self._check_count(count)
        return stats[:-1] / count

    def _psi2_to_use(self, psi2_b, t):
        """The psi^2 step t (1-based) normalizes with: the batch's (or its groups') during warmup, then the running."""
        return psi2_b if t <= self.warmup_steps else self.running_psi2.to(psi2_b.dtype, copy=True).expand_as(psi2_b)

    @torch.no_grad()
    def _training_step(self, psi2_b):
        """Count the step, update the running psi^2 from the batch's (the mean of its groups'); returns the psi^2
        this forward normalizes with."""
        self.num_batches_tracked += 1
        t = int(self.num_batches_tracked)
        psi2_used = self._psi2_to_use(psi2_b, t)
        self._last_forward = (psi2_b, psi2_used)  # for a checkpointed recomputation: see _replayed_psi2
        self.last_stat_drift = _log_ratio_rms(psi2_b, self.running_psi2, self.eps).mean()
        (psi2_mean,) = self._mean_over_groups(psi2_b.reshape(-1, self.num_features))
        if t < self.warmup_steps:  # a cumulative average first, then the exponential one
            self.running_psi2.mul_((t - 1) / t).add_(psi2_mean / t)
        self.running_psi2.lerp_(psi2_mean.to(self.running_psi2.dtype), 1 - self.alpha_fwd)
        return psi2_used

    def _replayed_psi2(self, psi2_b):
        """The psi^2 of the forward being recomputed: after warmup the running psi^2 from *before* that forward
        updated it, which only the latest training forward kept. The batch's psi^2 tells that it is the same one."""
        kept_b, psi2_used = self._last_forward or (None, None)
        if kept_b is None or kept_b.shape != psi2_b.shape or not torch.allclose(kept_b, psi2_b, rtol=1e-4, atol=1e-6):
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


@contextmanager
def population_statistics(norms):
    """Precise BN: inside, the training-mode forwards of the batch-statistics norms `norms` (e.g.
    `model.batch_statistics_norms().values()`) normalize as in training but update no state, and collect the exact
    statistics of the rows they count (this process's); on a clean exit each norm's running statistics become
    those population statistics. Keeping the old ones is the caller's choice (normlab/train/evaluation.py's
    `precise_bn` restores them)."""
    norms = list(norms)
    for m in norms:
        m.begin_population()
    finished = False
    try:
        yield
        finished = True
    finally:
        for m in norms:
            m.end_population(apply=finished)


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
    "ghost_groups", "sentence_groups", "group_moments", "population_statistics", "PopulationMoments",
    "LayerNorm", "RMSNorm", "NaiveBatchNorm", "MaskedBatchNorm", "PowerNorm", "DyT", "Identity", "BatchCentering",
    "BatchStandardization",
]
