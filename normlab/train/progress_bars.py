"""Progress bars only where someone watches them: on a terminal. Redirected to a log, each redraw of a bar is a
carriage return and another line's worth of text, thousands of them in a run's log."""

import sys


def bars_on(stream=None) -> bool:
    """Whether progress bars show: only when `stream` (default stderr, where they draw) is a terminal. When it is
    not, this turns off the bars of transformers (loading and writing weights), huggingface_hub and datasets for
    the process, and the caller leaves out its own."""
    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        return True
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # huggingface_hub's too
    datasets.disable_progress_bars()
    return False
