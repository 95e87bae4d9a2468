"""Writing a matplotlib figure: the one way the command lines save their charts; how every figure writes an LR;
and the y axis of a chart of training metrics: logarithmic only where the values span a factor of LOG_RATIO,
labelled in plain numbers."""

import math
from pathlib import Path

LOG_RATIO = 10  # a y axis is logarithmic when its positive values span at least this factor


def save_figure(fig, out: Path, dpi: int = 80) -> None:
    """`fig` into `out` in the format its suffix names, then closed; a PNG gets a 256-colour palette (a third of
    the bytes, the same picture: these charts have few colours)."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=dpi)
    finally:
        plt.close(fig)
    if Path(out).suffix.lower() == ".png":
        from PIL import Image  # matplotlib's dependency

        Image.open(out).convert("RGB").quantize(256).save(out, optimize=True)


def lr_text(value: float) -> str:
    """An LR as every figure writes it: two significant digits in powers of ten, `5e-4`, `1.8e-3`."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def y_scale(values) -> str:
    """log when no value is negative and the positive ones span LOG_RATIO or more; linear otherwise."""
    positive = [v for v in values if v > 0]
    if not positive or min(values) < 0:
        return "linear"
    return "log" if max(positive) / min(positive) >= LOG_RATIO else "linear"


def plain_log_ticks(axis, low: float, high: float) -> None:
    """A log axis's labels as plain numbers (matplotlib writes 6x10^0); on an axis that shows fewer than two powers
    of ten, too few to read it by, also its 2s, 3s and 5s."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3g}"))
    few = math.floor(math.log10(high)) - math.ceil(math.log10(low)) < 1

    def minor(value, _):
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
        return f"{value:.3g}" if few and round(mantissa, 6) in (2, 3, 5) else ""
    axis.set_minor_formatter(FuncFormatter(minor))


def scale_y(ax, values) -> None:
    """`ax`'s y axis for these values: y_scale's rule, and a log axis labelled by plain_log_ticks."""
    ax.set_yscale(y_scale(values))
    if ax.get_yscale() == "log":
        plain_log_ticks(ax.yaxis, *ax.get_ylim())
