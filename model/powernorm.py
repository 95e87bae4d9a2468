"""PowerNorm (Shen et al., ICML 2020), the batch-statistics norm without mean subtraction: its own running statistic
(psi^2, the quadratic mean), its warmup and its approximate backward (an autograd Function) set it apart from the
mean/variance BatchNorms of batch_norms.py, whose base class (`BatchStatNorm`) and helpers it shares.
"""

import torch

from .base_norm import real_token_mask
from .batch_norms import (
    BatchStatNorm,
    all_reduce_sum,
    group_moments,
    log_ratio_rms,
    per_row,
    recomputing,
    stacked,
)
from .ops import compute_dtype


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
        # Pad rows are not tokens: the authors drop them before normalizing, so here they carry no gradient and take
        # no part in ema_gz. Without the mask the correction term below is non-zero at a pad row even where dy is
        # zero, and flows back into whatever was added to every row (a bias), so the padded layout would train
        # another model than the packed one, which has no pad rows.
        m = real.to(z.dtype).unsqueeze(-1)  # (N, 1)
        dy = dy * m
        approx_g = (dy * weight - (1 - ctx.alpha_bkw) * ema_gz * z) * m  # (N, D)
        count = all_reduce_sum(m.sum())  # plain tensors here: no autograd inside backward
        gz = all_reduce_sum((approx_g * z).sum(dim=0)) / count
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
            if recomputing():
                psi2_used = self._replayed_psi2(psi2_b)
            elif self._population is not None:  # precise BN: normalize as the next step would, update nothing
                self._population.add(x2d[real])
                self._population_stats.append((psi2_b,))
                psi2_used = self._psi2_to_use(psi2_b, int(self.num_batches_tracked) + 1)
            else:
                psi2_used = self._training_step(psi2_b)
            y = _PowerFunction.apply(x2d, real, self.weight, self.bias, per_row(psi2_used, groups),
                                     per_row(psi2_b, groups), self.ema_gz, self.alpha_bkw, self.eps)
        else:
            psi2 = per_row(psi2_b, groups) if self._uses_batch_stats() else self.running_psi2
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
        stats = all_reduce_sum(stats, sync=self._syncs())
        count = stats[-1].item()
        self._check_count(count)
        return stats[:-1] / count

    def _noise(self, stats, moments):
        # PowerNorm's one statistic, the mean square, against the population's
        return log_ratio_rms(stacked([p for (p,) in stats], self.num_features), moments.mean_square(), self.eps)

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
        self.last_stat_drift = log_ratio_rms(psi2_b, self.running_psi2, self.eps).mean()
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
