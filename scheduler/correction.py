"""Online correction of the cost table from the forwards the engine measures.

The profiled table (scheduler/profile.py) is one measurement, taken at start-up: a shared GPU, a
clock change, a CPU neighbour or a table profiled on another path make it wrong, and a policy
that obeys a wrong table verifies the wrong number of drafts. Every pure decode/verify step
gives one sample of measured over predicted forward time; the correction keeps an exponentially
weighted mean of its logarithm per region of the table, a region being a (requests, tokens per
request) cell on powers of two, so the correction learned where drafts are verified does not
leak into plain decoding at the same load and vice versa. The factor of a region nobody has
measured yet is its nearest measured neighbour's (requests first), or 1.

With alpha 0.2 a new level is followed within about ten steps (milliseconds on a GPU, well
within seconds on a CPU); a sample more than `clip` times off the estimate (a pause of the
process) counts as `clip` times once the region has settled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _bucket(x: float) -> int:
    """The power of two at or below x (x >= 1)."""
    return 1 << max(0, int(math.floor(math.log2(max(1.0, x)))))


@dataclass
class CostCorrection:
    alpha: float = 0.2
    clip: float = 4.0
    settled: int = 5
    max_factor: float = 16.0
    _regions: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict, init=False, repr=False)
    last_predicted: float = field(default=0.0, init=False)
    last_measured: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if not (self.clip > 1.0 and self.max_factor > 1.0):
            raise ValueError(f"clip and max_factor must be > 1, got {self.clip!r}, {self.max_factor!r}")

    @staticmethod
    def region(tokens: float, requests: int) -> tuple[int, int]:
        r = max(1, requests)
        return _bucket(r), _bucket(tokens / r)

    def record(self, tokens: float, requests: int, predicted: float, measured: float) -> None:
        """One forward of `tokens` tokens from `requests` requests: predicted by the profiled
        table (uncorrected), measured by the engine (seconds)."""
        if not (predicted > 0 and measured > 0 and math.isfinite(predicted) and math.isfinite(measured)):
            return
        self.last_predicted, self.last_measured = predicted, measured
        key = self.region(tokens, requests)
        x = math.log(measured / predicted)
        old = self._regions.get(key)
        if old is None:
            self._regions[key] = (x, 1)
            return
        est, n = old
        if n >= self.settled:
            lim = math.log(self.clip)
            x = min(max(x, est - lim), est + lim)
        self._regions[key] = (est + self.alpha * (x - est), n + 1)

    def factor(self, tokens: float, requests: int | None) -> float:
        """Measured over predicted forward time where a forward of `tokens` tokens from
        `requests` requests falls (its region, else the nearest measured one), 1 before any."""
        if not self._regions:
            return 1.0
        r = requests if requests is not None and requests >= 1 else 1
        want = self.region(tokens, r)
        key = min(
            self._regions,
            key=lambda k: (abs(math.log2(k[0] / want[0])), abs(math.log2(k[1] / want[1])), k),
        )
        lim = math.log(self.max_factor)
        return math.exp(min(max(self._regions[key][0], -lim), lim))
