"""Tests that run Triton's kernels: on a GPU, or on the CPU under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU)."""

from __future__ import annotations

import pytest

from dspark_serve.ops import triton_attention


def needs_triton() -> None:
    """Skip the calling test where Triton can run nothing (not installed; a CPU without the
    interpreter)."""
    pytest.importorskip("triton")
    if not triton_attention.available():
        pytest.skip("Triton needs CUDA or its interpreter (TRITON_INTERPRET=1)")
