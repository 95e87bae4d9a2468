"""The stability probe: the training loop's per-step stability metrics, under the names docs/architecture.md
lists ("Metric names"; how the probe keeps them off the training step: "The stability probe"). It reads the model
only through what the model declares: its named taps (`taps()`) and its batch-statistics norms
(`batch_statistics_norms()`)."""

import math
import time
from contextlib import contextmanager

import torch


def block_taps(model, what: str = "") -> list[torch.nn.Module]:
    """The model's tap `layers.{i}.<what>` (`layers.{i}`, the block itself, for what="") of every encoder block i,
    in block order."""
    taps = model.taps()
    return [taps[f"layers.{i}" + (f".{what}" if what else "")] for i in range(model.config.num_hidden_layers)]


def block_parameters(model) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters per encoder block, in block order."""
    return [[p for p in block.parameters() if p.requires_grad] for block in block_taps(model)]


def bn_by_block(model) -> list[list[torch.nn.Module]]:
    """The batch-statistics norms inside each encoder block, in block order (the final norm and the pooled
    vector's are in none): what the per-block `bn/{i}/...` metrics average over."""
    stat_norms = set(model.batch_statistics_norms().values())
    return [[m for m in block.modules() if m in stat_norms] for block in block_taps(model)]


def _per_block_norm(tensors_by_block) -> torch.Tensor:
    """(N,) L2 norm of each block's list of tensors: one _foreach_norm, then a sum of squares per block."""
    flat = [t for group in tensors_by_block for t in group]
    if not flat:
        return torch.zeros(len(tensors_by_block))
    norms = torch.stack(torch._foreach_norm(flat)).float()  # (P,) one norm per tensor
    owner = torch.tensor([i for i, group in enumerate(tensors_by_block) for _ in group], device=norms.device)
    sq = torch.zeros(len(tensors_by_block), device=norms.device).index_add_(0, owner, norms * norms)
    return sq.sqrt()  # (N,)


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


# How each measured quantity combines over processes. Gradient norms and update ratios need none: gradients are
# all-reduced, so they are the same on every process.
_ACROSS_PROCESSES = {
    "real_tokens": lambda x: x.sum(0), "all_tokens": lambda x: x.sum(0), "loss": lambda x: x.mean(0),
    "act_sumsq": lambda x: x.sum(0), "act_count": lambda x: x.sum(0), "logit_max": lambda x: x.amax(0),
    "stat_drift": lambda x: x.mean(0),
}


class StabilityProbe:
    """`count` on every micro-batch; on a logging step, `forward` around the forward and `update` around the
    optimizer step (after clipping) take the per-block measurements, and `collect` makes them one metrics row,
    combined over processes. Build it before the model's first forward: torch.compile traces the hooks present at
    its first call. The steps inside the contexts are public for the tests that check each measurement.
    """

    def __init__(self, model):
        self.model = model  # unwrapped: the taps are its own modules
        self.params = block_parameters(model)
        self.counters = StepCounters(next(model.parameters()).device)
        self.recorder = ForwardRecorder(block_taps(model, "attention_logits"), block_taps(model, "output"))
        bn = bn_by_block(model)
        self.bn_by_block = bn if any(bn) else []
        # The weight snapshot: all block weights in one flat float32 buffer (block after block), allocated at the
        # first snapshot, with one view of it per parameter for the in-place diff.
        self._flat_params = [p for group in self.params for p in group]
        self._block_sizes = [sum(p.numel() for p in group) for group in self.params]
        self._before = self._before_views = None
        self._reset()

    def _reset(self):
        self.act_sumsq = self.act_count = self.logit_max = self.grad_norm = self.update_ratio = None
        self._before_sq = None

    def count(self, loss: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.counters.add(loss, attention_mask)

    @contextmanager
    def forward(self, attention_mask):
        """Record the stability quantities of the forward run inside."""
        self.arm()
        try:
            yield
        finally:
            self.read_forward(attention_mask)

    @contextmanager
    def update(self, grad_norm: float, max_grad_norm: float):
        """Per-block gradient norms and the weight snapshot before the optimizer step inside; update ratios after."""
        self.read_grads(clip_coefficient(grad_norm, max_grad_norm))
        self.snapshot()
        yield
        self.read_update()

    def collect(self, accelerator, grad_norm: float, lr: float, measured: bool = True) -> dict:
        """One metrics row combined over processes; restarts the counters. `measured` False: the counters only
        (a step whose measurements were not taken, e.g. a non-finite one)."""
        local = self._local_values(measured)
        everyone = accelerator.gather({k: v.unsqueeze(0) for k, v in local.items()})  # each (P, ...)
        combined = _to_host({k: _ACROSS_PROCESSES[k](v.reshape(accelerator.num_processes, *local[k].shape))
                             for k, v in everyone.items()})
        row = self._counter_metrics(combined, grad_norm, lr)
        if measured:
            row.update(self._block_metrics(combined))
        self.counters.reset()
        return row

    def arm(self) -> None:
        self._reset()
        self.recorder.arm()

    @torch.no_grad()
    def read_forward(self, attention_mask) -> None:
        """Take what the armed forward recorded; attention_mask (B, L) of the batch it ran on."""
        mask = attention_mask.float()  # (B, L)
        self.act_sumsq = torch.stack(self.recorder.sumsq).float()  # (N,) over real tokens
        self.act_count = mask.sum() * self.model.config.hidden_size  # real tokens x features
        nan = torch.tensor(float("nan"), device=mask.device)  # a block whose attention recorded nothing
        self.logit_max = torch.stack([m.float() if m is not None else nan for m in self.recorder.logit_max])  # (N,)
        self.recorder.disarm()

    @torch.no_grad()
    def read_grads(self, clip_coef: float) -> None:
        """Per-block grad norms before clipping: read after `clip_grad_norm_` (which also unscales fp16 gradients),
        divided by the clip coefficient it applied."""
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

    def _local_values(self, measured: bool) -> dict[str, torch.Tensor]:
        """This process's values, float32 on the counters' device, keyed as in _ACROSS_PROCESSES."""
        c, dev = self.counters, self.counters.device
        local = {"real_tokens": c.real_tokens.float(), "all_tokens": torch.tensor(float(c.all_tokens), device=dev),
                 "loss": c.loss_sum / max(c.loss_count, 1)}
        if measured:
            local.update(act_sumsq=self.act_sumsq, act_count=self.act_count.float(), logit_max=self.logit_max)
            if self.bn_by_block:  # (N,) mean of each block's BN drifts
                local["stat_drift"] = torch.stack([
                    torch.stack([m.last_stat_drift.float() for m in norms]).mean() if norms
                    else torch.tensor(float("nan")) for norms in self.bn_by_block])
        return {k: v.to(dev).float() for k, v in local.items()}

    def _counter_metrics(self, combined: dict, grad_norm: float, lr: float) -> dict:
        (real,), (total,) = combined["real_tokens"], combined["all_tokens"]
        elapsed = time.perf_counter() - self.counters.t0
        return {"train/loss": combined["loss"][0], "train/lr": lr, "train/grad_norm": grad_norm,
                "train/pad_fraction": 1.0 - real / total if total else 0.0,
                "train/tokens_per_s": real / elapsed if elapsed > 0 else 0.0}

    def _block_metrics(self, combined: dict) -> dict:
        n, (act_count,) = len(self.params), combined["act_count"]
        grad_norms = self.grad_norm.tolist()
        ratios = self.update_ratio.tolist() if self.update_ratio is not None else [float("nan")] * n
        row = {}
        for layer in range(n):
            row[f"layers/{layer}/grad_norm"] = grad_norms[layer]
            row[f"layers/{layer}/act_rms"] = math.sqrt(combined["act_sumsq"][layer] / act_count) if act_count else 0.0
            row[f"layers/{layer}/attn_logit_max"] = combined["logit_max"][layer]
            row[f"layers/{layer}/update_ratio"] = ratios[layer]
        for layer, drift in enumerate(combined.get("stat_drift", [])):
            row[f"bn/{layer}/stat_drift"] = drift
        return row


class ForwardRecorder:
    """Forward hooks on the model's taps that record, while armed, each block's sum of squares of the residual
    stream it outputs (its `output` tap) and its attention's largest logit (its `attention_logits` tap).
    Disarmed, they return at once; they stay registered, as torch.compile guards on `armed`."""

    def __init__(self, logits_taps, output_taps):
        self.armed = False
        self.sumsq = [None] * len(output_taps)  # (N,) 0-dim tensors
        self.logit_max = [None] * len(logits_taps)
        for i, (logits_tap, output_tap) in enumerate(zip(logits_taps, output_taps, strict=True)):
            logits_tap.register_forward_hook(self._logits_hook(i), with_kwargs=True)
            output_tap.register_forward_hook(self._output_hook(i), with_kwargs=True)

    def arm(self) -> None:
        self.sumsq = [None] * len(self.sumsq)
        self.logit_max = [None] * len(self.logit_max)
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def _logits_hook(self, i: int):
        def record(tap, args, kwargs, output) -> None:  # the AttentionLogitsTap contract: query, key, layout
            if self.armed:
                self.logit_max[i] = attention_logit_max(kwargs["query"], kwargs["key"], kwargs["layout"], tap.scale)
        return record

    def _output_hook(self, i: int):
        def record(tap, args, kwargs, output) -> None:  # the Tap contract: output is the block's, kwargs the layout
            if self.armed:
                self.sumsq[i] = real_sumsq(output.detach(), kwargs["layout"])
        return record


def real_sumsq(x, layout) -> torch.Tensor:
    """Sum of x**2 over the real tokens' features, x a block's output: packed (1, T, D) or padded (B, L, D)."""
    if layout.norm_mask is None:  # every row is a real token (packed layout, or no padding): one dot product
        flat = x.reshape(-1).float()
        return torch.dot(flat, flat)
    # padded layout: the pad positions dropped, whatever the block left there (the encoder zeroes them after it)
    return x.float().square().sum(-1).masked_fill(~layout.norm_mask, 0.0).sum()


@torch.no_grad()
def attention_logit_max(q, k, layout, scale: float) -> torch.Tensor:
    """Largest pre-softmax logit q.k * scale over heads, real queries and real keys; q, k (B, H, L, Dh). In float32
    with autocast off, as half-precision logits overflow; scaled after the max (the same number: rounding is
    monotonic), which saves a pass over the (B, H, L, L) logits."""
    with torch.autocast(q.device.type, enabled=False):
        logits = torch.matmul(q.float(), k.float().transpose(-2, -1))  # (B, H, L, L)
    if layout.mask is None:
        return logits.amax() * scale
    B, L = layout.mask.shape
    row_max = logits.masked_fill_(layout.pad.view(B, 1, 1, L), float("-inf")).amax(-1)  # (B, H, L): real keys
    return row_max.masked_fill_(layout.pad.view(B, 1, L), float("-inf")).amax() * scale  # real queries


def _to_host(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Every tensor of the dict as a list of floats, in one device-to-host copy (one sync)."""
    host = torch.cat([t.reshape(-1) for t in tensors.values()]).cpu()
    return {k: part.tolist() for k, part in zip(tensors, host.split([t.numel() for t in tensors.values()]))}


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ multiplied the gradients by (same formula)."""
    return min(1.0, max_norm / (total_norm + 1e-6)) if math.isfinite(total_norm) else 1.0

