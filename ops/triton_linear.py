"""A batch-invariant linear layer as one Triton kernel (CUDA; the interpreter in tests): the
products of a batch-invariant forward on a GPU, where cuBLAS picks its algorithm (tiles, split
over K) by the row count and so sums a row differently in different steps.

`InvariantTritonLinear(w, b, float_out)` multiplies [M, K] rows by w [N, K] with tiles of the
same size for every M and no split over K (`triton_kernels.matmul_kernel`): a row's outputs are
the same bits whatever else shares the call. float_out: float32 outputs (the LM head's logits).
"""

from __future__ import annotations

import torch

from dspark_serve.ops.triton_attention import kernels
from dspark_serve.ops.triton_launch import MATMUL_BLOCKS, matmul_launch

# One tile shape for every call (`triton_launch.MATMUL_BLOCKS`)
BLOCK_M, BLOCK_N = MATMUL_BLOCKS["BLOCK_M"], MATMUL_BLOCKS["BLOCK_N"]


class InvariantTritonLinear:
    kind = "triton-invariant"

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, float_out: bool = False) -> None:
        if w.dim() != 2:
            raise ValueError(f"a linear layer's weight is [out, in], got {tuple(w.shape)}")
        self.w = w.contiguous()
        self.b = None if b is None else b.contiguous()
        self.N, self.K = w.shape
        self.out_dtype = torch.float32 if float_out else w.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype != self.w.dtype:
            got = f"{x.dtype} {tuple(x.shape)}"
            raise ValueError(f"a batch-invariant linear takes [rows, {self.K}] {self.w.dtype}, got {got}")
        if x.stride(1) != 1:
            x = x.contiguous()
        M = x.shape[0]
        y = x.new_empty(M, self.N, dtype=self.out_dtype)
        if M:
            grid = (-(-M // BLOCK_M) * -(-self.N // BLOCK_N),)
            kernels().matmul_kernel[grid](
                x, self.w, self.w if self.b is None else self.b, y, M, self.N, self.K,
                x.stride(0), self.w.stride(0), y.stride(0),
                **matmul_launch(x.dtype, self.b is not None, self.out_dtype != self.w.dtype).options,
            )  # fmt: skip
        return y
