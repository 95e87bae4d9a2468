"""The batch-statistics family: norms whose statistics come from the batch, not from each token.

Why they are apart from the per-token norms (norms.py): a per-token norm is a pure function of one token, but these
depend on the rest of the batch, so they carry state and modes a per-token norm has none of: running statistics
updated in training and used in eval (and the train/eval gap that comes with them), the padding mask (only real
tokens count, except in the naive `batchnorm`), sums over processes, ghost batches (statistics per group of
sentences), precise BN (running statistics set to exact population moments), and a gradient-checkpointing rerun that
must update nothing. PowerNorm, of the same family, is in powernorm.py. norms.py registers the block norms defined
here (batchnorm, masked_batchnorm) and re-exports every public name. docs/model.md, "The batch-statistics norms".
"""

from contextlib import contextmanager

import torch
import torch.nn as nn

from .base_norm import Norm, real_token_mask
from .ops import compute_dtype

# --- The batch-statistics family -------------------------------------------------------------------------------


def _dist_world_size():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def all_reduce_sum(t, sync=True):
    """Sum over processes, differentiably (as SyncBatchNorm); `sync` only in training, which runs in lockstep."""
    if sync and _dist_world_size() > 1:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t)
    return t


def recomputing() -> bool:
    """True while the autograd engine runs a backward pass: a norm's forward then is gradient checkpointing's
    recomputation, which must update no state. torch has no public query; torch.utils.checkpoint reads the same."""
    if torch.compiler.is_compiling():  # compiled backward graphs never rerun the Python forward
        return False
    return torch._C._current_graph_task_id() != -1


def log_ratio_rms(var_b, var_r, eps):
    """(..., D) batch or group statistics against the running ones (D,) -> (...,): RMS log-ratio over features."""
    return torch.sqrt(torch.mean((torch.log(var_b + eps) - torch.log(var_r + eps)) ** 2, dim=-1))


def stat_distance(mean, var, ref_mean, ref_var, eps):
    """(..., D) batch or group statistics against reference ones (D,) -> (...,): the RMS over features of the mean's
    offset in reference SDs, plus (given `var`) the RMS log-ratio of the variances. One distance for the drift from
    the running statistics and for the noise against the population's, so that the two read on one scale."""
    offset = torch.sqrt(torch.mean((mean - ref_mean) ** 2 / (ref_var + eps), dim=-1))
    return offset if var is None else offset + log_ratio_rms(var, ref_var, eps)


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


def per_row(stat, groups):
    """A statistic for `_row_groups`' rows: (D,) stays (D,), for every row; (G, D) -> (N, D), each row's group's."""
    return stat if groups is None else stat[groups[0]]


def stacked(tensors, num_features):
    """(D,) or (G, D) statistics of several forwards -> (all their groups, D) in float64, as the population's."""
    return torch.cat([t.reshape(-1, num_features) for t in tensors]).double()


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
    `last_stat_drift` is the batch's distance from the running statistics, which lag behind the moving weights;
    `stat_noise`, after precise BN's collection, the mean distance of its forwards' batch (or group) statistics from
    the population statistics of the same weights: the statistics' sampling noise alone. A gradient-checkpointing rerun
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
        self._population_stats = []  # each collecting forward's batch (or group) statistics
        self.stat_noise = None  # a float after a collection (not a buffer: precise BN restores every buffer)
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
        sums = all_reduce_sum(torch.cat([s.sum(dim=0) for s in stats] + [num_groups]),
                               sync=self.training and self.group_size is not None)
        return (sums[:-1] / sums[-1]).split(self.num_features)

    def _after_training_forward(self, x2d, real, *stats):
        """A training forward's bookkeeping, skipped in a checkpointed rerun: while precise BN collects, add the
        forward's counted rows (x2d (N, D) where `real`) to the population; otherwise update the running
        statistics from `stats`."""
        if recomputing():
            return
        if self._population is not None:
            self._population.add(x2d[real])
            self._population_stats.append(stats)
        else:
            self._update_running(*stats)

    def begin_population(self):
        """Precise BN: until `end_population`, training forwards normalize as in training but update no state; the
        rows whose statistics they use are added to exact population moments instead."""
        self._population = PopulationMoments()
        self._population_stats = []

    @torch.no_grad()
    def end_population(self, apply: bool = True):
        """Stop collecting; with `apply`, the running statistics become the population's (`population`)."""
        moments, self._population = self._population, None
        stats, self._population_stats = self._population_stats, []
        if not apply:
            return
        if moments is None or moments.count < 2:
            raise ValueError(f"{self.name}: precise BN needs at least 2 rows seen in training-mode forwards since "
                             f"begin_population, got {0 if moments is None else moments.count}")
        self.stat_noise = float(self._noise(stats, moments).mean())
        for buffer, moment in self.population.items():
            getattr(self, buffer).copy_(getattr(moments, moment)())

    def _noise(self, stats, moments):
        """(every group of every collecting forward,): its statistics' distance from the population's
        (`stat_distance`); `stats` are what each forward passed to `_after_training_forward`."""
        raise NotImplementedError


