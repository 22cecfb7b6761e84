"""Suite-wide test resources.

Memory between tests: the engines the tests build (a model, its KV cache, packed weights) are
freed when their fixtures end, but glibc keeps freed blocks, the more so once an engine has
raised its mmap and trim thresholds (`retain_freed_mib`), so the one pytest process would hold
every module's engines until it exits. After each module, and after any test that grew the
process by more than RELEASE_GROWTH_MIB, the suite collects garbage and hands the free pages
back to the OS (malloc_trim), so its peak is the largest single module's, not their sum.

With DSPARK_TEST_RSS=1 set, each test module's end prints the pytest process's resident memory
(now and peak, from /proc/self/status), the module's wall time and its CPU time (the process's
and its finished children's), so a full run shows which
modules grow the process and which never give the memory back. Unset, it costs nothing.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time

import pytest
import torch

# Without a GPU, Triton's kernels run under its interpreter (on the CPU, as numpy), so the CUDA
# path's kernels are proven anyway. It must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # its `tl.dot` summed in a fixed order, not by the loaded BLAS (tests/triton_interpreter.py)
    from tests.triton_interpreter import install_fixed_order_dot

    install_fixed_order_dot()

RELEASE_GROWTH_MIB = 512
"""Growth of the process's resident memory since the last release that triggers one after a test."""


def _proc_status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS, VmHWM), in MiB; 0.0 where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (less noisy than wall time on a shared
    machine)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _malloc_trim() -> None:
    """Give the C heap's free pages back to the OS (glibc only; elsewhere nothing)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


class MemoryRelease:
    """Releases freed memory after each module and after a test that grew the process; with
    `report`, prints one line per module: RSS after it (and its growth), peak RSS so far, its
    wall time.

    It runs after the whole test protocol: until then the test item still holds its fixtures'
    values (`item.funcargs`), so a module fixture's engine is not yet garbage."""

    def __init__(self, report: bool) -> None:
        self.report = report
        self.rss_after_release = _proc_status_mib("VmRSS")
        self.module: str | None = None  # the module running, from its first test to its last
        self.module_started = 0.0
        self.module_cpu_before = 0.0
        self.module_rss_before = 0.0

    def release(self) -> None:
        gc.collect()
        _malloc_trim()
        self.rss_after_release = _proc_status_mib("VmRSS")

    def print_module(self, module: str) -> None:
        rss = _proc_status_mib("VmRSS")
        sys.stderr.write(
            f"\n[rss] {module}: rss {rss:.0f} MiB ({rss - self.module_rss_before:+.0f}), "
            f"peak {_proc_status_mib('VmHWM'):.0f} MiB, {time.monotonic() - self.module_started:.1f} s, "
            f"cpu {_cpu_seconds() - self.module_cpu_before:.1f} s\n"
        )

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        module = _module(item.nodeid)
        if module != self.module:
            self.module = module
            self.module_started = time.monotonic()
            self.module_cpu_before = _cpu_seconds()
            self.module_rss_before = _proc_status_mib("VmRSS")
        yield
        module_ends = nextitem is None or _module(nextitem.nodeid) != module
        if module_ends or _proc_status_mib("VmRSS") - self.rss_after_release > RELEASE_GROWTH_MIB:
            self.release()
        if module_ends and self.report:
            self.print_module(module)


def pytest_configure(config: pytest.Config) -> None:
    report = os.environ.get("DSPARK_TEST_RSS") == "1"
    config.pluginmanager.register(MemoryRelease(report), "dspark-memory-release")
