"""The step overhead estimate: seconds per step outside the target forward, per load level."""

import pytest

from dspark_serve.scheduler.overhead import StepOverhead


def test_it_tracks_each_level_and_answers_from_the_nearest():
    o = StepOverhead(alpha=0.5)
    assert o.seconds(4) is None
    o.record(4, step_seconds=0.030, forward_seconds=0.020)
    assert o.seconds(4) == pytest.approx(0.010)
    o.record(4, step_seconds=0.034, forward_seconds=0.020)  # moves halfway to 0.014
    assert o.seconds(4) == pytest.approx(0.012)
    o.record(16, step_seconds=0.090, forward_seconds=0.060)
    assert o.seconds(16) == pytest.approx(0.030)
    assert o.seconds(1) == pytest.approx(0.012) and o.seconds(12) == pytest.approx(0.030)
    assert o.seconds(10) == pytest.approx(0.012)  # a tie goes to the lower level
    o.record(4, step_seconds=0.010, forward_seconds=0.020)  # never negative
    assert o.seconds(4) == pytest.approx(0.006)


def test_a_settled_level_clips_outliers():
    o = StepOverhead(alpha=0.5, clip=2.0, settled=3)
    for _ in range(3):
        o.record(2, 0.011, 0.010)
    o.record(2, 1.010, 0.010)  # a pause of a second counts as twice the estimate
    assert o.seconds(2) == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="alpha"):
        StepOverhead(alpha=0.0)
    with pytest.raises(ValueError, match="clip"):
        StepOverhead(clip=1.0)
    with pytest.raises(ValueError, match="settled"):
        StepOverhead(settled=0)
