"""Facts about the machine both the kernels and the model loader read: where the user cache
lives and which CPU features the kernel reports. Read when called, never at import."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """User cache directory (read when called, never at import)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspark-serve"


def cpu_flags(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where there is no /proc/cpuinfo)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags") and ":" in line:
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
