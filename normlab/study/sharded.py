"""One job of a study in N processes: `python -m normlab.cli.<name> STUDY` on every N-th item each (--shard K/N), the
parts merged into one file. E1, the LR choice's dev losses and the records' scoring all run this way, so that they
use the cores the training used, and so that one process or N write the same file."""

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
