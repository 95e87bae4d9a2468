"""Writing a matplotlib figure: the one way the command lines save their charts; and how every figure writes an
LR."""

from pathlib import Path


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
