"""A study's per-run records as committed (runs.jsonl.gz): reading them, a digest of what a run measured, and
adding a study's records to a folder that already holds some without overwriting any.

A long study can outlive the machine it ran on: its finished runs are committed, the machine is gone, and the rest
of its seeds train in a fresh study folder. Reporting that folder into the committed one keeps every committed
finished record as it is and adds the new ones; a run finished in both must have measured the same thing."""

import gzip
import hashlib
import io
import json
from pathlib import Path

from normlab.errors import RecordsError
from normlab.study.grid import FINISHED

RECORDS = "runs.jsonl.gz"  # every run's record, compressed: the curves and predictions of ~500 runs
# the records' format: 1 names it in every record; a record without it (studies v2-v5's) is of the same fields
SCHEMA_VERSION = 1


def read_records(path: Path) -> list[dict]:
    """The records of a file; one written by a newer format than this code knows is refused (RecordsError)."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    newer = [r for r in rows if r.get("schema_version", 0) > SCHEMA_VERSION]
    if newer:
        raise RecordsError(f"{path}: run {newer[0].get('name')} is a record of schema_version "
                           f"{newer[0]['schema_version']}; this code reads up to {SCHEMA_VERSION} (update NormLab)")
    return rows


def write_records(path: Path, rows) -> None:
    """Rows as compressed JSON lines, the same bytes for the same rows (no time in the gzip header): a committed
    file regenerated from the same records does not change."""
    with gzip.GzipFile(path, "wb", mtime=0) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


def record_digest(record: dict) -> str:
    """A digest of what a run measured (scores without dev predictions, curves, running statistics, status): equal
    digests mean a retrained run reproduced the committed one exactly."""
    scores = {key: {f: v for f, v in score.items() if not (key.startswith("dev/") and f == "pred")}
              for key, score in (record.get("scores") or {}).items()}
    body = {"scores": scores, "curves": record.get("curves"), "running_stats": record.get("running_stats"),
            "status": record.get("status")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def keep_committed(committed: list[dict], rows: list[dict]) -> list[dict]:
    """The committed records in their order, each run not finished there taking the study's row, then the study's
    runs the committed records do not list. A run finished in both with different measurements is refused:
    committed raw data is never overwritten (report.py --rerun-of compares the two)."""
    study = {r["name"]: r for r in rows}
    for old in committed:
        new = study.get(old["name"])
        if new and old["status"] in FINISHED and new["status"] in FINISHED and record_digest(old) != record_digest(new):
            raise RecordsError(f"run {old['name']} is finished both in the committed records and in the study, and "
                               f"they measured different things; committed records are never overwritten (compare "
                               f"the two with report.py STUDY --rerun-of FOLDER, or remove FOLDER/{RECORDS} to "
                               f"replace them all)")
    listed = {r["name"] for r in committed}
    return [r if r["status"] in FINISHED else study.get(r["name"], r) for r in committed] + \
        [r for r in rows if r["name"] not in listed]
