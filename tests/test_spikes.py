"""Spike counting on hand-made numbers."""

import math

from normlab.train.spikes import LossSpikeDetector


def count_loss_spikes(losses, **detector_kwargs) -> int:
    """Spikes in a finished loss curve, by the rule the live detector applies step by step."""
    detector = LossSpikeDetector(**detector_kwargs)
    for loss in losses:
        detector.update(float(loss))
    return detector.spikes


def test_smooth_decreasing_curve_has_no_spikes():
    losses = [2.0 * math.exp(-t / 100) + 0.3 for t in range(500)]
    assert count_loss_spikes(losses) == 0


def test_isolated_jumps_are_counted_each_once():
    losses = [1.0 + 0.01 * ((t * 7) % 5) for t in range(300)]
    losses[100] = 3.0
    losses[200] = 2.5
    assert count_loss_spikes(losses) == 2


def test_warmup_and_nonfinite_are_not_spikes():
    losses = [5.0, 1.0, 9.0] + [1.0] * 50 + [float("nan"), float("inf")] + [1.0] * 10
    assert count_loss_spikes(losses, warmup=5) == 0


def test_detector_state_round_trip_continues_identically():
    losses = [1.0 + 0.02 * ((t * 3) % 7) for t in range(80)] + [4.0] + [1.0] * 20
    a = LossSpikeDetector()
    for x in losses[:50]:
        a.update(x)
    b = LossSpikeDetector()
    b.load_state_dict(a.state_dict())
    assert [a.update(x) for x in losses[50:]] == [b.update(x) for x in losses[50:]]
    assert a.spikes == b.spikes == 1

