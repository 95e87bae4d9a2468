"""A study's per-run records as committed (runs.jsonl.gz): reading them, a digest of what a run measured, and
adding a study's records to a folder that already holds some without overwriting any.

A long study can outlive the machine it ran on: its finished runs are committed, the machine is gone, and the rest
of its seeds train in a fresh study folder. Reporting that folder into the committed one keeps every committed
finished record as it is and adds the new ones; a run finished in both must have measured the same thing."""

import dataclasses
import gzip
import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from normlab.errors import RecordsError
from normlab.run_dir import FINISHED

RECORDS = "runs.jsonl.gz"  # every run's record, compressed: the curves and predictions of ~500 runs
# the records' format: 1 names it in every record; a record without it (studies v2-v5's) is version 1
SCHEMA_VERSION = 1
VAL = "val/sorted/running"  # the score the report states: validation, length-sorted batches, running statistics


def schema_version(row: dict, where="") -> int:
    """The record's format (1 where it does not say); a newer one than this code knows is refused (RecordsError)."""
    version = row.get("schema_version", 1)
    if version > SCHEMA_VERSION:
        raise RecordsError(f"{where}run {row.get('name')} is a record of schema_version {version}; this code reads "
                           f"up to {SCHEMA_VERSION} (update NormLab)")
    return version


@dataclass
class RunRecord:
    """One run's record as scoring writes it and a report reads it: its coordinates, status and provenance, its
    curves (step, loss, eval ...) and its scores ({split/batching/statistics: loss, accuracy, pred}); the fields
    this class does not name stay in `extra`, and to_dict gives back the row it was read from."""

    name: str = ""
    status: str = ""
    experiment: str = ""
    experiments: list = field(default_factory=list)  # every experiment that uses the run (shared runs)
    variant: str = ""
    lr: float = math.nan
    warmup: str = "on"
    seed: int = 0
    curves: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)
    commit: str | None = None
    machine: str | None = None
    started_at: str | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict = field(default_factory=dict)
    keys: tuple = field(default=(), repr=False, compare=False)  # the row's own keys, in its order

    @classmethod
    def from_dict(cls, row: dict, where: str = "") -> "RunRecord":
        """The record of a row (RecordsError for a newer schema_version than this code reads)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "keys"}
        record = cls(**{k: v for k, v in row.items() if k in names}, keys=tuple(row),
                     extra={k: v for k, v in row.items() if k not in names})
        record.schema_version = schema_version(row, where)
        record.experiments = record.experiments or [record.experiment]  # a run of one experiment (older records)
        return record

    def to_dict(self) -> dict:
        keys = self.keys or ("schema_version", *(f.name for f in dataclasses.fields(self)
                                                 if f.name not in ("extra", "keys")), *self.extra)
        return {k: self.extra[k] if k in self.extra else getattr(self, k) for k in keys}

    def score(self, what: str = "accuracy", key: str = VAL) -> float:
        return self.scores.get(key, {}).get(what, math.nan)

    def evals(self, what: str = "accuracy") -> dict:
        """{step: the evaluation's `what`} over training, where logged."""
        return {e["step"]: e[what] for e in self.curves.get("eval", []) if e.get(what) is not None}

    @property
    def examples_per_step(self) -> int | None:
        """Training examples per optimizer step (batch x accumulation x processes); None in a record written before
        scoring recorded it."""
        return self.extra.get("examples_per_step")

    @property
    def steps(self) -> int:
        return (self.curves.get("step") or [0])[-1]


def read_records(path: Path) -> list[dict]:
    """The records of a file as rows; one written by a newer format than this code knows is refused (RecordsError)."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        schema_version(row, f"{path}: ")
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
