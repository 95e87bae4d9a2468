"""Loss spikes, counted live by train.py and over a finished curve.

Loss spike (the definition the README quotes): step t is a spike when its loss exceeds the exponential moving
average of the previous losses by more than `threshold` times their exponential moving standard deviation,
and by at least `min_rel` of the average (so tiny wiggles on a flat curve never count). The first `warmup`
steps only feed the averages: early losses fall fast and are not spikes. A spike does not update the averages,
so one spike does not hide the next. Defaults: beta=0.98 (about a 50-step window), threshold=6, min_rel=0.2.
"""

import math
from collections.abc import Mapping


class LossSpikeDetector:
    """Online spike detector; `update(loss)` returns True when `loss` is a spike (see module docstring)."""

    def __init__(self, beta: float = 0.98, threshold: float = 6.0, min_rel: float = 0.2, warmup: int = 20):
        self.beta, self.threshold, self.min_rel, self.warmup = beta, threshold, min_rel, warmup
        self.mean = None
        self.var = 0.0
        self.seen = 0
        self.spikes = 0

    def update(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return False  # non-finite losses are their own event (divergence), not spikes
        self.seen += 1
        if self.mean is None:
            self.mean = loss
            return False
        deviation = loss - self.mean
        is_spike = (
            self.seen > self.warmup
            and deviation > self.threshold * math.sqrt(self.var)
            and deviation > self.min_rel * abs(self.mean)
        )
        if is_spike:
            self.spikes += 1
            return True
        self.mean += (1 - self.beta) * deviation
        self.var = self.beta * (self.var + (1 - self.beta) * deviation * deviation)
        return False

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "seen": self.seen, "spikes": self.spikes}

    def load_state_dict(self, state: Mapping) -> None:
        self.mean, self.var, self.seen, self.spikes = state["mean"], state["var"], state["seen"], state["spikes"]