class _MeanVarBatchNorm(BatchStatNorm):
    """Mean/variance BatchNorm over the real positions of x (*, D); the naive one counts padding as real."""

    population = {"running_mean": "mean", "running_var": "var"}

    def __init__(self, num_features, eps=1e-5, momentum=0.1, group_size=None):
        super().__init__(num_features, eps, momentum, group_size)
        self._stat_buffer("running_mean", 0.0)
        self._stat_buffer("running_var", 1.0)

    def _noise(self, stats, moments):
        means, variances, _ = zip(*stats)  # each forward's (mean, biased variance, count)
        d = self.num_features
        return stat_distance(stacked(means, d), stacked(variances, d), moments.mean(), moments.var(), self.eps)

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
            mean, var = per_row(mean, groups), per_row(var, groups)  # with groups, each row's group's (N, D)
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
        stats = all_reduce_sum(stats, sync=self._syncs())
        count = stats[-1]
        mean = stats[:-1] / count.clamp(min=1)
        sq = (((xr - mean) * m) ** 2).sum(dim=0)  # (D,)
        var = all_reduce_sum(sq, sync=self._syncs()) / count.clamp(min=1)
        return mean, var, count.item()

    @torch.no_grad()
    def _update_running(self, mean, var, count):
        """mean, var: (D,) of the whole batch or (G, D) of its groups; count: their real tokens (a number or (G,))."""
        mean, var = mean.reshape(-1, self.num_features), var.reshape(-1, self.num_features)  # (G, D)
        count = torch.as_tensor(count, dtype=torch.float64, device=var.device).reshape(-1, 1)  # (G, 1)
        drift = stat_distance(mean, var, self.running_mean, self.running_var, self.eps)  # (G,): each group's
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

    def _noise(self, stats, moments):
        # no division here, but the offset is still read in the population's SDs, as masked BN's
        means = stacked([m for (m,) in stats], self.num_features)
        return stat_distance(means, None, moments.mean(), moments.var(), self.eps)

    def forward(self, x, mask=None):
        self._float32_buffers()
        x2d = x.reshape(-1, self.num_features).to(compute_dtype(x))  # (N, D)
        if self._uses_batch_stats():
            real = real_token_mask(x, mask)  # (N,) bool
            groups = self._row_groups(x)
            if groups is None:
                xr = torch.where(real.unsqueeze(-1), x2d, torch.zeros((), dtype=x2d.dtype, device=x2d.device))
                stats = torch.cat([xr.sum(dim=0), real.sum().to(x2d.dtype).reshape(1)])  # (D + 1,)
                stats = all_reduce_sum(stats, sync=self._syncs())
                count = stats[-1].item()
                mean = stats[:-1] / max(count, 1)  # (D,)
            else:
                count, mean, _ = group_moments(x2d, real, *groups)  # (G,), (G, D)
            self._check_count(count)
            if self.training:
                self._after_training_forward(x2d, real, mean.detach())
            mean = per_row(mean, groups)
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
