"""The engine's load: one type (`LoadState`) that the load monitor measures, the policies read
and the metrics export."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from dspark_serve.scheduler.block_manager import BlockManager


@dataclass(frozen=True)
class LoadState:
    """The engine's load at scheduling time.

    num_running: requests decoding this step.
    num_waiting: requests queued, not yet admitted.
    num_prefilling: admitted requests still prefilling (they decode within a few steps).
    prefill_tokens: prompt-chunk tokens already in this step's target batch (they count in B).
    kv_usage: fraction of KV cache blocks in use, 0..1.
    accel_mem_used: bytes allocated on the accelerator (None on CPU or when not measured).
    accel_mem_total: the accelerator's memory in bytes (None on CPU or when not measured).
    """

    num_running: int = 0
    num_waiting: int = 0
    prefill_tokens: int = 0
    kv_usage: float = 0.0
    accel_mem_used: int | None = None
    accel_mem_total: int | None = None
    num_prefilling: int = 0

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "prefill_tokens", "num_prefilling"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not (0.0 <= self.kv_usage <= 1.0):
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage!r}")


class LoadMonitor:
    """Measures what the machine is carrying right now (KV usage, accelerator memory)."""

    def __init__(self, device: torch.device, blocks: BlockManager) -> None:
        self.device, self.blocks = device, blocks

    def snapshot(
        self, num_running: int, num_waiting: int, prefill_tokens: int = 0, num_prefilling: int = 0
    ) -> LoadState:
        used = total = None
        if self.device.type == "cuda":
            import torch  # here only: the policies (and the server's config checks) import LoadState

            used = torch.cuda.memory_allocated(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
        return LoadState(
            num_running,
            num_waiting,
            prefill_tokens,
            min(1.0, float(self.blocks.usage)),
            used,
            total,
            num_prefilling,
        )
