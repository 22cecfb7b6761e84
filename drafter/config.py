"""Configuration of the drafter."""

from __future__ import annotations

from dataclasses import dataclass

from dspark_serve.drafter.registry import drafter_names

NO_DRAFTER = "none"


def drafter_choices() -> list[str]:
    """Every valid `drafter`: none (plain decoding) and each registered drafter."""
    return [NO_DRAFTER, *drafter_names()]


@dataclass(frozen=True)
class DrafterConfig:
    """Which drafter proposes tokens, and how many per round at most."""

    drafter: str = NO_DRAFTER
    """none (plain decoding) or the name of a registered drafter (drafter/registry.py)."""
    drafter_path: str | None = None
    """Checkpoint directory (DeepSpec format) of a drafter built from one (dflash, dspark, ...);
    None = the one shipped for the embedded model."""
    block_size: int | None = None
    """Most draft tokens per round; None = the checkpoint's block size (ngram: 5)."""
    online_calibration: bool = True
    """Refit the confidence head's per-position calibration from verification outcomes."""

    def __post_init__(self) -> None:
        if self.drafter not in drafter_choices():
            raise ValueError(f"drafter must be one of {drafter_choices()}, got {self.drafter!r}")
        if self.block_size is not None and not (1 <= self.block_size <= 32):
            raise ValueError(f"block_size must be in [1, 32], got {self.block_size!r}")
