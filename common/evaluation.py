"""The evaluation pass of train.py and scripts/evaluate.py: per-example loss, targets and hits over a loader."""

import torch
import torch.nn.functional as F

from common.step import model_inputs


def _per_example(logits, labels, task: str) -> dict[str, torch.Tensor]:
    if task == "mlm":  # logits (B, L, V), labels (B, L) with -100 off the masked positions
        target = labels != -100
        tok_loss = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")  # (B, L)
        return {"loss": (tok_loss * target).sum(1), "count": target.sum(1).float(),
                "correct": ((logits.argmax(-1) == labels) & target).sum(1).float()}
    # logits (B, C), labels (B,)
    loss = F.cross_entropy(logits, labels, reduction="none")
    prediction = logits.argmax(-1)
    confidence = logits.softmax(-1).gather(1, prediction[:, None]).squeeze(1)  # the predicted class's probability
    return {"loss": loss, "count": torch.ones_like(loss), "correct": (prediction == labels).float(),
            "prediction": prediction, "confidence": confidence, "label": labels}


@torch.no_grad()
def score_batches(accelerator, model, loader, task: str = "classification", seed: int = 0) -> list[dict]:
    """Per batch, a dict of per-example tensors gathered over processes: `loss` (summed over the example's
    targets), `count` (its targets: 1, or its masked tokens for mlm), `correct`; for classification also
    `prediction`, `confidence`, `label`; and the batch's `index` when it has one. gather_for_metrics drops the
    duplicates that pad the last batch across processes, so every example counts once.

    Runs in eval mode under a forked RNG seeded with `seed`: MLM masks are the same at every evaluation, and the
    caller's RNG stream (dropout) is untouched, so evaluating never changes training."""
    was_training = model.training
    model.eval()
    batches = []
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for batch in loader:
            inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
            scores = _per_example(model(**inputs).logits.float(), batch["labels"], task)
            if "index" in batch:
                scores["index"] = batch["index"]
            batches.append(accelerator.gather_for_metrics(scores))
    model.train(was_training)
    return batches


def evaluate(accelerator, model, loader, task: str, seed: int) -> dict:
    """Loss and accuracy over the whole loader (classification: per example; mlm: per masked token)."""
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, targets, correct
    for scores in score_batches(accelerator, model, loader, task, seed):
        totals += torch.stack([scores["loss"], scores["count"], scores["correct"]], dim=1).sum(0).double().cpu()
    loss_sum, n, correct = totals.tolist()
    return {"eval/loss": loss_sum / max(n, 1), "eval/accuracy": correct / max(n, 1)}


__all__ = ["score_batches", "evaluate"]
