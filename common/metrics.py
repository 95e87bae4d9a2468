"""Stability metrics of the training loop, under the names the README lists (wandb and metrics.jsonl alike).

Cost model: nothing here runs on a step that is not a logging step except `StepCounters.add` (two tensor adds,
no host sync). On a logging step the model records its per-block activation sums of squares and attention-logit
maxima in the forward it runs anyway (`set_record_stability`), the loop takes per-block gradient norms with one
`torch._foreach_norm`, copies the block weights into one flat buffer before the optimizer step and diffs them
in place after it, and moves everything to the host in one `gather` (one collective, one sync).

Per-block metrics, for block i of `model.normlab.encoder.layers`:
  layers/{i}/grad_norm       L2 norm of the block's gradients, before clipping
  layers/{i}/act_rms         RMS of the residual stream after block i, over real (non-pad) tokens and features
  layers/{i}/attn_logit_max  largest pre-softmax attention logit q.k/sqrt(d_head) over heads and real tokens
  layers/{i}/update_ratio    ||w_after - w_before|| / ||w_before|| over all of the block's weights, for one step
  bn/{i}/stat_drift          BN family: mean over the block's batch-statistics norms of `last_stat_drift`
"""

import json
import math
import re
import time
from pathlib import Path

import torch

_LAYER = re.compile(r"(?:^|\.)encoder\.layers\.(\d+)\.")


def blocks_of(model) -> torch.nn.ModuleList:
    """The encoder blocks of a NormLab model with any head (`model.normlab.encoder.layers`)."""
    return model.base_model.encoder.layers


def block_parameters(model) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters per block i (names contain `encoder.layers.{i}.`), in block order."""
    groups = [[] for _ in blocks_of(model)]
    for name, p in model.named_parameters():
        m = _LAYER.search(name)
        if m and p.requires_grad:
            groups[int(m.group(1))].append(p)
    return groups


def _per_block_norm(tensors_by_block) -> torch.Tensor:
    """(N,) L2 norm of each block's list of tensors: one _foreach_norm, then a sum of squares per block."""
    flat = [t for group in tensors_by_block for t in group]
    if not flat:
        return torch.zeros(len(tensors_by_block))
    norms = torch.stack(torch._foreach_norm(flat)).float()  # (P,) one norm per tensor
    owner = torch.tensor([i for i, group in enumerate(tensors_by_block) for _ in group], device=norms.device)
    sq = torch.zeros(len(tensors_by_block), device=norms.device).index_add_(0, owner, norms * norms)
    return sq.sqrt()  # (N,)


class StabilityProbe:
    """Per-block stability measurements of one logging step (see the module docstring).

    Use, on a logging step: `arm()` before the forward, `read_forward(attention_mask)` after it,
    `read_grads(clip_coef)` after clipping, `snapshot()` before `optimizer.step()`, `read_update()` after it,
    then `collect()`.
    """

    def __init__(self, model, batch_stat_norm_cls=None):
        self.model = model  # unwrapped: attribute access to the blocks
        self.blocks = blocks_of(model)
        self.params = block_parameters(model)
        self.num_layers = len(self.blocks)
        self.bn_by_block = []
        if batch_stat_norm_cls is not None:
            self.bn_by_block = [[m for m in blk.modules() if isinstance(m, batch_stat_norm_cls)] for blk in self.blocks]
            if not any(self.bn_by_block):
                self.bn_by_block = []
        # The weight snapshot: all block weights in one flat float32 buffer (block after block), allocated at the
        # first snapshot, with one view of it per parameter for the in-place diff.
        self._flat_params = [p for group in self.params for p in group]
        self._block_sizes = [sum(p.numel() for p in group) for group in self.params]
        self._before = self._before_views = None
        self._reset()

    def _reset(self):
        self.act_sumsq = self.act_count = self.logit_max = self.grad_norm = None
        self._before_sq = None
        self.update_ratio = None

    def arm(self) -> None:
        self._reset()
        self.model.set_record_stability(True)

    @torch.no_grad()
    def read_forward(self, attention_mask) -> None:
        """Take what the armed forward recorded; attention_mask (B, L) of the batch it ran on."""
        mask = attention_mask.float()  # (B, L)
        self.act_sumsq = self.model.base_model.encoder.last_act_sumsq.float()  # (N,) over real tokens
        self.act_count = mask.sum() * self.model.config.hidden_size  # real tokens x features
        self.logit_max = torch.stack([
            blk.attention.last_logit_max.float() if blk.attention.last_logit_max is not None
            else torch.tensor(float("nan"), device=mask.device)
            for blk in self.blocks
        ])  # (N,)
        self.model.set_record_stability(False)  # (also clears what it recorded: read above first)

    @torch.no_grad()
    def read_grads(self, clip_coef: float) -> None:
        """Per-block grad norms before clipping. Read after `clip_grad_norm_` (which also unscales fp16
        gradients), so the clipped norms are divided by the clip coefficient that was applied."""
        grads = [[p.grad for p in group if p.grad is not None] for group in self.params]
        self.grad_norm = _per_block_norm(grads) / clip_coef

    def _block_sumsq(self, flat) -> torch.Tensor:
        """(N,) per-block sums of squares of a flat buffer laid out block after block."""
        norms = torch.stack(torch._foreach_norm(list(flat.split(self._block_sizes)))).double()  # (N,)
        return norms * norms

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the block weights before the optimizer step (and their squared norms, while they are at hand)."""
        params = self._flat_params
        if self._before is None:
            device = params[0].device if params else None
            self._before = torch.empty(sum(self._block_sizes), device=device)  # float32
            self._before_views = [v.view(p.shape) for v, p in zip(self._before.split([p.numel() for p in params]),
                                                                     params)]
        torch.cat([p.reshape(-1).float() for p in params], out=self._before)  # one pass
        self._before_sq = self._block_sumsq(self._before)  # one read

    @torch.no_grad()
    def read_update(self) -> None:
        """||w_after - w_before|| / ||w_before|| per block."""
        if self._flat_params:
            torch._foreach_sub_(self._before_views, self._flat_params)  # the snapshot becomes w_before - w_after
        diff_sq = self._block_sumsq(self._before)
        self.update_ratio = (diff_sq / self._before_sq.clamp_min(1e-24)).sqrt().float()  # (N,)
        self._before_sq = None

    def stat_drift(self) -> torch.Tensor | None:
        if not self.bn_by_block:
            return None
        return torch.stack([
            torch.stack([m.last_stat_drift.float() for m in norms]).mean() if norms else torch.tensor(float("nan"))
            for norms in self.bn_by_block
        ])  # (N,)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ multiplied the gradients by (same formula)."""
    return min(1.0, max_norm / (total_norm + 1e-6)) if math.isfinite(total_norm) else 1.0


