"""Triton's interpreter under NumPy 2.4 and later, for the tests that run kernels on the CPU.

The interpreter holds a scalar loaded from memory as a one-element array and turns a scalar into
a Python int (a `range` bound in a kernel's loop) with `int(array)`, which NumPy 2.4 refuses for
arrays that are not 0-dimensional. Here that one conversion reads the element instead; nothing
else of the interpreter changes, and a GPU run never comes here.
"""

from __future__ import annotations

from typing import Any


def fix_scalar_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fixed", False):
        return

    def patch(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._scalar_index_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch


def needs_triton() -> None:
    """Skip the calling test where Triton can run nothing (not installed; a CPU without the
    interpreter), else make its interpreter usable (`fix_scalar_index`)."""
    import pytest

    from dspark_serve.ops import triton_attention

    pytest.importorskip("triton")
    if not triton_attention.available():
        pytest.skip("Triton needs CUDA or its interpreter (TRITON_INTERPRET=1)")
    if triton_attention.interpreted():
        fix_scalar_index()
