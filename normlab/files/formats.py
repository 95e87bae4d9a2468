"""Reading and writing the repo's small files: JSON, YAML, JSON Lines. Writers replace a file atomically; readers
of files that may be absent return a default."""

import contextlib
import json
import os
from pathlib import Path

import yaml


def atomic_write_text(path, text: str) -> None:
    """Write to a hidden temporary file next to `path`, fsync it, and rename it over `path` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, no permission, an interrupt: no half-written file left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_json(path, obj, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False, default=str) + "\n")


def read_json(path, default=None):
    """The parsed JSON file, or `default` when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read_yaml(path, default=None):
    """The parsed YAML file, or `default` when it is missing or unreadable."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return default


def load_yaml_mapping(path) -> dict:
    """A YAML file that must hold a mapping (a config, a study grid); {} when it is empty. Unlike read_yaml this
    is for files the user wrote: a syntax error or another type raises ValueError naming the file and line."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if not isinstance(data, dict | None):
        raise ValueError(f"{path} must hold a mapping of keys (e.g. `model: {{norm: rmsnorm}}`), "
                         f"got {type(data).__name__}")
    return data or {}


def read_jsonl(path) -> list[dict]:
    """Every record of a JSON Lines file; [] when it does not exist. A last line that does not parse is skipped:
    the torn line a killed writer leaves behind (files here are written one whole line at a time). A bad line
    anywhere else is damage, and raises ValueError naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise ValueError(f"{path} line {number} is not valid JSON; the file is damaged") from None
    return rows


def write_jsonl(path, rows) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # compact separators: the study's records are committed, and a few hundred KB is the difference
    atomic_write_text(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))

