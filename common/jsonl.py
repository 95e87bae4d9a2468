"""JSON Lines files of records (one JSON object per line), as the study writes and the report reads them."""

import json
from pathlib import Path


def write_jsonl(path: Path, rows) -> None:
    """Compact separators: the study's records are committed, and a few hundred KB is the difference."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    """Every record of `path`; [] when it does not exist (a study without that part)."""
    path = Path(path)
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
