"""E1 of the norm study, no training (docs/studies.md, "E1"): per placement, depth and seed, each block's gradient
norm at initialization and the encoder output's relative change over the first Adam steps, on the same fixed SST-2
batches for every model. Writes STUDY/e1.jsonl, one record per (placement, depth, seed) (scripts/init_study.py).
"""

import itertools
import shlex
import sys
import time
from pathlib import Path

import torch

from model import NormLabConfig, NormLabForSequenceClassification
from normlab.command import command_parser, error_exit
from normlab.config.loader import load_config
from normlab.data.batching import encode_rows, row_batches
from normlab.data.sources import resolve_dataset
from normlab.data.tokenizer import get_tokenizer
from normlab.files.formats import read_json, read_yaml, write_jsonl
from normlab.study.sharded import add_shard_options
from normlab.study.study_dir import E1, StudyDir, provenance, record_invocation
from normlab.train.probes import block_parameters
from normlab.train.step import model_inputs


def fixed_batches(init: dict, vocab_size: int, tokenizer_rows: int):
    """adam_steps + 1 training batches (rows 0.. of train) and one probe batch (validation), shared by all models:
    the default config's data, as the study's runs read it."""
    data = load_config(layers=[({"data.max_length": init["max_length"], "data.max_train_samples": tokenizer_rows},
                                "in E1's settings")]).data
    dsd = resolve_dataset(data, with_labels=True)
    tokenizer = get_tokenizer(data, vocab_size, dsd["train"])  # the study runs' tokenizer (same rows and size: cached)

    bs = init["batch_size"]

    def first_batches(split: str, n: int) -> list[dict]:
        rows = dsd[split][:n * bs]
        rows = encode_rows(tokenizer, rows["sentence"], init["max_length"], rows["label"])
        return [model_inputs(batch) for batch in row_batches(rows, bs, tokenizer.pad_token_id)]

    return first_batches("train", init["adam_steps"] + 1), first_batches("validation", 1)[0], len(tokenizer)


def build(placement: str, depth: int, init: dict, vocab_size: int, seed: int):
    torch.manual_seed(seed)
    config = NormLabConfig(norm="layernorm", norm_placement=placement, num_hidden_layers=depth,
                           hidden_size=init["hidden_size"], num_attention_heads=init["num_attention_heads"],
                           intermediate_size=init["intermediate_size"], vocab_size=vocab_size, num_labels=2,
                           max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return NormLabForSequenceClassification(config)


def output_of(model, probe) -> torch.Tensor:
    """(T, D) encoder output at the probe batch's real tokens."""
    with torch.no_grad():
        hidden = model.base_model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"])[0]
    return hidden[probe["attention_mask"].bool()]


def measure(placement: str, depth: int, seed: int, init: dict, train, probe, vocab_size: int) -> dict:
    model = build(placement, depth, init, vocab_size, seed)
    loss = model(**train[0]).loss
    loss.backward()
    grad_norms = [torch.sqrt(sum((p.grad.float() ** 2).sum() for p in group)).item()
                  for group in block_parameters(model)]
    model.zero_grad(set_to_none=True)
    start = output_of(model, probe)
    optimizer = torch.optim.Adam(model.parameters(), lr=init["lr"], betas=(0.9, 0.98), eps=1e-8)
    changes = []
    for batch in train[1:]:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        changes.append(((output_of(model, probe) - start).norm() / start.norm()).item())
    return {"placement": placement, "depth": depth, "seed": seed, "loss_at_init": round(loss.item(), 6),
            "grad_norm": [float(f"{g:.5g}") for g in grad_norms], "output_change": [float(f"{c:.5g}") for c in changes]}


def run(init: dict, out: Path, tokenizer_rows: int, vocab_size: int, shard: tuple[int, int] = (0, 1)) -> list[dict]:
    """Every (placement, depth, seed) of `init` in that order, or every N-th of them from the K-th (`shard` (K, N):
    N processes share the cores, their files merged afterwards), into `out`."""
    train, probe, vocab = fixed_batches(init, vocab_size, tokenizer_rows)
    rows = []
    k, n = shard
    for placement, depth, seed in list(itertools.product(init["placements"], init["depths"], init["seeds"]))[k::n]:
        rows.append({**measure(placement, depth, seed, init, train, probe, vocab), **provenance()})
        r = rows[-1]
        print(f"e1 {placement} depth {depth} seed {seed}: grad last/first "
              f"{r['grad_norm'][-1] / r['grad_norm'][0]:.3g}, output change {r['output_change'][-1]:.3g}", flush=True)
    write_jsonl(out, rows)
    return rows


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("study_dir", type=Path)
    parser.add_argument("--preset", type=Path, default=None, help="a study YAML (default: STUDY/study.json)")
    add_shard_options(parser, "measure", E1)
    args = parser.parse_args(argv)
    source = read_yaml(args.preset) if args.preset else read_json(StudyDir(args.study_dir).study_json)
    if source is None:
        return error_exit("init_study.py", f"{args.study_dir / 'study.json'} not found: give a study directory that "
                                           f"scripts/study.py wrote, or the study file with --preset")
    if not source.get("init"):
        return error_exit("init_study.py", "the study has no `init` block (E1 settings)")
    # a preset names them `overrides`, study.json `common_overrides`: {run config key: value}
    overrides = source.get("common_overrides", source.get("overrides")) or {}
    if not isinstance(overrides, dict):  # a study.json of an older study.py: key=value strings
        return error_exit("init_study.py", "the study's overrides are not a mapping (a study.json written by an older "
                                           "study.py); give the study file with --preset")
    torch.set_num_threads(1)  # tiny models: one thread is as fast and leaves the other core to the study
    started = time.time()
    run(source["init"], args.out or args.study_dir / E1, int(overrides.get("data.max_train_samples", 5120)),
        int(overrides.get("model.vocab_size", 4000)), shard=args.shard)
    # meta.json lists every invocation, E1's too; a shard's is recorded by the study that started it, as one
    if StudyDir(args.study_dir).is_study and args.shard == (0, 1):
        record_invocation(args.study_dir, shlex.join(["python", "scripts/init_study.py",
                                                      *(argv if argv is not None else sys.argv[1:])]),
                          started, in_process=True)
    return 0