class StepCounters:
    """What the hot path accumulates between logging steps, as device tensors (no host sync per step)."""

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self):
        self.loss_sum = torch.zeros((), device=self.device)
        self.loss_count = 0  # micro-batches
        self.real_tokens = torch.zeros((), device=self.device)
        self.all_tokens = 0
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.loss_sum += loss.detach().float()
        self.loss_count += 1
        self.real_tokens += attention_mask.sum()
        self.all_tokens += attention_mask.numel()


def gather_row(accelerator, counters: StepCounters, probe: StabilityProbe | None, grad_norm: float, lr: float):
    """One metrics row (the README's metric names) from this process's counters and probe, combined over processes in a
    single gather: sums for token counts and squared activations, mean for the loss, max for logit maxima.
    Gradient norms and update ratios are the same on every process (gradients are all-reduced)."""
    n = probe.num_layers if probe is not None else 0
    dev = counters.device
    drift = probe.stat_drift() if probe is not None else None
    sums = [counters.real_tokens.float().reshape(1), torch.tensor([float(counters.all_tokens)], device=dev)]
    means = [(counters.loss_sum / max(counters.loss_count, 1)).reshape(1)]
    maxes = []
    if probe is not None:
        sums += [probe.act_sumsq.to(dev), probe.act_count.float().reshape(1).to(dev)]
        maxes += [probe.logit_max.to(dev)]
        if drift is not None:
            means += [drift.to(dev)]
    local = torch.cat(sums + means + maxes).float()  # (K,)
    everyone = accelerator.gather(local.unsqueeze(0)).reshape(accelerator.num_processes, -1)  # (P, K)
    n_sum = sum(t.numel() for t in sums)
    n_mean = sum(t.numel() for t in means)
    combined = torch.cat([
        everyone[:, :n_sum].sum(0), everyone[:, n_sum:n_sum + n_mean].mean(0), everyone[:, n_sum + n_mean:].amax(0)
    ]).tolist()  # the one host sync
    real, total = combined[0], combined[1]
    i = 2
    row = {}
    if probe is not None:
        act_sumsq, act_count = combined[i:i + n], combined[i + n]
        i += n + 1
    row["train/loss"] = combined[i]
    i += 1
    elapsed = time.perf_counter() - counters.t0
    row["train/lr"] = lr
    row["train/grad_norm"] = grad_norm
    row["train/pad_fraction"] = 1.0 - real / total if total else 0.0
    row["train/tokens_per_s"] = real / elapsed if elapsed > 0 else 0.0
    if probe is not None:
        drift_vals = None
        if drift is not None:
            drift_vals, i = combined[i:i + n], i + n
        logit_max = combined[i:i + n]
        grad_norms = probe.grad_norm.tolist()
        ratios = probe.update_ratio.tolist() if probe.update_ratio is not None else [float("nan")] * n
        for layer in range(n):
            row[f"layers/{layer}/grad_norm"] = grad_norms[layer]
            row[f"layers/{layer}/act_rms"] = math.sqrt(act_sumsq[layer] / act_count) if act_count else 0.0
            row[f"layers/{layer}/attn_logit_max"] = logit_max[layer]
            row[f"layers/{layer}/update_ratio"] = ratios[layer]
        if drift_vals is not None:
            for layer in range(n):
                row[f"bn/{layer}/stat_drift"] = drift_vals[layer]
    return row


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/inf; events/nonfinite says what happened
    return value


class MetricsWriter:
    """metrics.jsonl: one JSON object per line, flushed per line, so a killed run loses at most one line.
    Main process only."""

    def __init__(self, path, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is None:
            self.path.write_text("")
        else:
            self._rewind(resume_step)
        self.file = open(self.path, "a")

    def _rewind(self, step: int) -> None:
        """Drop the rows after the checkpoint being resumed from: the resumed run writes them again."""
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # the half line a kill can leave
                if row.get("step", 0) <= step:
                    kept.append(line)
        from common.checkpointing import atomic_write_text

        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, row: dict) -> None:
        self.file.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path) -> list[dict]:
    """All rows of a metrics.jsonl (skipping a torn last line)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


__all__ = [
    "blocks_of", "block_parameters", "StabilityProbe", "clip_coefficient", "StepCounters", "gather_row",
    "MetricsWriter", "read_metrics",
]
