"""The one scorer (train.py, scripts/evaluate.py, the study): batches in, per-example loss, prediction, confidence,
label and index out."""

import copy
import itertools
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from model.norms import population_statistics
from normlab.train.step import model_inputs


def _per_example(logits, labels, task: str) -> dict[str, torch.Tensor]:
    if task == "mlm":  # logits (B, L, V), labels (B, L) with -100 off the masked positions
        target = labels != -100
        tok_loss = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")  # (B, L)
        return {"loss": (tok_loss * target).sum(1), "count": target.sum(1).float(),
                "correct": ((logits.argmax(-1) == labels) & target).sum(1).float()}
    # logits (B, C), labels (B,) or None (unlabelled rows: predictions only)
    probabilities = logits.softmax(-1)
    prediction = logits.argmax(-1)
    scores = {"prediction": prediction, "probabilities": probabilities,
              "confidence": probabilities.gather(1, prediction[:, None]).squeeze(1)}  # the predicted class's
    if labels is not None:
        loss = F.cross_entropy(logits, labels, reduction="none")
        scores.update(loss=loss, count=torch.ones_like(loss), correct=(prediction == labels).float(), label=labels)
    return scores


def _forward_scores(accelerator, model, batches, task: str) -> list[dict]:
    device = next(model.parameters()).device  # a prepared loader's batches are there already
    scored = []
    for batch in batches:
        inputs = {k: v.to(device) for k, v in model_inputs(batch).items() if k != "labels"}
        labels = batch["labels"].to(device) if "labels" in batch else None
        scores = _per_example(model(**inputs).logits.float(), labels, task)
        if "index" in batch:
            scores["index"] = batch["index"].to(device)
        scored.append(accelerator.gather_for_metrics(scores) if accelerator is not None else scores)
    return scored


@torch.no_grad()
def score_batches(accelerator, model, batches, task: str = "classification", seed: int = 0,
                  batch_stats: bool = False) -> list[dict]:
    """Per batch, a dict of per-example tensors: `loss` (summed over the example's targets), `count` (1, or its
    masked tokens for mlm), `correct`; for classification `prediction`, `confidence` (the predicted class's
    probability), `probabilities` and `label` (unlabelled rows: the predictions only); the batch's `index`.

    `accelerator`: gathered over processes once each (gather_for_metrics); None: this process's batches.
    `batch_stats`: the BN family normalizes each batch with its own statistics instead of the running ones.
    Runs in eval mode under a forked RNG seeded with `seed`: the same MLM masks every time, and the caller's RNG
    (dropout) untouched."""
    core = accelerator.unwrap_model(model) if accelerator is not None else model
    if batch_stats and not core.batch_stats_in_eval(True):
        raise ValueError(f"batch_stats=True: the {core.config.norm} model has no batch-statistics norms")
    was_training = model.training
    model.eval()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return _forward_scores(accelerator, model, batches, task)
    finally:
        model.train(was_training)
        if batch_stats:
            core.batch_stats_in_eval(False)


def in_row_order(batches: list[dict], keys) -> dict[str, torch.Tensor]:
    """score_batches' per-batch dicts (each with `index`) -> {key: one CPU tensor over all rows, in row order}."""
    if not batches:
        return {k: torch.zeros(0) for k in keys}
    every = {k: torch.cat([b[k].cpu() for b in batches]) for k in ("index", *keys)}
    order = every["index"].argsort()
    return {k: every[k][order] for k in keys}


def evaluate(accelerator, model, loader, task: str, seed: int, batch_stats: bool = False, prefix: str = "eval") -> dict:
    """Loss and accuracy over the whole loader (classification: per example; mlm: per masked token), named
    `prefix`/loss and `prefix`/accuracy."""
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, targets, correct
    for scores in score_batches(accelerator, model, loader, task, seed, batch_stats):
        totals += torch.stack([scores["loss"], scores["count"], scores["correct"]], dim=1).sum(0).double().cpu()
    loss_sum, n, correct = totals.tolist()
    return {f"{prefix}/loss": loss_sum / max(n, 1), f"{prefix}/accuracy": correct / max(n, 1)}


def precise_bn_batches(train_loader, n: int) -> list[dict]:
    """The first `n` batches of the (unprepared) training loader's epoch-0 order, collated once: what precise BN
    recomputes the statistics over, the same batches at every evaluation, so that between evaluations only the
    weights change them. The training loader itself and the RNG are left as they were (the MLM collator draws)."""
    sampler = copy.deepcopy(train_loader.batch_sampler)
    sampler.set_epoch(0)
    with torch.random.fork_rng(devices=[]):
        return [train_loader.collate_fn([train_loader.dataset[i] for i in indices])
                for indices in itertools.islice(iter(sampler), n)]


@contextmanager
def precise_bn(accelerator, model, batches):
    """Precise BN (Wu & Johnson 2021, "Rethinking 'Batch' in BatchNorm"): inside, the running statistics of the BN
    family are the population statistics of `batches` (precise_bn_batches): every feature's exact mean and variance
    (PowerNorm: mean square) over the rows each norm counts, collected by forwards in training mode (dropout and
    batch statistics as in training) without gradients. On exit the running statistics, the train/eval mode and
    the RNG are as they were: training goes on undisturbed."""
    core = accelerator.unwrap_model(model) if accelerator is not None else model
    norms = list(core.batch_statistics_norms().values())
    saved = [{name: b.clone() for name, b in m.named_buffers(recurse=False)} for m in norms]
    was_training = model.training
    device = next(model.parameters()).device
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            model.train()
            with torch.no_grad(), population_statistics(norms):
                for batch in batches:
                    model(**{k: v.to(device) for k, v in model_inputs(batch).items() if k != "labels"})
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for name, b in m.named_buffers(recurse=False):
                    b.copy_(buffers[name])  # in place: every holder of the buffer (DDP, FSDP) sees it
        model.train(was_training)
