"""One job of a study in N processes: `python -m normlab.cli.<name> STUDY` on every N-th item each (--shard K/N), the
parts merged into one file. The LR choice's dev losses and the records' scoring both run this way, so that they
use the cores the training used, and so that one process or N write the same file."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from normlab.files.formats import atomic_write_text
from normlab.study.grid import REPO_ROOT


def run_sharded(cli: str, study_dir: Path, out: str, shards: int, key, args: tuple = ()) -> None:
    """`python -m normlab.cli.<cli> STUDY ARGS` in `shards` processes at once, each on every shards-th item
    (--shard K/N) into a part file; the parts merged into STUDY/<out>, sorted by `key` of a row: the file one
    process writes."""
    command = [sys.executable, "-m", f"normlab.cli.{cli}", str(study_dir), *args]
    if shards <= 1:
        subprocess.run(command, cwd=REPO_ROOT, check=True)
        return
    stem = Path(out).stem
    parts = [study_dir / f"{stem}.part{k}.jsonl" for k in range(shards)]
    procs = [subprocess.Popen(command + ["--shard", f"{k}/{shards}", "--out", str(part)], cwd=REPO_ROOT)
             for k, part in enumerate(parts)]
    failed = [p.args for p in procs if p.wait() != 0]
    if failed:
        raise subprocess.CalledProcessError(1, failed[0])
    rows = sorted((line for part in parts for line in part.read_text().splitlines()), key=lambda r: key(json.loads(r)))
    atomic_write_text(study_dir / out, "".join(row + "\n" for row in rows))
    for part in parts:
        part.unlink()


def add_shard_options(parser: argparse.ArgumentParser, what: str, out: str) -> None:
    """The options run_sharded gives each process: --out (default STUDY/<out>) and --shard K/N, parsed to (K, N);
    `what` the command does to every N-th item, for the help text."""
    parser.add_argument("--out", type=Path, default=None, help=f"default: STUDY/{out}")
    parser.add_argument("--shard", type=shard_spec, default=(0, 1), metavar="K/N",
                        help=f"{what} every N-th item from the K-th (0-based) into OUT: N processes share the cores; "
                             "scripts/study.py merges their OUT files")


def shard_spec(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), with 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N (e.g. 0/2)") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{text!r}: K must be at least 0 and below N")
    return k, n
