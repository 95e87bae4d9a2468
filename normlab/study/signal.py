"""A study's `signal` measurement (study v4's M1, study v5's manipulation check): how alike the classifier's
inputs are for different sentences, at initialization and over the first Adam steps. The pooled vector ([CLS], or
the mean over real tokens) is all the classifier reads; if it is nearly the same for every sentence, the gradient
cannot tell the classes apart and the loss sits on the ln 2 plateau. The study runner runs it as a stage once the
LRs it reads are chosen; by hand:

    python -m normlab.study.signal STUDY                  # STUDY's spec and selection.json -> STUDY/signal.jsonl
    python -m normlab.study.signal STUDY --preset factorial_v5   # a new folder: no training, the block's own LR
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
from normlab.errors import StudyError
from normlab.files.formats import write_jsonl
from normlab.paths import REPO_ROOT
from normlab.study.plan import Plan, Signal, Variant, resolve_preset
from normlab.study.sharded import add_shard_options
from normlab.study.study_dir import SIGNAL, SPEC, StudyDir, git_commit, provenance, record_invocation
from normlab.train.step import model_inputs


def fixed_batches(sig: Signal, plan: Plan):
    """steps + 1 training batches (rows 0.. of train) and one probe batch (validation), shared by all models:
    the data and tokenizer the study's runs read (its overrides), at the block's max_length."""
    cfg = load_config(layers=[(plan.overrides, "in the study's overrides"),
                              ({"data.max_length": sig.max_length}, "in the signal block")])
    vocab_size = model_config_from(cfg).vocab_size
    dsd = resolve_dataset(cfg.data, with_labels=True)
    tokenizer = get_tokenizer(cfg.data, vocab_size, dsd["train"])  # the study runs' tokenizer (cached)
    bs = sig.batch_size

    def first_batches(split: str, n: int) -> list[dict]:
        rows = dsd[split][:n * bs]
        rows = encode_rows(tokenizer, rows[cfg.data.text_column], sig.max_length, rows[cfg.data.label_column])
        return [model_inputs(batch) for batch in row_batches(rows, bs, tokenizer.pad_token_id)]

    return first_batches("train", sig.steps + 1), first_batches("validation", 1)[0], len(tokenizer)


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


def build_arm(variant: Variant, overrides: dict, vocab: int, seed: int):
    """The model a study arm trains (its configs/ file, the study's overrides and its own), initialized under
    `seed`."""
    cfg = load_config(str(REPO_ROOT / variant.config) if variant.config else None,
                      layers=[({**overrides, **variant.overrides}, "in the study's signal block")])
    torch.manual_seed(seed)
    return NormLabForSequenceClassification(model_config_from(cfg, vocab_size=vocab, num_labels=2, pad_token_id=0))


def cases(sig: Signal) -> list[tuple]:
    """Every (arm, seed) the block measures, in the order signal.jsonl lists them."""
    return list(itertools.product(sig.variants, sig.seeds))


def measure(plan: Plan, lrs: dict, todo: list[tuple], out: Path) -> list[dict]:
    """Each (arm, seed) of `todo`: {variant, seed, lr, cosine: [init, step 1, ...]}, the arm at its LR in `lrs`."""
    sig = plan.signal
    train, probe, vocab = fixed_batches(sig, plan)
    rows = []
    for name, seed in todo:
        model = build_arm(sig.variants[name], plan.overrides, vocab, seed)
        cos = cosine_over_steps(model, train[1:], probe, lrs[name])
        rows.append({"variant": name, "seed": seed, "lr": lrs[name], "cosine": [round(c, 6) for c in cos],
                     **provenance()})
        print(f"signal {name} seed {seed}: pooled cosine at init {cos[0]:.3f}, after {len(cos) - 1} steps "
              f"{cos[-1]:.3f}", flush=True)
    write_jsonl(out, rows)
    return rows


def study_spec(folder: StudyDir, preset: str | None):
    """The spec whose block is measured: the folder's snapshot, or (a folder that holds none) `preset`'s, which
    main saves there once it is checked."""
    from normlab.study.spec import StudySpec

    if preset is not None and (folder / SPEC).is_file():
        raise StudyError(f"{folder.path} already holds a study's {SPEC}; drop --preset to measure that study")
    spec = StudySpec.load(resolve_preset(preset), quiet=True) if preset is not None else folder.spec()
    if spec.plan.signal is None:
        raise StudyError(f"{spec.path} has no `signal` block (variants, seeds, steps, lr, batch_size, max_length)")
    return spec


def chosen_lrs(spec, folder: StudyDir) -> dict:
    """{arm: the LR it is measured at} (StudyError where a chosen LR is not chosen yet)."""
    lrs = {arm: spec.plan.signal_lr(arm, folder.selection()) for arm in spec.plan.signal.variants}
    if unchosen := [arm for arm, lr in lrs.items() if lr is None]:
        raise StudyError(f"arm {unchosen[0]}'s LR is not chosen yet; train its sweep first ({SIGNAL} reads "
                         f"{folder.selection_file})")
    return lrs


def measure_study(study_dir: Path, shard: tuple = (0, 1), out: Path | None = None) -> None:
    """The block of the study folder's spec, every `shard` (K, N)-th (arm, seed) into `out` (default
    STUDY/signal.jsonl; run_sharded's part)."""
    folder = StudyDir(study_dir)
    spec = folder.spec()
    torch.set_num_threads(1)
    k, n = shard
    measure(spec.plan, chosen_lrs(spec, folder), cases(spec.plan.signal)[k::n], Path(out or folder / SIGNAL))


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("study_dir", type=Path)
    parser.add_argument("--preset", default=None, help="a study file with a `signal` block, for a folder that "
                                                       "holds no study yet (saved there as its spec)")
    add_shard_options(parser, "measure", SIGNAL)
    args = parser.parse_args(argv)
    folder = StudyDir(args.study_dir)
    try:
        chosen_lrs(spec := study_spec(folder, args.preset), folder)
    except StudyError as err:
        return error_exit("signal.py", err)
    if args.preset is not None:
        folder.save_spec(spec)
    started, commit = time.time(), git_commit()
    measure_study(folder.path, args.shard, args.out)
    if args.shard[1] == 1 and folder.is_study:  # by hand into a study: meta.json lists this invocation
        record_invocation(folder.path, shlex.join(["python", "-m", "normlab.study.signal",
                                                   *(argv if argv is not None else sys.argv[1:])]),
                          started, in_process=True, commit=commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
