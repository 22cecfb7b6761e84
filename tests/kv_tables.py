"""Block tables for tests that drive a runner's forward directly: in serving, the scheduler's
block allocator owns them and hands each segment its table; here a test holds the allocator."""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.verifier.model_runner import ModelRunner, Segment


class Tables:
    """A block allocator over `runner`'s cache (its methods: append, truncate, free, table...)
    and the segments built on its tables."""

    _of: ClassVar[weakref.WeakKeyDictionary[ModelRunner, Tables]] = weakref.WeakKeyDictionary()

    def __init__(self, runner: ModelRunner) -> None:
        self.blocks = BlockManager(runner.kv.num_blocks, runner.kv.block_size)

    @classmethod
    def of(cls, runner: ModelRunner) -> Tables:
        """The one allocator a test uses for `runner` (made on first use)."""
        if runner not in cls._of:
            cls._of[runner] = cls(runner)
        return cls._of[runner]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.blocks, name)

    def segment(self, request_id: str, token_ids: list[int], start_pos: int, logits_from: int) -> Segment:
        """The segment of request_id's tokens at start_pos (their slots already appended)."""
        return self.blocks.segment(request_id, token_ids, start_pos, logits_from)
