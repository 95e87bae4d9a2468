"""NormLab's performance numbers, measured side by side in one run and printed as ratios.

    python scripts/bench.py [--json] [--quick] [--device cpu|cuda] [--repeats N] [--threads N] [--batches N]
                            [--compile | --no-compile] [--compile-hf] [--diagnose] [--out FILE] [--config FILE]

Four sections, each with its goal (one module each in normlab/bench/): 1. CustomLayerNorm's forward+backward time
over torch.nn.LayerNorm's, 2. training throughput of NormLab over HF BERT of the same size, 3. the pad fraction of
random vs length-grouped batches, 4. peak memory of one training step. What each measures, and how the timing is
kept fair: docs/performance.md.
"""

import argparse
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from normlab.bench.data import load_data, take_batches
from normlab.bench.layernorm import bench_layernorm, ln_shapes
from normlab.bench.memory import bench_memory
from normlab.bench.models import TaskShape, contestant_models
from normlab.bench.padding import bench_padding
from normlab.bench.report import print_report
from normlab.bench.throughput import WIDE, bench_throughput
from normlab.command import command_parser
from normlab.files.formats import atomic_write_json
from normlab.train.machine import load_average, machine_info

QUICK_TRAIN_SAMPLES = 2000  # --quick: the first N training rows (tokenizer, padding and throughput batches)
LN_ONLY_BATCH = 32  # --layernorm-only: configs/default.yaml's train.batch_size, without loading the config


def parse_args(argv=None):
    ap = command_parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (tests); numbers not meaningful")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--repeats", type=int, help="interleaved repetitions of the throughput pass (default 9; quick 3); "
                                                "LayerNorm gets 5x as many")
    ap.add_argument("--batches", type=int, help="SST-2 batches per throughput repetition (default 12; quick 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None,
                    help="also time the compiled NormLab (default on, off with --quick)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--compile-hf", action="store_true", help="also time a compiled HF BERT (slow to compile)")
    ap.add_argument("--diagnose", action="store_true",
                    help="also time NormLab with torch's LayerNorm, and with its padded layout (unpad=False)")
    ap.add_argument("--layernorm-only", action="store_true",
                    help="section 1 only (no data, no models): e.g. the Triton kernel on a GPU machine")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--config", default=None, help="a config variant (default: configs/default.yaml)")
    args = ap.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    if args.batches is not None and args.batches < 1:
        ap.error(f"--batches={args.batches} must be >= 1")
    return args


def run_settings(args, argv, device) -> dict:
    """The output's `settings`: the command line with its defaults filled in."""
    quick = args.quick
    return {"quick": quick, "repeats": args.repeats or (3 if quick else 9),
            "batches": args.batches or (2 if quick else 12),
            "compile": (not quick) if args.compile is None else args.compile,
            # the training steps in the precision training uses on this device (configs/accelerate: bf16 on GPUs)
            "autocast": "bf16" if device.type == "cuda" else None, "compile_hf": args.compile_hf,
            "config": args.config,
            "config_overrides": [f"data.max_train_samples={QUICK_TRAIN_SAMPLES}"] if quick else [],
            "command": "python scripts/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)}


def main(argv=None) -> int:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.py: --device cuda but torch.cuda.is_available() is False; use --device cpu", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    import normlab.kernels

    kernels = normlab.kernels.enable("auto", device)  # as train.py does (train.kernels=auto)
    settings = run_settings(args, argv, device)
    cfg, batch_size = None, LN_ONLY_BATCH  # --layernorm-only: no config library (the GPU image has none)
    if not args.layernorm_only:
        from normlab.config.loader import load_config
        cfg = load_config(args.config, settings["config_overrides"])
        batch_size = cfg.train.batch_size
    res = {"machine": machine_info(device), "settings": settings, "kernels": kernels}
    settings["section_s"] = {}
    # 1. LayerNorm at training shapes
    with timed_section(res, "layernorm"):
        # LayerNorm samples are short (calibrated to a couple of ms of work each): many more of them than of
        # training passes, for stable medians
        shapes = ln_shapes(device, settings["quick"], batch_size)
        res["layernorm"] = bench_layernorm(device, shapes, 5 * settings["repeats"])
    res["cuda_note"] = ("CUDA paths measured on " + res["machine"].get("gpu", "GPU") if device.type == "cuda" else
                        "CUDA paths (fp32/bf16 LayerNorm, GPU throughput and memory): untested, no GPU in this run")
    if not args.layernorm_only:
        run_model_sections(args, res, cfg, device)
    res["machine"]["load_average_end"] = load_average()
    settings["wall_s"] = time.perf_counter() - wall0
    if args.out:
        atomic_write_json(args.out, res, indent=1)
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)
    return 0


@contextlib.contextmanager
def timed_section(res, name: str):
    """The block's wall time, as settings.section_s[name] of the output."""
    t0 = time.perf_counter()
    yield
    res["settings"]["section_s"][name] = time.perf_counter() - t0


def training_precision(device):
    """The precision training uses on this device (configs/accelerate: bf16 autocast on GPUs, float32 on CPU)."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def run_model_sections(args, res, cfg, device) -> None:
    """Sections 2-4 (they need the data and both models)."""
    from accelerate import Accelerator

    from normlab.config.loader import load_config

    accelerator = Accelerator(cpu=device.type == "cpu")  # one process: what make_step steps with
    settings = res["settings"]
    repeats, n_batches = settings["repeats"], settings["batches"]

    # 3. padding (needs the data; cheap next to the timings)
    with timed_section(res, "data"):
        tokenizer, tokenized, num_labels = load_data(cfg)
    task = TaskShape(len(tokenizer), tokenizer.pad_token_id, num_labels)
    with timed_section(res, "padding"):
        res["padding"] = bench_padding(cfg, tokenizer, tokenized)

    # 2. throughput on the first batches of the training loader
    with timed_section(res, "throughput"):
        batches = take_batches(cfg, tokenizer, tokenized, n_batches, device)
        with training_precision(device):
            models = contestant_models(cfg, task, compile_normlab=settings["compile"], compile_hf=args.compile_hf,
                                       diagnose=args.diagnose)
            res["throughput"] = bench_throughput(models, batches, accelerator=accelerator, cfg=cfg, device=device,
                                                 repeats=repeats)

    # 2b. throughput at the bigger width (same data, tokenizer and batches; NormLab eager vs HF BERT eager)
    with timed_section(res, "throughput_wide"):
        cfg_wide = load_config(args.config, settings["config_overrides"] + WIDE)
        with training_precision(device):
            wide_batches = take_batches(cfg_wide, tokenizer, tokenized, n_batches, device)
            res["throughput_wide"] = bench_throughput(contestant_models(cfg_wide, task, extras=False), wide_batches,
                                                      accelerator=accelerator, cfg=cfg_wide, device=device,
                                                      repeats=repeats)

    # 4. memory, on the longest timed batch, with the eager models just timed
    longest = max(batches, key=lambda b: b["input_ids"].numel())
    with timed_section(res, "memory"), training_precision(device):
        res["memory"] = bench_memory(accelerator, cfg, {"normlab": models["normlab_eager"],
                                                        "hf_bert": models["hf_bert_eager"]}, longest, device)


if __name__ == "__main__":
    sys.exit(main())
