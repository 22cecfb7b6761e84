"""Freed host memory kept by the process between engine steps (glibc's malloc).

Every step allocates and frees the same large temporaries: the logits, and for sampled requests
the target probabilities, the sort top-p needs and the rejection sampler's buffers, megabytes
each at a few dozen requests. glibc returns a freed block above its mmap threshold (dynamic, at
most 32 MiB) to the OS at once, and trims the heap's free top above its trim threshold, so the
next step maps the same amount afresh and faults every page of it in again (a page fault per
4 KiB, the zeroing included): for many sampled requests the faults can cost as much as the
step's own work (docs/benchmarks.md has the measurement).

The price: up to the threshold of freed memory stays with the process (its high-water mark of
temporaries), as a serving process's memory does anyway. The model's weights and the KV cache,
allocated before this is applied, stay as they were mapped.
"""

from __future__ import annotations

import ctypes

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def retain_freed_memory(mib: int) -> bool:
    """Fix malloc's mmap and trim thresholds at `mib` MiB: freed blocks up to that size are kept
    for the next allocation instead of going back to the OS. Whether it applied: False for
    mib 0 or where the C library has no mallopt (not glibc) or refuses the value."""
    if mib < 0:
        raise ValueError(f"mib must be >= 0, got {mib!r}")
    if mib == 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    size = min(mib, 2047) << 20  # an int: at most 2 GiB - 1 MiB
    return bool(mallopt(M_MMAP_THRESHOLD, size) == 1 and mallopt(M_TRIM_THRESHOLD, size) == 1)
