"""final/README.md, the model card train.py writes next to a finished run's weights, for people to read (programs
read final/normlab_run.yaml, normlab.run_dir.MODEL_DIR_CONFIG)."""

from normlab.config.loader import config_yaml
from normlab.run_dir import MODEL_DIR_CONFIG


def best_line(best: dict | None) -> str:
    """'step 1500: eval/accuracy 0.8100, eval/loss 0.4400' (the best evaluation: by dev accuracy where dev rows are
    held out, else by eval accuracy)."""
    if not best:
        return "no evaluation"
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in best.items() if k != "step" and isinstance(v, float))
    return f"step {best.get('step')}: {metrics}"


def model_card(cfg, summary: dict, id2label: dict | None = None) -> str:
    """The card's Markdown for a run of `cfg` (a RunConfig) that ended with `summary`; `id2label`: the classifier's
    class names."""
    m, d = cfg.model, cfg.data
    labels = ", ".join(f"{i} = {name}" for i, name in sorted((id2label or {}).items()))
    chosen_on = "dev accuracy" if "dev/accuracy" in (summary.get("best") or {}) else "accuracy"
    results = "\n".join(f"| {k} | {v:.4f} |" for k, v in (summary.get("final") or {}).items()
                        if isinstance(v, float))
    return f"""---
library_name: transformers
tags: [normlab, {m.norm}, {m.norm_placement}-norm]
datasets: [{d.name or d.path}]
---
# NormLab encoder: `{m.norm}`, {m.norm_placement} placement

Trained from scratch with NormLab's `train.py` ({cfg.task}) for {summary['step']} optimizer steps.
The model code travels with the weights:

```python
from transformers import AutoModelForSequenceClassification, AutoTokenizer
model = AutoModelForSequenceClassification.from_pretrained("PATH", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH", trust_remote_code=True)

from transformers import pipeline
classify = pipeline("text-classification", model="PATH", trust_remote_code=True)
classify("a gorgeous film")  # [{{'label': ..., 'score': ...}}]
```

Labels: {labels or "none (masked language model)"}.

## Results (eval split `{d.eval_split}`, final step)

| metric | value |
|---|---|
{results}

Best evaluation (highest {chosen_on}): {best_line(summary.get('best'))}. Loss spikes during training:
{summary.get('loss_spikes')}.

## Config

The same config as a file for programs: `{MODEL_DIR_CONFIG}`.

```yaml
{config_yaml(cfg).strip()}
```
"""
