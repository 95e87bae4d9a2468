"""Did a retrained study reproduce the committed one? A rerun of a preset (same runs, another time, maybe another
commit) is compared run by run with the committed records, by a digest of what each run measured; its provenance and
digests go into the records' folder under rerun/, beside the committed records, which are never rewritten.

    python scripts/report.py STUDY_DIR --rerun-of docs/study-v4/quick    # writes docs/study-v4/quick/rerun/
"""

from pathlib import Path

from normlab.files.formats import atomic_write_json
from normlab.study.records import RECORDS, read_records, record_digest, write_records
from normlab.study.study_dir import PROVENANCE, StudyDir

RERUN = "rerun"  # the folder, inside the committed records' folder, that holds a rerun's digests


def eval_steps(record: dict) -> list[int]:
    return [e["step"] for e in (record.get("curves") or {}).get("eval", [])]


def at_steps(record: dict, steps) -> dict:
    """`record` with only its evaluations at `steps`: what a rerun that evaluates less often (a preset changed to
    evaluate a run only at its end, say) must still reproduce, evaluating having left training as it was."""
    curves = record.get("curves") or {}
    return {**record, "curves": {**curves, "eval": [e for e in curves.get("eval", []) if e["step"] in set(steps)]}}


def committed_digest(committed: dict | None, row: dict) -> str | None:
    """The committed record's digest as a rerun row compares with it: at the row's `eval_steps` if it has them."""
    if committed is None:
        return None
    return record_digest(at_steps(committed, row["eval_steps"]) if "eval_steps" in row else committed)


def rerun_matches(folder: Path, rerun: str = RERUN) -> tuple[int, int]:
    """(runs of FOLDER/RERUN whose record digest equals the committed record's, runs of the rerun)."""
    committed = {r["name"]: r for r in read_records(Path(folder) / RECORDS)}
    rows = read_records(Path(folder) / rerun / RECORDS)
    return sum(committed_digest(committed.get(r["name"]), r) == r["record_sha256"] for r in rows), len(rows)


def write_rerun(study_dir: Path, folder: Path, rerun: str = RERUN) -> tuple[list[str], int, int, int]:
    """Each run of the scored study `study_dir` as a row of provenance and record digest, into folder/RERUN/ with the
    study's invocations (meta.json); returns the names of the runs whose record differs from the committed one (or
    that the committed records lack), the number of runs, how many of them evaluated at other steps than their
    committed record (compared at the steps they evaluated; the row keeps them as `eval_steps`), and how many of the
    differing runs trained with another CPU thread count than their committed record, or where it does not say."""
    folder = Path(folder)
    records, study = StudyDir(study_dir).scored_runs()
    if not (folder / RECORDS).is_file():
        raise FileNotFoundError(f"{folder / RECORDS} not found: give the folder of the committed records it retrains")
    committed = {r["name"]: r for r in read_records(folder / RECORDS)}
    out = folder / rerun
    out.mkdir(parents=True, exist_ok=True)
    differ, other_steps, other_threads = [], 0, 0
    rows = []
    for record in records:
        row = {"name": record["name"], **{k: record[k] for k in PROVENANCE if k in record},
               "status": record.get("status"), "record_sha256": record_digest(record),
               **({"cpu_threads": record["cpu_threads"]} if record.get("cpu_threads") else {})}
        base = committed.get(row["name"])
        if base is not None and eval_steps(record) != eval_steps(base):
            row["eval_steps"] = eval_steps(record)
            other_steps += 1
        if committed_digest(base, row) != row["record_sha256"]:
            differ.append(row["name"])
            threads = (base or {}).get("cpu_threads")
            other_threads += base is not None and (threads is None or threads != record.get("cpu_threads"))
        rows.append(row)
    write_records(out / RECORDS, rows)
    atomic_write_json(StudyDir(out).meta_file, {"name": study.get("name"), "invocations": study.get("invocations", [])},
                      indent=1)
    return differ, len(rows), other_steps, other_threads
