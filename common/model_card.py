"""final/README.md, the model card train.py writes next to a finished run's weights, for people to read (programs
read final/normlab_run.yaml, RUN_CONFIG_FILE)."""

import yaml

RUN_CONFIG_FILE = "normlab_run.yaml"  # final/'s copy of the run config, so final/ copied elsewhere keeps its dataset


def best_line(best: dict | None) -> str:
    """'step 1500: eval/accuracy 0.8100, eval/loss 0.4400' (the evaluation with the best accuracy)."""
    if not best:
        return "no evaluation"
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in best.items() if k != "step" and isinstance(v, float))
    return f"step {best.get('step')}: {metrics}"


def model_card(cfg: dict, summary: dict, id2label: dict | None = None) -> str:
    """The card's Markdown for a run of `cfg` that ended with `summary`; `id2label`: the classifier's class names."""
    m = cfg["model"]
    labels = ", ".join(f"{i} = {name}" for i, name in sorted((id2label or {}).items()))
    results = "\n".join(f"| {k} | {v:.4f} |" for k, v in (summary.get("final") or {}).items()
                        if isinstance(v, float))
    return f"""---
library_name: transformers
tags: [normlab, {m['norm']}, {m['norm_placement']}-norm]
datasets: [{cfg['data']['name'] or cfg['data']['path']}]
---
# NormLab encoder: `{m['norm']}`, {m['norm_placement']} placement

Trained from scratch with NormLab's `train.py` ({cfg['task']}) for {summary['step']} optimizer steps.
The model code travels with the weights:

```python
from transformers import AutoModelForSequenceClassification, AutoTokenizer
model = AutoModelForSequenceClassification.from_pretrained("PATH", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH", trust_remote_code=True)

from transformers import pipeline
pipeline("text-classification", model="PATH", trust_remote_code=True)("a gorgeous film")  # [{{'label': ..., 'score': ...}}]
```

Labels: {labels or "none (masked language model)"}.

## Results (eval split `{cfg['data']['eval_split']}`, final step)

| metric | value |
|---|---|
{results}

Best evaluation (highest accuracy): {best_line(summary.get('best'))}. Loss spikes during training:
{summary.get('loss_spikes')}.

## Config

The same config as a file for programs: `{RUN_CONFIG_FILE}`.

```yaml
{yaml.safe_dump(cfg, sort_keys=False).strip()}
```
"""
