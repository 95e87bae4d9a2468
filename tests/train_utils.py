"""Shared by tests/test_train.py and tests/test_reliability.py: a tiny training config on a few hundred rows of
the shared SST-2, and ways to run train.py (in this process, as `python train.py`, or via `accelerate launch`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# hidden 32, 2 layers, 300 training rows: one step is a few milliseconds of compute.
TINY = [
    "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
    "model.intermediate_size=64", "model.vocab_size=1000",
    "data.max_train_samples=300", "data.max_eval_samples=96",
    "train.batch_size=16", "train.warmup_steps=4", "train.lr=2e-3",
    "wandb.mode=disabled",
    "train.cpu_threads=1",  # not the machine's cores: see env()
]


# 40 steps over 19 batches per epoch: resumes land mid-epoch and in the second epoch (the `reference` fixture's run)
REFERENCE = ["train.max_steps=40", "train.save_steps=10", "train.eval_steps=20"]


def terminal_signals() -> None:
    """preexec_fn of a child whose Ctrl-C a test sends: SIGINT back to its default. A shell starts a background job
    (`cmd &`, a CI script's) with SIGINT ignored, and Python keeps an ignored SIGINT ignored, so without this the
    child would never see the KeyboardInterrupt a terminal's Ctrl-C gives."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true",
             TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO),
             # one thread, as in run_here: tiny kernels gain nothing from more, lose a lot on a shared CPU, and
             # the same thread count everywhere keeps CPU results bitwise reproducible between processes
             OMP_NUM_THREADS="1")
    return e


def run_here(out, *overrides) -> int:
    """train.main in this process (no interpreter start-up: the cheap way to run many tiny trainings)."""
    return run_argv(f"output_dir={out}", *TINY, *overrides)


def run_argv(*argv) -> int:
    """train.main(argv) in this process, as the command `python train.py ARGV` (without TINY: e.g. a resume from
    the run directory alone)."""
    from accelerate.state import AcceleratorState, GradientState

    from normlab.train import run as train

    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's singletons: one run per state
    GradientState._reset_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train.main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)


def python_cmd(out, *overrides) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), f"output_dir={out}", *TINY, *overrides]


def free_port() -> int:
    """A TCP port nobody listens on now: multi-process tests must not share a fixed rendezvous port (a previous
    run's port can still be held while the next test starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_cmd(out, *overrides, launch_args=("--num_processes", "1")) -> list[str]:
    launcher = [sys.executable, "-m", "accelerate.commands.launch", *launch_args]
    return [*launcher, str(REPO / "train.py"), f"output_dir={out}", *TINY, *overrides]


def run_cmd(cmd, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def train_rows(out) -> list[dict]:
    return [r for r in rows(out) if "train/loss" in r]


def losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in train_rows(out)]


def summary(out) -> dict:
    return json.loads((Path(out) / "summary.json").read_text())


def final_weights(out) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(out) / "final" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
