"""The study reports' Markdown pieces (v3's report.py and v4's report_v4.py alike)."""

import math

import numpy as np

from normlab.study.seedstats import t_interval


def mean_ci(values) -> str:
    """Mean ± 95% t half-width over seeds (the finite values; "n/a" under two)."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if len(x) < 2:
        return "n/a"
    lo, hi = t_interval(x)
    return f"{x.mean():.3f} ± {(hi - lo) / 2:.3f}"


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table and the blank line after it."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]
