"""Linear layers computed from GGUF weight blocks (csrc/quant_gemm.c), beside `cpu_kernels`.

A `QuantMatrix` is a weight [N, K] as N rows of K / 32 blocks in one of GGUF's block formats,
read in place from the file (a memory map) or made at load (`quantize`); `QuantLinear` multiplies
float32 rows by it with `quant_gemm`: each row of x quantized to int8 per 32-block, exact integer
block products, one float order per output whatever the row count, so a row's result is the same
bits alone or in a batch, on every CPU path. It reads 5 (Q4_1) or 8.5 (Q8_0) bits a weight where
float32 reads 32: a decode step's time is mostly the time to read the weights.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from dspark_serve.ops import cpu_kernels

# GGUF block formats with a kernel: name -> (ggml type id, bytes per block of 32 weights)
BLOCK_TYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
BLOCK = 32  # weights per block
# quant_gemm's instruction paths (its `quant_gemm_path()`)
QUANT_PATHS = {0: "plain C", 1: "avx2", 2: "vnni"}


@dataclass(frozen=True)
class QuantMatrix:
    """A weight [N, K] as N rows of K / 32 blocks of `type` (a key of BLOCK_TYPES): blocks is a
    uint8 [N, K / 32 * block bytes] tensor, row-contiguous (a view into a memory-mapped file is
    fine: it is only read)."""

    blocks: torch.Tensor
    type: str
    K: int

    def __post_init__(self) -> None:
        if self.type not in BLOCK_TYPES:
            raise ValueError(f"no kernel for block type {self.type!r}; have {sorted(BLOCK_TYPES)}")
        if self.K % BLOCK:
            raise ValueError(f"a block-quantized row needs K a multiple of {BLOCK}, got {self.K}")
        rb = self.K // BLOCK * BLOCK_TYPES[self.type][1]
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != rb or b.stride() != (rb, 1):
            got = f"{b.dtype} {tuple(b.shape)} strides {b.stride()}"
            raise ValueError(
                f"{self.type} rows of {self.K} need contiguous uint8 [N, {rb}] blocks, got {got}"
            )

    @property
    def N(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def row_bytes(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def type_id(self) -> int:
        return BLOCK_TYPES[self.type][0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64) as float32 [len(ids), K]: exactly the blocks' values."""
        lib = _lib()
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.K, dtype=torch.float32)
        lib.quant_rows(
            self.blocks.data_ptr(),
            self.row_bytes,
            self.type_id,
            ids.data_ptr(),
            ids.numel(),
            self.K,
            out.data_ptr(),
        )
        return out

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.N))

    def take_rows(self, order: torch.Tensor) -> QuantMatrix:
        """The rows in `order` (a permutation or selection), as a matrix of its own."""
        return QuantMatrix(self.blocks.index_select(0, order).contiguous(), self.type, self.K)

    @staticmethod
    def cat(parts: list[QuantMatrix]) -> QuantMatrix | None:
        """Rows of several matrices of one type and K, stacked (a fused product); None when they
        differ in type or K."""
        if len({(p.type, p.K) for p in parts}) != 1:
            return None
        return QuantMatrix(torch.cat([p.blocks for p in parts]).contiguous(), parts[0].type, parts[0].K)


def quantize(w: torch.Tensor, type: str = "Q8_0") -> QuantMatrix:
    """A float weight [N, K] in blocks of `type` (gguf's own quantizer: llama.cpp's reference
    rounding), for a model given in floats."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type]
    arr = w.detach().to(torch.float32).contiguous().numpy()
    blocks = np.ascontiguousarray(gguf.quants.quantize(arr, qtype))
    return QuantMatrix(torch.from_numpy(blocks), type, int(w.shape[1]))


def _lib() -> ctypes.CDLL:
    lib = cpu_kernels.load_kernels()
    if lib is None:
        raise RuntimeError(
            f"block-quantized weights need the C kernels, which need a C compiler "
            f"({cpu_kernels.find_compiler() or 'none found'})"
        )
    return lib


def quant_path() -> str:
    """Which integer dot product the built kernel uses."""
    return QUANT_PATHS[_lib().quant_gemm_path()]


def pack(matrix: QuantMatrix) -> torch.Tensor:
    """The matrix's blocks rearranged into quant_gemm's panels of 16 rows (as many bytes, a
    buffer of its own)."""
    lib = _lib()
    out = torch.empty(lib.quant_pack_bytes(matrix.type_id, matrix.N, matrix.K), dtype=torch.uint8)
    if lib.quant_pack(
        matrix.blocks.data_ptr(), matrix.row_bytes, matrix.type_id, matrix.N, matrix.K, out.data_ptr()
    ):
        raise ValueError(f"quant_pack refused a {matrix.type} matrix [{matrix.N}, {matrix.K}]")
    return out


class QuantLinear:
    """A linear layer [M, K] float32 -> [M, N] float32 from a QuantMatrix (+ a float32 bias),
    its blocks packed once into quant_gemm's panels: every row count through the one kernel, in
    small_gemm_f32's order of sums (bit for bit the float32 product of the dequantized weights on
    CPUs with FMA), so batch-invariant by construction."""

    kind = "gguf"
    dtype = torch.float32
    max_rows = 1 << 30  # the kernel takes any row count

    def __init__(self, matrix: QuantMatrix, bias: torch.Tensor | None = None) -> None:
        self.lib = _lib()
        self.type = matrix.type
        self.N, self.K = matrix.N, matrix.K
        self.packed = pack(matrix)  # what the layer driver's struct points at
        self.type_id = matrix.type_id
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        if self.bias is not None and self.bias.shape != (self.N,):
            raise ValueError(f"bias must be [{self.N}], got {tuple(self.bias.shape)}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.K:
            raise ValueError(f"a {self.type} linear takes [rows, {self.K}], got {tuple(x.shape)}")
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.to(torch.float32).contiguous()
        M = x.shape[0]
        y = x.new_empty(M, self.N)
        if M:
            bias = 0 if self.bias is None else self.bias.data_ptr()
            args = (x.data_ptr(), x.stride(0), self.packed.data_ptr(), self.type_id, bias, y.data_ptr())
            rc = self.lib.quant_gemm(*args, M, self.N, self.K)
            if rc != 0:
                raise ValueError(f"quant_gemm refused [{M}, {self.K}] x {self.type} [{self.N}] ({rc})")
        return y
