"""SIGTERM/SIGINT as a request to stop training at the next optimizer step, after a checkpoint."""

import signal
import sys
import time
from contextlib import contextmanager

# One stop usually arrives more than once. `timeout`, `kill -- -PGID`, Ctrl-C and schedulers signal every process
# of the job, and the launcher passes its own signal on to the training process a few milliseconds later:
# accelerate launch's single-process launcher answers SIGTERM or SIGINT with a SIGTERM to its child, torchrun's agent
# (accelerate launch with several processes) with the same signal to each worker. A person who means "abort now"
# sends again seconds later. So signals within this many seconds of the first one are that same request.
SAME_REQUEST_S = 2.0


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next step boundary and exits. Another signal
    within `same_request_s` of the first is the same request (see SAME_REQUEST_S) and changes nothing; one after
    that aborts with the handler that was there before: SIGTERM's default ends the process at once (status 143, no
    checkpoint), SIGINT's raises KeyboardInterrupt."""

    def __init__(self, same_request_s: float = SAME_REQUEST_S):
        self.signum = None
        self.same_request_s = same_request_s
        self._first_at = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now  # before printing: a repeat may run this again meanwhile
            print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this step (to abort, "
                  f"send it again {self.same_request_s:g} s or more from now)", file=sys.stderr, flush=True)
        elif now - self._first_at >= self.same_request_s:
            self._restore()
            signal.raise_signal(signum)  # now under the previous handler

    def _restore(self):
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
            self._restore()
