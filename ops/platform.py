"""Facts about the machine both the kernels and the model loader read: where the user cache
lives, which CPU features the kernel reports, and the CPU's level (the widest instruction set
the project's code paths use). Read when called, never at import.

A process may run as a narrower CPU than it is (`DSPARK_CPU_LEVEL`, read when the flags are
read): the project's own dispatch no longer sees the flags above that level, the C kernels are
built without them, and `CpuLevel.env` holds numpy's OpenBLAS, torch, oneDNN and MKL to the same
instruction set (those libraries read their variables when they load, so a level is set for a
whole child process: `emulation_env`). The tests run every narrower level's paths this way on
a wider host; `bench/as_cpu.py` runs a benchmark so."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

LEVEL_ENV = "DSPARK_CPU_LEVEL"


def default_cache_dir() -> Path:
    """User cache directory (read when called, never at import)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspark-serve"


@dataclass(frozen=True)
class CpuLevel:
    """One level of x86 CPU as the project's code paths see it."""

    name: str
    needs: frozenset[str]  # flags a CPU has at this level (all of them)
    hidden: tuple[str, ...] = ()  # prefixes of the flags a CPU at this level lacks
    cflags: tuple[str, ...] = ()  # the C kernels' build, narrowed to this level
    env: Mapping[str, str] = field(default_factory=dict)  # the libraries' dispatch, held to it


_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
_NO_AVX512 = (
    *_NO_AMX,
    *(
        "-mno-avx512f -mno-avx512bw -mno-avx512cd -mno-avx512dq -mno-avx512vl -mno-avx512bf16 "
        "-mno-avx512vnni -mno-avx512ifma -mno-avx512vbmi -mno-avx512vbmi2 -mno-avx512bitalg "
        "-mno-avx512vpopcntdq"
    ).split(),
)

# Widest first. OpenBLAS's kernel names are the ones its dynamic build picks on such a CPU
# (AVX2-only Intel and AMD Zen alike get Haswell); oneDNN's and MKL's are their ISA caps.
CPU_LEVELS: dict[str, CpuLevel] = {
    level.name: level
    for level in (
        CpuLevel("amx", frozenset({"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx2", "fma"})),
        CpuLevel(
            "avx512-bf16",
            frozenset({"avx512_bf16", "avx512f", "avx2", "fma"}),
            ("amx",),
            _NO_AMX,
            {"OPENBLAS_CORETYPE": "SkylakeX", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
        ),
        CpuLevel(  # AVX512 without its bf16 extension (Skylake-X, Ice Lake)
            "avx512",
            frozenset({"avx512f", "avx2", "fma"}),
            ("amx", "avx512_bf16"),
            (*_NO_AMX, "-mno-avx512bf16"),
            {
                "OPENBLAS_CORETYPE": "SkylakeX",
                "ATEN_CPU_CAPABILITY": "avx512",
                "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                "MKL_ENABLE_INSTRUCTIONS": "AVX512",
            },
        ),
        CpuLevel(
            "avx2",
            frozenset({"avx2", "fma"}),
            ("avx512", "amx", "avx_vnni"),
            _NO_AVX512,
            {
                "OPENBLAS_CORETYPE": "Haswell",
                "ATEN_CPU_CAPABILITY": "avx2",
                "ONEDNN_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            },
        ),
        CpuLevel(
            "baseline",
            frozenset(),
            ("avx", "amx", "fma", "f16c"),
            (*_NO_AVX512, "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx"),
            {
                "OPENBLAS_CORETYPE": "Nehalem",
                "ATEN_CPU_CAPABILITY": "default",
                "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
            },
        ),
    )
}


def level_of(flags: frozenset[str]) -> CpuLevel:
    """The widest level whose flags `flags` has."""
    return next(level for level in CPU_LEVELS.values() if level.needs <= flags)


def emulated_level() -> CpuLevel | None:
    """The level this process runs as (`DSPARK_CPU_LEVEL`), or None: the CPU's own."""
    name = os.environ.get(LEVEL_ENV, "")
    if not name:
        return None
    if name not in CPU_LEVELS:
        raise ValueError(f"{LEVEL_ENV}={name!r} is no CPU level; choose one of {sorted(CPU_LEVELS)}")
    return CPU_LEVELS[name]


def emulation_env(name: str) -> dict[str, str]:
    """The environment a child process runs in to be a CPU of level `name`."""
    if name not in CPU_LEVELS:
        raise ValueError(f"{name!r} is no CPU level; choose one of {sorted(CPU_LEVELS)}")
    return {**CPU_LEVELS[name].env, LEVEL_ENV: name}


def cpu_flags(cpuinfo: str | os.PathLike[str] | None = None) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where there is no /proc/cpuinfo), less
    those above the emulated level; a given cpuinfo file's flags as they are."""
    flags: frozenset[str] = frozenset()
    try:
        with open(cpuinfo or "/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags") and ":" in line:
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    level = emulated_level() if cpuinfo is None else None
    if level is not None:
        flags = frozenset(f for f in flags if not f.startswith(level.hidden))
    return flags


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
