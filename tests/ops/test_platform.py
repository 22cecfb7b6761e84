"""The CPU's level and the narrower levels a process can run as (`ops/platform.py`), and the C
kernels' paths following the level this process sees (tests/ops/test_kernel_builds.py runs this
file in every narrower level's child, where the flags are masked and the library rebuilt)."""

from __future__ import annotations

import pytest

from dspark_serve.ops import cpu_kernels
from dspark_serve.ops.platform import (
    CPU_LEVELS,
    LEVEL_ENV,
    cpu_flags,
    emulated_level,
    emulation_env,
    level_of,
)

ZEN3 = frozenset("fpu sse4_2 avx f16c avx2 fma bmi2".split())
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx_vnni", "avx512_fp16"}
# the kernel paths a library built for a CPU of each level has (csrc/small_gemm.c kernel_paths)
PATHS = {
    "amx": ("avx2", "avx512", "avx512-bf16", "amx"),
    "avx512-bf16": ("avx2", "avx512", "avx512-bf16"),
    "avx512": ("avx2", "avx512"),
    "avx2": ("avx2",),
    "baseline": (),
}


def test_each_cpu_kind_has_its_level():
    assert level_of(SAPPHIRE_RAPIDS).name == "amx"
    assert level_of(ZEN4).name == "avx512-bf16"
    assert level_of(SKYLAKE_X).name == "avx512"
    assert level_of(ZEN3).name == "avx2"
    assert level_of(frozenset({"fpu", "sse4_2", "avx"})).name == "baseline"
    assert list(PATHS) == list(CPU_LEVELS)  # widest first, every level named here


def test_a_process_run_as_a_narrower_level_sees_that_cpus_flags(monkeypatch, tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: " + " ".join(sorted(SAPPHIRE_RAPIDS)) + "\n")
    monkeypatch.setattr("dspark_serve.ops.platform.open", lambda *a, **k: open(f, *a[1:], **k), raising=False)
    for name, level in CPU_LEVELS.items():
        monkeypatch.setenv(LEVEL_ENV, name)
        assert emulated_level() is level
        seen = cpu_flags()
        assert level_of(seen) is level, name  # the level it runs as, not the CPU's
        assert seen == frozenset(f for f in SAPPHIRE_RAPIDS if not f.startswith(level.hidden))
        assert cpu_flags(f) == SAPPHIRE_RAPIDS  # a given file is read as it is
        assert cpu_kernels.build_flags() == cpu_kernels.CFLAGS + level.cflags
        assert emulation_env(name)[LEVEL_ENV] == name
    monkeypatch.setenv(LEVEL_ENV, "avx3")
    with pytest.raises(ValueError, match="'avx3'"):
        cpu_flags()
    with pytest.raises(ValueError, match="'sse9'"):
        emulation_env("sse9")
    monkeypatch.delenv(LEVEL_ENV)
    assert emulated_level() is None and cpu_flags() == SAPPHIRE_RAPIDS


def test_the_kernels_are_built_for_the_level_this_process_sees():
    """The dispatch: the library a process loads has exactly the paths of the CPU level it sees
    (in a narrower level's child: that level's, though the CPU is wider)."""
    lib = cpu_kernels.load_kernels()
    if lib is None:
        pytest.skip("no C compiler: the forward runs torch's kernels")
    level = level_of(cpu_flags())
    assert cpu_kernels.kernel_paths(lib) == PATHS[level.name]
    line = cpu_kernels.describe_cpu()
    assert f"({level.name}" in line
    assert "C kernel paths: " + (", ".join(PATHS[level.name]) or "plain C") in line
