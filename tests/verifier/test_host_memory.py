"""Freed host memory kept between steps: a large block freed and allocated again is not
faulted in again once `retain_freed_memory` fixed glibc's thresholds."""

import platform
import subprocess
import sys
import textwrap

import pytest

from dspark_serve.verifier.config import ModelConfig
from dspark_serve.verifier.host_memory import retain_freed_memory

# Allocate, touch and free a 64 MiB block (above glibc's largest dynamic mmap threshold, 32 MiB)
# four times; print the minor page faults of the last three.
PROBE = textwrap.dedent(
    """
    import ctypes, resource, sys
    from dspark_serve.verifier.host_memory import retain_freed_memory
    print(retain_freed_memory(int(sys.argv[1])))
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    n = 64 << 20
    def cycle():
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(p)
    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        cycle()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mib: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(mib)], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_a_freed_block_is_not_faulted_in_again():
    pages = 3 * (64 << 20) // 4096
    applied, faults = _faults(0)  # the allocator's defaults: every cycle maps the block afresh
    assert not applied and faults > pages // 2
    applied, faults = _faults(256)
    assert applied and faults < pages // 20


def test_zero_keeps_the_defaults_and_a_negative_size_is_refused():
    assert retain_freed_memory(0) is False
    with pytest.raises(ValueError, match="-1"):
        retain_freed_memory(-1)
    with pytest.raises(ValueError, match="-5"):
        ModelConfig(retain_freed_mib=-5)
