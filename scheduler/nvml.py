"""GPU load as an operator reads it: utilisation and memory of each GPU from NVML, at scrape time.

Exported beside the engine's metrics when `pynvml` (the nvidia-ml-py package) imports and NVML
initialises, that is on a machine with an NVIDIA driver; elsewhere nothing is registered.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

UTILIZATION = "dspark:gpu_utilization_perc"
MEMORY_USED = "dspark:gpu_memory_used_bytes"


class NvmlCollector(Collector):
    def __init__(self, nvml: Any, model_name: str) -> None:
        self.nvml, self.model_name = nvml, model_name

    @classmethod
    def create(cls, model_name: str) -> NvmlCollector | None:
        """The collector where NVML answers, else None."""
        try:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            nvml.nvmlDeviceGetCount()
        except Exception:  # not installed, no driver, no device: nothing to export
            return None
        return cls(nvml, model_name)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model_name", "gpu"]
        util = GaugeMetricFamily(
            UTILIZATION, "GPU busy time over NVML's last sample period (0-100).", labels=labels
        )
        mem = GaugeMetricFamily(MEMORY_USED, "GPU memory in use, all processes (NVML).", labels=labels)
        nv = self.nvml
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util.add_metric([self.model_name, str(i)], float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
                mem.add_metric([self.model_name, str(i)], float(nv.nvmlDeviceGetMemoryInfo(h).used))
        except Exception:  # a driver hiccup must not break the scrape of everything else
            return
        yield util
        yield mem
