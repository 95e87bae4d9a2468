"""A study folder and every file in it, by name in one place: a study directory the runner trains into
(study.json, runs/, logs/, runs.jsonl) and a folder of records a report is made from (runs.jsonl.gz, meta.json,
selection.json, spec.yaml ...). The spec a report reads is the snapshot stored here when the study started, never
today's preset (docs/studies.md, "Files")."""

import os
import shutil
import subprocess
import time
from pathlib import Path

from normlab.errors import RecordsError, StudyError
from normlab.files.formats import atomic_write_json, read_json, read_jsonl
from normlab.paths import REPO_ROOT
from normlab.study.records import RECORDS, RunRecord, read_records
from normlab.study.selection_file import read_selection

SPEC, HOOKS = "spec.yaml", "hooks.py"  # the study file as it ran, and its hook file (measures)
STUDY_JSON, SCORED, SELECTION, META = "study.json", "runs.jsonl", "selection.json", "meta.json"
SIGNAL, LABELS, DOCUMENTS = "signal.jsonl", "labels.json", "documents.jsonl"
TABLES = ("signal", "documents")  # extra tables a study may have (per arm, seed or eval row): NAME.jsonl
COPIED = (SELECTION, LABELS, SIGNAL, DOCUMENTS, SPEC, HOOKS)  # into a records folder as the study wrote them
PROVENANCE = ("experiments", "commit", "machine", "started_at", "duration_s")  # a run's study.json entry's


class StudyDir:
    def __init__(self, path):
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    study_json = property(lambda self: self.path / STUDY_JSON, doc="the runner's record of the study and its runs")
    scored = property(lambda self: self.path / SCORED, doc="every run's record, as scoring writes them")
    selection_file = property(lambda self: self.path / SELECTION, doc="the LR choices")
    meta_file = property(lambda self: self.path / META, doc="a records folder's name and invocations")
    labels_file = property(lambda self: self.path / LABELS, doc="the gold labels the predictions score against")
    documents_file = property(lambda self: self.path / DOCUMENTS, doc="the eval documents' sizes (data.doc_sizes)")

    def majority_share(self, split: str = "val") -> float | None:
        """The accuracy of always answering the split's most common class, from the gold labels scoring wrote; None
        where there are none. Each dataset has its own (SST-2's validation 0.509, the documents' eval split 0.594)."""
        gold = read_json(self.labels_file).get(split) if self.labels_file.is_file() else None
        return max(gold.count(c) for c in set(gold)) / len(gold) if gold else None

    def run(self, name: str) -> Path:
        """A run's directory (its RunDir)."""
        return self.path / "runs" / name

    def log(self, name: str) -> Path:
        return self.path / "logs" / f"{name}.log"

    @property
    def is_study(self) -> bool:
        """A directory the runner trained into (not only a folder of records)."""
        return self.study_json.is_file()

    def meta(self) -> dict:
        return read_json(self.meta_file, {}) or {}

    def frozen_at(self) -> str | None:
        """The commit whose code regenerates this finished study's report (meta.json `report_commit`)."""
        return self.meta().get("report_commit")

    def save_spec(self, spec) -> None:
        """The study file as it runs (and its hook file), kept beside the runs for every later stage and report;
        rewritten only when it changed."""
        self.path.mkdir(parents=True, exist_ok=True)
        files = {SPEC: spec.path, **({HOOKS: Path(spec.hooks)} if spec.hooks else {})}
        for name, source in files.items():
            if not (self.path / name).is_file() or (self.path / name).read_bytes() != source.read_bytes():
                shutil.copyfile(source, self.path / name)

    def spec(self, quiet: bool = True):
        """The spec snapshot this folder holds (StudyError when there is none, or it is not a valid spec)."""
        from normlab.study.spec import StudySpec

        if not (self.path / SPEC).is_file():
            raise StudyError(f"{self.path}: no {SPEC}, the study's spec as it ran; a study started by "
                             f"scripts/study.py keeps one (copy the study file there as {SPEC} to report it)")
        return StudySpec.load(self.path / SPEC, quiet=quiet, hooks_file=self.path / HOOKS)

    def scored_runs(self) -> tuple[list[dict], dict]:
        """(every run's record as scoring wrote it, joined with the provenance study.json keeps for its run,
        study.json); FileNotFoundError naming the command when the study is not scored yet."""
        if not self.scored.is_file():
            raise FileNotFoundError(f"{self.scored} not found: score the study first "
                                    f"(python scripts/score_runs.py {self.path})")
        study = read_json(self.study_json)
        entries = study["runs"]
        return [{**r, **{k: v for k, v in entries.get(r["name"], {}).items() if k in PROVENANCE}}
                for r in read_jsonl(self.scored)], study

    def records(self) -> list[RunRecord]:
        if not (self.path / RECORDS).is_file():
            raise RecordsError(f"{self.path / RECORDS} not found: give a scored study directory (after "
                               f"scripts/score_runs.py) or a folder of records")
        return [RunRecord.from_dict(r) for r in read_records(self.path / RECORDS)]

    def selection(self) -> dict:
        return read_selection(self.selection_file)

    def tables(self) -> dict:
        return {name: read_jsonl(self.path / f"{name}.jsonl") for name in TABLES
                if (self.path / f"{name}.jsonl").is_file()}


# ---------------------------------------------------------------------------------------------------------------
# provenance: where and from which code a study's runs and measurements were made


def machine() -> str:
    """What study.json records a run ran on: the GPUs, or the CPU's name; and the cores."""
    import torch

    from normlab.train.machine import cpu_name

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {os.cpu_count()} CPU cores"
    return f"{cpu_name()}, {os.cpu_count()} CPU cores, no GPU"


def git(*args) -> str:
    """A git command's output in this checkout ("" where it fails)."""
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()


def git_commit() -> str | None:
    """The checkout's commit, with "+dirty" when tracked files differ from it (the runs then are not that commit's)."""
    commit = git("rev-parse", "--short", "HEAD") or None
    return commit and commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def record_invocation(study_dir: Path, command: str, started: float, in_process: bool = False,
                      commit: str | None = None) -> None:
    """Append this command's commit (`commit`: the one it started at; default: now's), machine, wall time and CPU
    time to study.json: of the processes it started, or (in_process: a measurement in one process) its own."""
    path = StudyDir(study_dir).study_json
    data = read_json(path)
    times = os.times()
    cpu = times.user + times.system if in_process else times.children_user + times.children_system
    data.setdefault("invocations", []).append({
        "command": command, "commit": commit or git_commit(), "machine": machine(), "started": time.strftime(
            "%Y-%m-%d %H:%M:%S%z", time.localtime(started)), "wall_s": round(time.time() - started, 1),
        "cpu_s": round(cpu, 1)})
    atomic_write_json(path, data, indent=1)


def provenance() -> dict:
    """What every record carries about where it was made: commit, machine, start time."""
    return {"commit": git_commit(), "machine": machine(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
