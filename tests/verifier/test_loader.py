"""`--dtype auto`: bfloat16 where the hardware computes it natively, float32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from dspark_serve.ops.platform import cpu_flags
from dspark_serve.verifier.loader import NATIVE_BF16_CPU_FLAGS, choose_dtype

CPU = torch.device("cpu")
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_picks_bf16_on_native_bf16_cpu(flag):
    c = choose_dtype("auto", CPU, flags=AVX2_ONLY | {"avx512f", flag})
    assert c.dtype is torch.bfloat16
    assert flag in c.reason and c.name == "bfloat16"


def test_auto_keeps_float32_without_native_bf16():
    # AVX-512 alone is not enough: without the bf16 dot-product instructions bf16 is emulated.
    c = choose_dtype("auto", CPU, flags=AVX2_ONLY | {"avx512f", "avx512bw", "avx512_vnni"})
    assert c.dtype is torch.float32 and "without native bfloat16" in c.reason
    assert choose_dtype(None, CPU, flags=frozenset()).dtype is torch.float32


def test_explicit_dtype_wins_and_bad_value_is_quoted():
    assert choose_dtype("float32", CPU, flags=frozenset(NATIVE_BF16_CPU_FLAGS)).dtype is torch.float32
    assert choose_dtype("bf16", CPU, flags=AVX2_ONLY).dtype is torch.bfloat16
    with pytest.raises(ValueError, match="'float8'"):
        choose_dtype("float8", CPU)


def test_auto_on_this_machine_follows_its_flags(tmp_path):
    native = bool(cpu_flags().intersection(NATIVE_BF16_CPU_FLAGS))
    expect = torch.bfloat16 if native else torch.float32
    assert choose_dtype("auto", CPU).dtype is expect
    # the flags parser reads the kernel's format
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(f) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()
