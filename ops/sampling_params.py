"""Per-request sampling parameters (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

# repetition_penalty divides positive logits: smaller values scale them past any useful range
# (1e-300 overflowed them to inf and the sampler returned token 0).
REPETITION_PENALTY_MIN = 0.01

# The seeds torch.Generator.manual_seed accepts (int64 and uint64 alike).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    temperature: 0 means greedy (argmax); > 0 divides the logits before softmax.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1.0 = off).
    top_k: keep the k most likely tokens (0 = off).
    seed: per-request seed; the same seed and prompt give the same output.
    min_p: drop tokens whose probability (after temperature) is below min_p times the most
        likely token's (0.0 = off).
    presence_penalty: subtracted once from the logit of every token already generated (0 = off).
    frequency_penalty: subtracted from a generated token's logit per occurrence (0 = off).
    repetition_penalty: tokens of the prompt or the output get positive logits divided by it and
        negative ones multiplied by it (1.0 = off).
    logit_bias: (token id, bias) pairs added to the raw logits (empty = off).
    The penalties and the bias apply to the raw logits, before temperature (ops/processors.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0 <= self.top_k < 2**63):
            raise ValueError(f"top_k must be in [0, 2**63), got {self.top_k!r}")
        if self.seed is not None and not (SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not (REPETITION_PENALTY_MIN <= self.repetition_penalty <= 10.0):
            low, got = REPETITION_PENALTY_MIN, self.repetition_penalty
            raise ValueError(f"repetition_penalty must be in [{low}, 10], got {got!r}")
        for pair in self.logit_bias:
            if len(pair) != 2 or type(pair[0]) is not int or pair[0] < 0 or not (-100.0 <= pair[1] <= 100.0):
                raise ValueError(
                    f"logit_bias entries must be (token id >= 0, bias in [-100, 100]), got {pair!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalized_by_history(self) -> bool:
        """A penalty that depends on the tokens before a position is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def penalized(self) -> bool:
        """The raw logits are changed before temperature (a penalty or a logit bias)."""
        return self.penalized_by_history or bool(self.logit_bias)
