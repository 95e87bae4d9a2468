"""Progress where someone watches it: a bar on a terminal. Redirected to a log, each redraw of a bar is a carriage
return and another line's worth of text, thousands of them in a run's log; there the training loop prints one plain
line at a steady interval instead."""

import sys
import time

from tqdm.auto import tqdm

LINE_EVERY_S = 30.0  # a redirected log's progress line: often enough to see a run move, few enough to read the log
LINE_FORMAT = ("{desc}: step {n_fmt}/{total_fmt} ({percentage:.0f}%), {elapsed} elapsed, {remaining} left, "
               "{rate_fmt}{postfix}")


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


def step_progress(total: int, initial: int, speaks: bool, stream=None):
    """The training loop's progress over `total` optimizer steps from `initial`: a tqdm bar on a terminal, a
    ProgressLines in a redirected log, a silent bar where the process does not `speak` (all but a machine's
    first). Each has tqdm's update, set_postfix, write and close."""
    if not speaks or bars_on(stream):
        return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, disable=not speaks)
    return ProgressLines(total, initial, stream=stream)


class ProgressLines:
    """A progress bar for a log: one line (tqdm's own numbers, as LINE_FORMAT words them) every `every` seconds of
    the run, and one at the end, each ending in a newline."""

    def __init__(self, total: int, initial: int = 0, every: float = LINE_EVERY_S, stream=None, clock=time.monotonic):
        self.total, self.n, self.every, self.clock = total, initial, every, clock
        self.stream = sys.stderr if stream is None else stream
        self.start_n, self.start = initial, clock()
        self.last_line, self.shown_n, self.postfix = self.start, initial, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last_line >= self.every:
            self._line()

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def write(self, text: str, file=None) -> None:
        print(text, file=sys.stdout if file is None else file, flush=True)

    def close(self) -> None:
        if self.n != self.shown_n:
            self._line()

    def _line(self) -> None:
        now = self.clock()
        elapsed = now - self.start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else None  # this process's steps: a resume's too
        line = tqdm.format_meter(self.n, self.total, elapsed, prefix="train", unit="step", rate=rate,
                                 postfix=self.postfix or None, bar_format=LINE_FORMAT, initial=self.start_n)
        print(" ".join(line.split()), file=self.stream, flush=True)  # tqdm pads the rate to a fixed width
        self.last_line, self.shown_n = now, self.n
