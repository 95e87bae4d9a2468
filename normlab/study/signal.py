"""A study's `signal` measurement (study v4's M1, study v5's manipulation check): how alike the classifier's
inputs are for different sentences, at initialization and over the first Adam steps. The pooled vector ([CLS], or
the mean over real tokens) is all the classifier reads; if it is nearly the same for every sentence, the gradient
cannot tell the classes apart and the loss sits on the ln 2 plateau.

    python -m normlab.study.signal --preset quick_v4 --out STUDY/signal.jsonl --selection STUDY/selection.json
"""

import itertools
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model import NormLabForSequenceClassification
from normlab.command import command_parser, error_exit
from normlab.config.loader import load_config, model_config_from
from normlab.data.batching import encode_rows, row_batches
from normlab.data.sources import resolve_dataset
from normlab.data.tokenizer import get_tokenizer
from normlab.files.formats import read_yaml, write_jsonl
from normlab.paths import REPO_ROOT
from normlab.study.grid import resolve_preset, selection_key
from normlab.study.selection_file import read_selection
from normlab.study.study_dir import StudyDir, git_commit, provenance, record_invocation
from normlab.train.step import model_inputs


def fixed_batches(block: dict, vocab_size: int, tokenizer_rows: int):
    """steps + 1 training batches (rows 0.. of train) and one probe batch (validation), shared by all models:
    the default config's data, as the study's runs read it."""
    data = load_config(layers=[({"data.max_length": block["max_length"], "data.max_train_samples": tokenizer_rows},
                                "in the signal block")]).data
    dsd = resolve_dataset(data, with_labels=True)
    tokenizer = get_tokenizer(data, vocab_size, dsd["train"])  # the study runs' tokenizer (same rows and size: cached)
    bs = block["batch_size"]

    def first_batches(split: str, n: int) -> list[dict]:
        rows = dsd[split][:n * bs]
        rows = encode_rows(tokenizer, rows["sentence"], block["max_length"], rows["label"])
        return [model_inputs(batch) for batch in row_batches(rows, bs, tokenizer.pad_token_id)]

    return first_batches("train", block["steps"] + 1), first_batches("validation", 1)[0], len(tokenizer)


def pooled_cosine(model, batch: dict) -> float:
    """Mean cosine similarity between the classifier's inputs (the pooled vectors, centred where the model centres
    them) for different sentences of `batch` (off the diagonal):
    1 = the classifier sees the same vector for every sentence. Measured in the model's current mode (train mode
    for the BN family: the statistics its training steps use), without gradients."""
    seen = []
    # what reaches the dropout before the classifier is the pooled vector, centred where the model centres it
    hook = model.dropout.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        hook.remove()
    z = F.normalize(seen[0].float(), dim=-1)  # (B, D)
    n = z.shape[0]
    sim = z @ z.T
    return float((sim.sum() - sim.diagonal().sum()) / (n * (n - 1)))


def cosine_over_steps(model, train: list[dict], probe: dict, lr: float) -> list[float]:
    """pooled_cosine on `probe` at initialization and after each Adam step on `train` (no warmup, no clipping;
    the BN family's running statistics move as in training)."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8)
    out = [pooled_cosine(model, probe)]
    for batch in train:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(pooled_cosine(model, probe))
    return out


def build_arm(variant: dict, overrides: dict, vocab: int, seed: int):
    """The model a study arm trains (its configs/ file, the study's overrides and its own), initialized under
    `seed`."""
    cfg = load_config(str(REPO_ROOT / variant["config"]) if variant.get("config") else None,
                      layers=[({**overrides, **(variant.get("overrides") or {})}, "in the study's signal block")])
    torch.manual_seed(seed)
    return NormLabForSequenceClassification(model_config_from(cfg, vocab_size=vocab, num_labels=2, pad_token_id=0))


def arm_lr(selection: dict, name: str, variant: dict, default: float) -> float:
    """The arm's best LR from a study's selection.json (its `tune` arm's, for an intervention), else `default`."""
    chosen = selection.get(selection_key("tune", variant.get("tune", name), "on"))
    return float(chosen["lr"]) if chosen else default


def run(preset: Path, out: Path, selection: dict | None = None) -> list[dict]:
    """Every (arm, seed) of the preset's `signal` block: {variant, seed, lr, cosine: [init, step 1, ...]}; each
    arm at the signal block's LR, or at its best LR when a study's `selection` is given."""
    study = read_yaml(preset)
    sig = study["signal"]
    overrides = study["overrides"]
    train, probe, vocab = fixed_batches(sig, study["overrides"]["model.vocab_size"],
                                        study["overrides"]["data.max_train_samples"])
    rows = []
    for (name, variant), seed in itertools.product(sig["variants"].items(), sig["seeds"]):
        model = build_arm(variant, overrides, vocab, seed)
        lr = arm_lr(selection or {}, name, variant, sig["lr"])
        cos = cosine_over_steps(model, train[1:], probe, lr)
        rows.append({"variant": name, "seed": seed, "lr": lr, "cosine": [round(c, 6) for c in cos],
                     **provenance()})
        print(f"signal {name} seed {seed}: pooled cosine at init {cos[0]:.3f}, after {len(cos) - 1} steps "
              f"{cos[-1]:.3f}", flush=True)
    write_jsonl(out, rows)
    return rows


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("--preset", default="quick_v4", help="a study preset with a `signal` block")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--selection", type=Path, default=None,
                        help="a study's selection.json: each arm at its best LR (default: the block's one LR)")
    args = parser.parse_args(argv)
    preset = resolve_preset(args.preset)
    if "signal" not in read_yaml(preset):
        return error_exit("signal.py", f"{preset} has no `signal` block (variants, seeds, steps, lr, batch_size, "
                                       f"max_length)")
    torch.set_num_threads(1)
    started, commit = time.time(), git_commit()
    run(preset, args.out, read_selection(args.selection) if args.selection else None)
    if StudyDir(args.out.parent).is_study:  # written into a study: meta.json lists this invocation
        record_invocation(args.out.parent, shlex.join(["python", "-m", "normlab.study.signal",
                                                       *(argv if argv is not None else sys.argv[1:])]),
                          started, in_process=True, commit=commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
