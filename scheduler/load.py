"""The load monitor: what the machine is carrying right now."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoadSnapshot:
    num_running: int
    num_waiting: int
    kv_usage: float                 # fraction of KV blocks in use
    accel_mem_used: int | None      # bytes allocated on the accelerator (None on CPU)
    accel_mem_total: int | None


class LoadMonitor:
    def __init__(self, runner) -> None:
        self.runner = runner

    def snapshot(self, num_running: int, num_waiting: int) -> LoadSnapshot:
        used = total = None
        if self.runner.device.type == "cuda":
            used = torch.cuda.memory_allocated(self.runner.device)
            total = torch.cuda.get_device_properties(self.runner.device).total_memory
        return LoadSnapshot(num_running, num_waiting, self.runner.blocks.usage, used, total)
