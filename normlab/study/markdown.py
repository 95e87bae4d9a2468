"""The study report's Markdown pieces."""

import math

import numpy as np

from normlab.study.seedstats import t_interval


def mean_ci(values) -> str:
    """Mean ± 95% t half-width over seeds (the finite values); one seed: its value; none: "no runs"."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if len(x) < 2:
        return f"{x[0]:.3f} (one seed)" if len(x) else "no runs"
    lo, hi = t_interval(x)
    return f"{x.mean():.3f} ± {(hi - lo) / 2:.3f}"


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table and the blank line after it."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]
