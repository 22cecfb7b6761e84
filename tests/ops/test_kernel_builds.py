"""The narrower CPUs' code paths, checked on a wider CPU: each level below the host's
(`platform.CPU_LEVELS`: AVX512 with bf16, AVX512, AVX2, baseline x86-64) runs the kernel,
fast-forward, batch-invariance, loader, platform and drafter tests (the AVX2 one the
Triton-interpreter tests too) in a child
process that is that CPU as far as a process can be (`platform.emulation_env`): the C library is
rebuilt without the wider instructions, the project's dispatch no longer sees their flags (so
`--dtype auto` and the gemm limits pick what that CPU picks), and numpy's OpenBLAS, torch's
vectorised kernels, oneDNN and MKL are held to its instruction set (the BLAS kernel decides the
Triton interpreter's products on an AVX2 CPU). On an AVX2-only CPU the main suite already runs
the AVX2 paths and a child the baseline ones; an AVX512 host runs the AVX2 paths too, an AMX host
its AVX512 paths."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_serve.ops.cpu_kernels import find_compiler
from dspark_serve.ops.platform import CPU_LEVELS, cpu_flags, emulation_env, level_of

ROOT = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/ops/test_cpu_kernels.py",
    "tests/ops/test_quant_kernels.py",  # the GGUF block products' order on that CPU's path
    "tests/verifier/test_forward_fast.py",
    "tests/verifier/test_batch_invariance.py",
    "tests/drafter/test_dspark_serving.py",
    "tests/verifier/test_loader.py",  # the dtype the narrower CPU picks
    "tests/ops/test_platform.py",  # the level it reports and the kernel paths it built
    "tests/ops/test_triton_linear.py",  # the interpreter's products under that CPU's BLAS
]
CHILD = """
import sys
import dspark_serve.ops.cpu_kernels as ck
assert ck.load_kernels() is not None, "the narrower build failed"
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", *sys.argv[1:]]))
"""
NARROWER = [name for name in CPU_LEVELS if name != "amx"]
# The level whose child runs the Triton-interpreter tests too: the one whose BLAS kernel
# (OpenBLAS's Haswell, every AVX2 CPU's) once changed what they computed. The interpreter's
# products no longer depend on the BLAS (tests/triton_interpreter.py), so the other children
# leave them to the main suite.
BLAS_LEVEL = "avx2"


def _skip_reason(name: str) -> str | None:
    if platform.machine() not in ("x86_64", "AMD64") or find_compiler() is None:
        return "needs an x86-64 CPU and a C compiler"
    here = list(CPU_LEVELS).index(level_of(cpu_flags()).name)
    if list(CPU_LEVELS).index(name) <= here:
        return f"this CPU is no wider than {name}: the main suite already runs its paths"
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
        # that CPU's level, a fresh kernel cache, one thread
        env = dict(os.environ, **emulation_env(name), XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *TESTS, *([] if name == BLAS_LEVEL else ["-k", "not triton"])],
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
@pytest.mark.parametrize("name", NARROWER)
def test_narrower_kernel_builds_pass_the_kernel_tests(name, child_runs):
    reason = _skip_reason(name)
    if reason is not None:
        pytest.skip(reason)
    proc, cache = child_runs[name]
    out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out[-4000:]
    built = list((cache / "dspark-serve" / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1  # the narrower library, and no other, was built and used
