"""What the data modules share: the one error they raise, reading a column, the cache folder, and the check that a
split holds text. sources.py finds and checks a dataset, documents.py composes documents of its sentences; both
import this module and not each other."""

import os
from pathlib import Path

from normlab.paths import REPO_ROOT


class DataError(ValueError):
    """A problem with the data (missing, empty, wrong columns or labels); the message says how to fix it."""


def column(ds, col: str) -> list:
    """One column as a Python list, fast (iterating `ds[col]` row by row decodes one row at a time)."""
    return ds.select_columns([col])[:][col]


def cache_dir() -> Path:
    """$NORMLAB_CACHE or REPO_ROOT/.cache (tokenizers go in its tokenizers/ folder)."""
    return Path(os.environ.get("NORMLAB_CACHE") or REPO_ROOT / ".cache")


def check_text(ds, split: str, col: str, source: str):
    from datasets import Value

    text_cols = [c for c, f in ds.features.items() if isinstance(f, Value) and f.dtype in ("string", "large_string")]
    if col not in ds.column_names:
        fix = f"set data.text_column={text_cols[0]}" if text_cols else "set data.text_column to the text column"
        raise DataError(f"text column {col!r} not in split {split!r} of {source} (columns: "
                        f"{', '.join(ds.column_names)}); {fix}")
    feature = ds.features[col]
    if col not in text_cols:
        kind = feature.dtype if isinstance(feature, Value) else type(feature).__name__
        if kind == "null":  # what a reader infers for a column with nothing in it
            raise DataError(f"every row of split {split!r} of {source} has empty text in column {col!r}; "
                            f"fill the column or set data.text_column to the text column")
        fix = f"set data.text_column to one of: {', '.join(text_cols)}" if text_cols else "give a column of strings"
        raise DataError(f"data.text_column={col!r} holds {kind}, not text, in split {split!r} of {source}; {fix}")
    bad = [i for i, t in enumerate(column(ds, col)) if t is None or not t.strip()]
    if bad:
        raise DataError(f"{len(bad)} of {len(ds)} rows in split {split!r} of {source} have empty or missing text in "
                        f"column {col!r} (first: row {bad[0]}); drop or fill those rows")
