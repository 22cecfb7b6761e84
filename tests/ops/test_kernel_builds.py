"""The narrower CPUs' code paths, checked on a wider CPU: the C library is rebuilt with the CPU's
AMX tiles, AVX512's bf16 extension, all of AVX512 or all of AVX switched off, and the kernel,
fast-forward, batch-invariance, loader, drafter and Triton-interpreter tests run against it in a
child process that also sees that CPU: the project's feature dispatch (`platform.cpu_flags`) no
longer reports the hidden flags (so `--dtype auto` and the gemm limits pick what that CPU
picks), and numpy's OpenBLAS, torch's vectorised kernels, oneDNN and MKL are held to its
instruction set (the BLAS kernel decides the Triton interpreter's products on an AVX2 CPU).
On an AVX2-only CPU the main suite already runs the AVX2 paths; here an AVX512 host checks them
too, an AMX host its AVX512 paths, and an x86 host the plain C paths other CPUs build."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
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
    "tests/verifier/test_loader.py",  # the dtype the masked CPU picks
    "tests/ops/test_triton_linear.py",  # the interpreter's products under the masked CPU's BLAS
]


@dataclass(frozen=True)
class Build:
    """A narrower CPU, as far as a process can pretend to be one."""

    cflags: list[str]  # appended to cpu_kernels.CFLAGS
    wider: str  # the CPU flag that makes this build narrower than native
    hidden: tuple[str, ...]  # prefixes of the CPU flags the project's own dispatch no longer sees
    # the libraries' own dispatch held to that CPU: numpy's OpenBLAS kernel (the one that CPU
    # loads), torch's vectorised kernels, oneDNN's and MKL's instruction sets
    env: dict[str, str] = field(default_factory=dict)


BUILDS = {
    "avx2": Build(
        NO_AVX512,
        "avx512f",
        ("avx512", "amx", "avx_vnni"),
        {
            "OPENBLAS_CORETYPE": "Haswell",  # what OpenBLAS picks on AVX2-only Intel and AMD (Zen)
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        },
    ),
    "no-avx": Build(
        NO_AVX,
        "avx2",
        ("avx", "amx", "fma", "f16c"),
        {
            "OPENBLAS_CORETYPE": "Nehalem",
            "ATEN_CPU_CAPABILITY": "default",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        },
    ),
    "avx512": Build(  # AVX512 without its bf16 extension (Skylake-X, Ice Lake)
        [*NO_AMX, "-mno-avx512bf16"],
        "avx512_bf16",
        ("amx", "avx512_bf16"),
        {
            "OPENBLAS_CORETYPE": "SkylakeX",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        },
    ),
    "no-amx": Build(
        NO_AMX,
        "amx_tile",
        ("amx",),
        {"OPENBLAS_CORETYPE": "SkylakeX", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    ),
}
CHILD = """
import sys
import dspark_serve.ops.platform as platform
hidden = tuple(sys.argv[2].split())
seen = platform.cpu_flags
def masked(*args, **kwargs):  # this CPU's flags less the hidden ones; a given file's as they are
    flags = seen(*args, **kwargs)
    return flags if args or kwargs else frozenset(f for f in flags if not f.startswith(hidden))
platform.cpu_flags = masked
for mod in list(sys.modules.values()):  # modules that imported it by name before the mask
    if getattr(mod, "cpu_flags", None) is seen:
        mod.cpu_flags = platform.cpu_flags
import dspark_serve.ops.cpu_kernels as ck
ck.CFLAGS = ck.CFLAGS + tuple(sys.argv[1].split())
assert ck.load_kernels() is not None, "the narrower build failed"
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", *sys.argv[3:]]))
"""


def _skip_reason(name: str) -> str | None:
    if platform.machine() not in ("x86_64", "AMD64") or find_compiler() is None:
        return "needs an x86-64 CPU and a C compiler"
    wider = BUILDS[name].wider
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
        build = BUILDS[name]
        # a fresh kernel cache, one thread
        env = dict(os.environ, **build.env, XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, " ".join(build.cflags), " ".join(build.hidden), *TESTS],
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
