"""Configuration of the drafter."""
from __future__ import annotations

from dataclasses import dataclass

DRAFTER_CHOICES = ("none", "ngram", "dflash", "dspark", "dspark+ngram")


@dataclass(frozen=True)
class DrafterConfig:
    """Which drafter proposes tokens, and how many per round at most."""

    drafter: str = "none"
    """none (plain decoding), ngram (prompt lookup), dflash, dspark, or dspark+ngram (both,
    chosen per request and step by their recent acceptance)."""
    drafter_path: str | None = None
    """Checkpoint directory for dflash/dspark (DeepSpec format); None = the shipped one."""
    block_size: int | None = None
    """Most draft tokens per round; None = the checkpoint's block size (ngram: 5)."""
    online_calibration: bool = True
    """Refit the confidence head's per-position calibration from verification outcomes."""

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTER_CHOICES:
            raise ValueError(f"drafter must be one of {DRAFTER_CHOICES}, got {self.drafter!r}")
        if self.block_size is not None and not (1 <= self.block_size <= 32):
            raise ValueError(f"block_size must be in [1, 32], got {self.block_size!r}")
