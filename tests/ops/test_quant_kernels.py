"""The GGUF block products (ops/csrc/quant_gemm.c through ops.quant_kernels) against references:
a float64 product of the blocks' exact values; bit for bit the float32 gemm (`small_gemm_f32`,
the dense `--weights fp32` path) of the same values, whose order of sums the kernel keeps, and
the kernel's order emulated in numpy (whichever CPU path this process built: the narrower levels
rerun this file in tests/ops/test_kernel_builds.py); rows alone against the same rows in a batch;
and the blocks' values against gguf's own dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from dspark_serve.ops import cpu_kernels
from dspark_serve.ops.platform import cpu_flags
from dspark_serve.ops.quant_kernels import BLOCK_TYPES, QuantLinear, QuantMatrix, quant_path, quantize

pytestmark = pytest.mark.skipif(
    cpu_kernels.find_compiler() is None, reason="the block kernels need a C compiler"
)

TYPES = sorted(BLOCK_TYPES)


def blocks_of(w: torch.Tensor, kind: str) -> tuple[QuantMatrix, torch.Tensor]:
    """w in `kind` blocks, and the blocks' exact float32 values (gguf's dequantizer)."""
    m = quantize(w, kind)
    qtype = gguf.GGMLQuantizationType[kind]
    values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(m.blocks.numpy(), qtype)))
    return m, values.reshape(w.shape).to(torch.float32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: the float32 product is exact in float64, the sum rounded once
    more there (a second rounding that can differ from one rounding only in a half-way case of
    probability ~2^-29 per operation)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def emulate(x: torch.Tensor, values: torch.Tensor) -> np.ndarray:
    """The kernel's order of sums (csrc/quant_gemm.c, small_gemm_f32's): per output one chain of
    fused multiply-adds over k = 0 .. K - 1 from zero."""
    xs, ws = x.numpy().astype(np.float32), values.numpy().astype(np.float32)
    acc = np.zeros((xs.shape[0], ws.shape[0]), np.float32)
    for k in range(xs.shape[1]):
        acc = fma32(xs[:, None, k], ws[None, :, k], acc)
    return acc


def dense_float32(x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The dense float32 path's product of the same values (`small_gemm_f32`)."""
    lib = cpu_kernels.load_kernels()
    assert lib is not None
    return cpu_kernels.SmallGemmLinear(lib, values, bias, lambda t: t, max_rows=1 << 20)(x)


@pytest.mark.parametrize("kind", TYPES)
def test_blocks_dequantize_to_gguf_values(kind):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 96, generator=g) * 0.1
    m, values = blocks_of(w, kind)
    assert torch.equal(m.dequantize(), values)
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(m.rows(ids), values[ids])


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 17])
def test_product_matches_float64_and_the_documented_order(kind, M):
    g = torch.Generator().manual_seed(M)
    N, K = 37, 96  # N not a multiple of the 4-row tiles or the threads' groups of 8
    m, values = blocks_of(torch.randn(N, K, generator=g) * 0.05, kind)
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g)
    y = QuantLinear(m, bias)(x)
    ref = x.double() @ values.double().T + bias.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    # bit for bit the order the kernel documents, on this build's path
    y0 = QuantLinear(m)(x)
    assert np.array_equal(y0.numpy(), emulate(x, values)), quant_path()
    assert torch.equal(y, y0 + bias)
    if "fma" in cpu_flags():  # the dense path fuses its multiply-adds there too
        assert torch.equal(y, dense_float32(x, values, bias))


@pytest.mark.parametrize("kind", TYPES)
def test_a_row_alone_is_the_row_in_a_batch(kind):
    g = torch.Generator().manual_seed(7)
    m, _ = blocks_of(torch.randn(70, 128, generator=g) * 0.05, kind)
    lin = QuantLinear(m)
    x = torch.randn(16, 128, generator=g)
    batch = lin(x)
    for i in range(16):
        assert torch.equal(lin(x[i : i + 1])[0], batch[i])
    assert torch.equal(lin(x[3:11]), batch[3:11])
    strided = torch.randn(16, 256, generator=g)[:, :128]  # a row stride the kernel takes as is
    assert torch.equal(lin(strided), lin(strided.contiguous()))


def test_the_kernel_changes_with_the_weights_it_reads():
    """A broken read (the wrong block, the wrong nibble half) must show: flip one nibble."""
    g = torch.Generator().manual_seed(3)
    m, values = blocks_of(torch.randn(8, 64, generator=g), "Q4_1")
    x = torch.zeros(1, 64)
    x[0, 20] = 1.0  # element 20: the high nibble of byte 4 of block 0's quants
    before = QuantLinear(m)(x)[0, 2].item()
    assert before == values[2, 20].item()
    blocks = m.blocks.clone()
    blocks[2, 4 + 4] ^= 0x10  # Q4_1: d, m (4 bytes), then qs; flip the high nibble of qs[4]
    after = QuantLinear(QuantMatrix(blocks, "Q4_1", 64))(x)[0, 2].item()
    assert after != before


def test_bad_matrices_and_inputs_are_errors():
    g = torch.Generator().manual_seed(0)
    m, _ = blocks_of(torch.randn(4, 64, generator=g), "Q8_0")
    with pytest.raises(ValueError, match="no kernel"):
        QuantMatrix(m.blocks, "Q5_K", 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantMatrix(m.blocks, "Q8_0", 60)
    with pytest.raises(ValueError, match="contiguous uint8"):
        QuantMatrix(m.blocks[:, :34], "Q8_0", 64)
    with pytest.raises(ValueError, match="takes"):
        QuantLinear(m)(torch.randn(2, 32))
    assert QuantLinear(m)(torch.randn(0, 64)).shape == (0, 4)


def test_fused_rows_stack_only_one_type():
    g = torch.Generator().manual_seed(0)
    a, av = blocks_of(torch.randn(4, 64, generator=g), "Q4_1")
    b, bv = blocks_of(torch.randn(3, 64, generator=g), "Q4_1")
    c, _ = blocks_of(torch.randn(3, 64, generator=g), "Q8_0")
    fused = QuantMatrix.cat([a, b])
    assert fused is not None and torch.equal(fused.dequantize(), torch.cat([av, bv]))
    assert QuantMatrix.cat([a, c]) is None
