"""Should this step draft at all? The prefix scheduler prices verification with the target's
cost curve, but drafting itself costs time too, and on small machines (a CPU, a tiny target) a
weak drafter can cost more than it saves. The gate learns, per load level, the decode tokens per
second of steps that drafted and of steps that did not, and picks the better one, trying the
other now and then. It looks only at past steps, never at the drafts of this one, so it cannot
bias the output."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Rate:
    """Exponential moving average of decode tokens per second."""

    value: float = 0.0
    samples: int = 0

    def update(self, x: float, alpha: float) -> None:
        self.value = x if self.samples == 0 else (1 - alpha) * self.value + alpha * x
        self.samples += 1


@dataclass
class DraftGate:
    """warmup: steps of each mode measured per load level before choosing.
    explore_every: after warm-up, every n-th step at a load level runs the mode not chosen.
    alpha: EMA weight of a new step."""

    warmup: int = 4
    explore_every: int = 16
    alpha: float = 0.2
    _rates: dict[tuple[int, bool], _Rate] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def level(num_decodes: int) -> int:
        """Load level: 1, 2-3, 4-7, 8-15, ... decoding requests."""
        return int(math.log2(max(num_decodes, 1)))

    def rate(self, num_decodes: int, drafting: bool) -> float:
        return self._rates.get((self.level(num_decodes), drafting), _Rate()).value

    def should_draft(self, num_decodes: int) -> bool:
        lvl = self.level(num_decodes)
        n = self._steps.get(lvl, 0)
        self._steps[lvl] = n + 1
        on = self._rates.get((lvl, True), _Rate())
        off = self._rates.get((lvl, False), _Rate())
        if on.samples < self.warmup or off.samples < self.warmup:
            return on.samples <= off.samples  # alternate until both are measured
        best = on.value >= off.value
        return (not best) if n % self.explore_every == 0 else best

    def record(self, num_decodes: int, drafting: bool, decode_tokens: int, seconds: float) -> None:
        if num_decodes <= 0 or seconds <= 0:
            return
        key = (self.level(num_decodes), drafting)
        self._rates.setdefault(key, _Rate()).update(decode_tokens / seconds, self.alpha)
