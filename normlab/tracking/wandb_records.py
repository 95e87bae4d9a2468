"""Read an offline wandb run back from its `run-<id>.wandb` file: what `wandb sync` would upload. wandb ships no
Python reader for this transaction log, so the framing is read here (format: docs/wandb.md, "Reading offline runs
back") and every payload is parsed with wandb's own protobuf classes. `OfflineRun` folds the records into what the
W&B UI shows: metadata, config (custom charts under `_wandb.visualize`), summary, history and artifacts."""

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_CHUNK = struct.Struct("<IHB")  # crc32, length, type
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class RecordsError(ValueError):
    """Not a wandb transaction log, or a damaged one."""


def read_records(path):
    """Every `Record` of a .wandb file, in order. A torn last chunk (a killed writer) ends the iteration."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if len(data) < _HEADER.size or _HEADER.unpack_from(data)[:2] != (b":W&B", 0xBEE1):
        raise RecordsError(f"{path} is not a wandb transaction log (no :W&B header)")
    pos, payload = _HEADER.size, b""
    while pos + _CHUNK.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        crc, length, kind = _CHUNK.unpack_from(data, pos) if left_in_block >= _CHUNK.size else (0, 0, 0)
        if kind == 0 and length == 0:  # zero padding to the end of the block (or a tail too short for a header)
            pos += left_in_block
            continue
        chunk = data[pos + _CHUNK.size: pos + _CHUNK.size + length]
        if len(chunk) < length:
            return  # torn write at the end of the file
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise RecordsError(f"{path}: checksum mismatch at byte {pos}")
        pos += _CHUNK.size + length
        payload = chunk if kind in (_FULL, _FIRST) else payload + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(payload)
            yield record


def _set(tree: dict, item) -> None:
    """Put one config/summary/history item (key or nested_key, value_json) into a nested dict."""
    path = list(item.nested_key) or [item.key]
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = json.loads(item.value_json)


@dataclass
class OfflineRun:
    """An offline run folded from its records."""

    directory: Path
    id: str = ""
    project: str = ""
    entity: str = ""
    group: str = ""
    job_type: str = ""
    name: str = ""
    tags: list = field(default_factory=list)
    resume: bool = False  # resumable under its id: `wandb sync` appends the parts of one id, oldest first
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    metrics: list = field(default_factory=list)  # define_metric records
    # {"type", "name", "aliases", "files": {path in the artifact: staged local copy}, "metadata"}
    artifacts: list = field(default_factory=list)
    exited: bool = False

    @classmethod
    def read(cls, directory) -> "OfflineRun":
        """`directory`: an `offline-run-*` folder (or the .wandb file itself)."""
        directory = Path(directory)
        files = [directory] if directory.is_file() else sorted(directory.glob("*.wandb"))
        if not files:
            raise RecordsError(f"no .wandb file in {directory}")
        run = cls(directory=files[0].parent)
        for record in read_records(files[0]):
            run._add(record)
        return run

    def _add(self, record) -> None:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            self.id, self.project, self.group, self.job_type = r.run_id, r.project, r.run_group, r.job_type
            self.entity = r.entity
            self.name, self.tags, self.resume = r.display_name, list(r.tags), r.resume
            for item in r.config.update:
                _set(self.config, item)
        elif kind in ("config", "summary"):  # self.config, self.summary
            for item in getattr(record, kind).update:
                _set(getattr(self, kind), item)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                _set(row, item)
            self.history.append(row)
        elif kind == "metric":
            m = record.metric
            self.metrics.append({"name": m.name or m.glob_name, "step_metric": m.step_metric})
        elif kind == "artifact":
            a = record.artifact
            self.artifacts.append({
                "type": a.type, "name": a.name, "aliases": list(a.aliases),
                "metadata": json.loads(a.metadata) if a.metadata else {},
                "files": {c.path: c.local_path for c in a.manifest.contents}})
        elif kind == "exit":
            self.exited = True

    def charts(self) -> dict:
        """Custom charts (wandb.plot.*): key -> W&B panel id, e.g. 'wandb/lineseries/v0'."""
        visualize = self.config.get("_wandb", {}).get("visualize", {})
        return {key: v["panel_config"]["panelDefId"] for key, v in visualize.items()}

    def table(self, key: str) -> dict:
        """The last logged wandb.Table under `key` ({"columns": [...], "data": [[...], ...]}); for a custom chart
        `key`, its data table (`<key>_table`)."""
        entry = self.summary.get(key) or self.summary.get(f"{key}_table")
        if not isinstance(entry, dict) or entry.get("_type") != "table-file":
            raise KeyError(f"no table logged under {key!r}")
        return json.loads((self.directory / "files" / entry["path"]).read_text())


def offline_runs(wandb_dir) -> list[OfflineRun]:
    """Every offline run under a wandb directory (e.g. <output_dir>/wandb), oldest first."""
    return [OfflineRun.read(d) for d in sorted(Path(wandb_dir).glob("offline-run-*"))]

