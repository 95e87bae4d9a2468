"""One job of a study in N processes: a function on every N-th item each (shard K of N), the parts merged into one
file. The LR choice's dev losses, the signal measurement and the records' scoring all run this way, so that they
use the cores the training used, and so that one process or N write the same file. The processes are started by
multiprocessing (spawn: a fresh interpreter each, as the training runs have) and call the function with its
arguments; no command line is built, nothing goes through a shell, and an error a part raises reaches the caller."""

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

from normlab.files.formats import atomic_write_text


def run_sharded(fn, study_dir: Path, out: str, shards: int, key, **kwargs) -> int:
    """`fn(study_dir, shard=(K, N), out=PART, **kwargs)` in `shards` processes at once, each writing the rows of
    every shards-th item into its part file; the parts merged into STUDY/<out>, sorted by `key` of a row: the file
    one process writes. Returns its number of rows. `fn` is a module-level function, so that a spawned process can
    import it."""
    stem = Path(out).stem
    parts = [study_dir / f"{stem}.part{k}.jsonl" for k in range(shards)]
    with ProcessPoolExecutor(max_workers=shards, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(partial(_part, fn, study_dir, shards, kwargs), range(shards), parts))
    rows = sorted((line for part in parts for line in part.read_text().splitlines()), key=lambda r: key(json.loads(r)))
    atomic_write_text(study_dir / out, "".join(row + "\n" for row in rows))
    for part in parts:
        part.unlink()
    return len(rows)


def _part(fn, study_dir: Path, shards: int, kwargs: dict, k: int, part: Path) -> None:
    fn(study_dir, shard=(k, shards), out=part, **kwargs)


def add_shard_options(parser: argparse.ArgumentParser, what: str, out: str) -> None:
    """A command's options for one part by hand: --out (default STUDY/<out>) and --shard K/N, parsed to (K, N);
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
