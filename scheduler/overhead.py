"""What an engine step costs besides the target forward, per load level.

The prefix scheduler weighs each extra verified draft against what it adds to the step's time.
The cost table prices the target forward alone; a speculative step also drafts, samples the
verification and books its results, and that part is paid once a step whatever the batch. On
a GPU it is small beside the forward; on a CPU with a small target it is a sizeable share of a
step (bench/step_breakdown.py splits a step into its parts), and pricing the forward alone makes
every verified draft look dearer than it is (the policy then verifies fewer drafts than pay).
Measured from past steps only, so the lengths it moves never depend on this step's drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOverhead:
    """Exponentially weighted seconds per step outside the target forward, per number of
    decoding requests (the load level), from steps that drafted.

    alpha: weight of the newest step, in (0, 1].
    clip: a sample above clip x the level's estimate counts as clip x the estimate (a pause of
        the process, a collector run), once the level has `settled` samples.
    settled: samples a level takes before its estimate clips new ones (>= 1).
    """

    alpha: float = 0.1
    clip: float = 3.0
    settled: int = 5
    _levels: dict[int, tuple[float, int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0.0 < self.alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if not self.clip > 1.0:
            raise ValueError(f"clip must be > 1, got {self.clip!r}")
        if self.settled < 1:
            raise ValueError(f"settled must be >= 1, got {self.settled!r}")

    def record(self, requests: int, step_seconds: float, forward_seconds: float) -> None:
        """One drafting step of `requests` decoding requests that took `step_seconds`, of
        which the target forward took `forward_seconds`."""
        if requests < 1:
            return
        x = max(0.0, step_seconds - forward_seconds)
        old = self._levels.get(requests)
        if old is None:
            self._levels[requests] = (x, 1)
            return
        est, n = old
        if n >= self.settled:
            x = min(x, self.clip * est)
        self._levels[requests] = (est + self.alpha * (x - est), n + 1)

    def seconds(self, requests: int) -> float | None:
        """The estimate at `requests` decoding requests, from the nearest measured level
        (the lower one on a tie: its overhead is the smaller); None before any step."""
        if not self._levels:
            return None
        level = min(self._levels, key=lambda lv: (abs(lv - requests), lv))
        return self._levels[level][0]
