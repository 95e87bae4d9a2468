"""metrics.jsonl, the run's metrics as one JSON object per line (the names are listed in normlab/train/probes.py)."""

import json
import math
from contextlib import suppress
from pathlib import Path

from normlab.files.formats import atomic_write_text, read_jsonl
from normlab.files.writes import guarded_write


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/inf; events/nonfinite says what happened
    return value


class MetricsWriter:
    """metrics.jsonl: one JSON object per line, flushed per line, so a killed run loses at most one line.
    Main process only."""

    def __init__(self, path, resume_step: int | None = None):
        self.path = Path(path)
        with guarded_write(self.path.name, self.path):
            if resume_step is None:
                self.path.write_text("")
            else:  # the rows after the checkpoint resumed from go: the resumed run writes them again
                kept = [row for row in read_jsonl(self.path) if row.get("step", 0) <= resume_step]
                atomic_write_text(self.path, "".join(json.dumps(row) + "\n" for row in kept))  # as `write` wrote them
            self.file = open(self.path, "a")

    def write(self, row: dict) -> None:
        # a refused write: WriteError (normlab.files.writes), and the file closed (its buffer would fail again at exit)
        with guarded_write(self.path.name, self.path, cleanup=self.close):
            self.file.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")
            self.file.flush()

    def close(self) -> None:
        with suppress(OSError):  # the flush of a line a full disk refused: write() has raised already
            self.file.close()

