"""SIGTERM/SIGINT as a request to stop training at the next optimizer step, after a checkpoint."""

import signal
import sys
from contextlib import contextmanager


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next step boundary and exits. A second
    signal gets the default behaviour (abort at once)."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        self.signum = signum
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this step "
              f"(send it again to abort)", file=sys.stderr, flush=True)
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @contextmanager
    def installed(self):
        try:
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread (a notebook runner): no handlers, Ctrl-C raises as usual
            self._previous = {}
        try:
            yield self
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

