"""The C kernels' narrower code paths, checked on a wider CPU: the library is rebuilt with the
CPU's AMX tiles, its AVX512 extensions (and AMX) or all of AVX switched off, and the kernel,
fast-forward, batch-invariance and drafter tests run against it in a child process. On an
AVX2-only CPU the main suite already runs the AVX2 paths; here an AVX512 host checks them too,
an AMX host its AVX512 paths, and an x86 host the plain C paths other CPUs build."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_serve.ops.cpu_kernels import _cpu_flags, find_compiler

ROOT = Path(__file__).resolve().parents[2]
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
NO_AVX512 = [
    *NO_AMX,
    *(
        "-mno-avx512f -mno-avx512bw -mno-avx512cd -mno-avx512dq -mno-avx512vl -mno-avx512bf16 "
        "-mno-avx512vnni -mno-avx512ifma -mno-avx512vbmi -mno-avx512vbmi2 -mno-avx512bitalg "
        "-mno-avx512vpopcntdq"
    ).split(),
]
NO_AVX = [*NO_AVX512, "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx"]
TESTS = [
    "tests/ops/test_cpu_kernels.py",
    "tests/verifier/test_forward_fast.py",
    "tests/verifier/test_batch_invariance.py",
    "tests/drafter/test_dspark_serving.py",
]
# flags appended to cpu_kernels.CFLAGS, and the CPU flag that makes the build narrower than native
BUILDS = {"avx2": (NO_AVX512, "avx512f"), "no-avx": (NO_AVX, "avx2"), "no-amx": (NO_AMX, "amx_tile")}
CHILD = """
import sys
import dspark_serve.ops.cpu_kernels as ck
ck.CFLAGS = ck.CFLAGS + tuple(sys.argv[1].split())
assert ck.load_kernels() is not None, "the narrower build failed"
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", *sys.argv[2:]]))
"""


def _skip_reason(name: str) -> str | None:
    if platform.machine() not in ("x86_64", "AMD64") or find_compiler() is None:
        return "needs an x86-64 CPU and a C compiler"
    wider = BUILDS[name][1]
    if wider not in _cpu_flags().split():
        return f"this CPU has no {wider}: the main suite already runs the {name} build's paths"
    return None


@pytest.fixture(scope="module")
def child_runs(request, tmp_path_factory):
    """Every selected build's child, started together (each builds, then runs its tests with one
    torch thread: the children overlap instead of queueing) -> (process, its kernel cache)."""
    runs = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.path != request.path or callspec is None or "name" not in callspec.params:
            continue
        name = callspec.params["name"]
        if name in runs or _skip_reason(name) is not None:
            continue
        cache = tmp_path_factory.mktemp(name)
        env = dict(os.environ, XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1")  # a fresh kernel cache
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, " ".join(BUILDS[name][0]), *TESTS],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        runs[name] = (proc, cache)
    yield runs
    for proc, _ in runs.values():
        proc.kill()
        proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_narrower_kernel_builds_pass_the_kernel_tests(name, child_runs):
    reason = _skip_reason(name)
    if reason is not None:
        pytest.skip(reason)
    proc, cache = child_runs[name]
    out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out[-4000:]
    built = list((cache / "dspark-serve" / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1  # the narrower library, and no other, was built and used
