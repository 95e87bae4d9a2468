"""One job of a study in N processes: a command's `main` on every N-th item each (--shard K/N), the parts merged
into one file. The LR choice's dev losses and the records' scoring both run this way, so that they use the cores the
training used, and so that one process or N write the same file. The processes are started by multiprocessing
(spawn: a fresh interpreter each, as the training runs have) and call the function; nothing goes through a shell."""

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from normlab.files.formats import atomic_write_text


class ShardFailed(RuntimeError):
    """A shard's `main` returned non-zero (an exception it raises reaches the caller as itself)."""


def run_sharded(main, study_dir: Path, out: str, shards: int, key, args: tuple = ()) -> None:
    """`main([STUDY, *args, --shard K/N, --out PART])` in `shards` processes at once, each on every shards-th item,
    into a part file; the parts merged into STUDY/<out>, sorted by `key` of a row: the file one process writes.
    `main` is a module-level function (a command's main), so that a spawned process can import it."""
    stem = Path(out).stem
    parts = [study_dir / f"{stem}.part{k}.jsonl" for k in range(shards)]
    argvs = [[str(study_dir), *args, "--shard", f"{k}/{shards}", "--out", str(part)] for k, part in enumerate(parts)]
    with ProcessPoolExecutor(max_workers=shards, mp_context=multiprocessing.get_context("spawn")) as pool:
        codes = list(pool.map(main, argvs))
    if failed := [(argv, code) for argv, code in zip(argvs, codes) if code]:
        (argv, code), name = failed[0], f"{main.__module__}.{main.__name__}"
        raise ShardFailed(f"{name} {' '.join(argv)} exited {code}")
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
                             "the study merges their OUT files")


def shard_spec(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), with 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N (e.g. 0/2)") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{text!r}: K must be at least 0 and below N")
    return k, n
