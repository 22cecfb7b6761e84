"""Per-request sampling parameters (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

# The seeds torch.Generator.manual_seed accepts (int64 and uint64 alike).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    temperature: 0 means greedy (argmax); > 0 divides the logits before softmax.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1.0 = off).
    top_k: keep the k most likely tokens (0 = off).
    seed: per-request seed; the same seed and prompt give the same output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0 <= self.top_k < 2**63):
            raise ValueError(f"top_k must be in [0, 2**63), got {self.top_k!r}")
        if self.seed is not None and not (SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
