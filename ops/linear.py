"""Linear layers and norms both the target's fast forward and the drafter run.

`make_linear` picks how a weight multiplies: plain `F.linear`, oneDNN prepacked weights on CPUs,
the C kernel for bf16 decode/verify rows and for float32 (`ops.cpu_kernels.SmallGemmLinear`;
guarded by device and dtype, never used on CUDA), or weight-only int8. `FastRMSNorm` is RMSNorm
in as few kernels as the dtype allows.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F

from dspark_serve.ops import cpu_kernels
from dspark_serve.ops.cpu_kernels import SmallGemmLinear
from dspark_serve.ops.platform import cpu_flags

# Up to this many rows the C gemm kernel is at least as fast as oneDNN's bf16 one on AVX512-BF16
# CPUs (bench/gemm_rows.py measures the crossover) ...
SMALL_GEMM_ROWS = 128
# ... but on a CPU with AMX oneDNN runs on its tiles and overtakes the kernel's AVX512 path after
# a handful of rows; the kernel's own tile path keeps up with oneDNN to past 128 rows, so where
# the kernel has tiles the limit stays 128.
SMALL_GEMM_ROWS_AMX_UNUSED = 8  # AMX on the CPU, but the kernel may not use it: oneDNN from 9 rows


def default_gemm_rows(cpu_amx: bool, kernel_tiles: bool) -> int:
    """The most rows a bfloat16 product takes through the C gemm kernel before oneDNN's:
    `cpu_amx` whether the CPU has AMX (oneDNN then runs bf16 on it), `kernel_tiles` whether the
    C kernel does too (`small_gemm_tiles()` of the built library)."""
    return SMALL_GEMM_ROWS_AMX_UNUSED if cpu_amx and not kernel_tiles else SMALL_GEMM_ROWS


@functools.cache
def _gemm_rows_here() -> int:
    lib = cpu_kernels.load_kernels()
    return default_gemm_rows("amx_bf16" in cpu_flags(), lib is not None and bool(lib.small_gemm_tiles()))


# -- linear layers ------------------------------------------------------------------------------
class Linear(Protocol):
    """One linear layer of the fast forward: [N, in] -> [N, out]."""

    kind: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class _TorchLinear:
    kind = "torch"

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.w, self.b = w, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, self.b)


class _MkldnnLinear:
    """CPU only: the weight reordered once into oneDNN's blocked layout (what inductor's
    freezing pass does), so each call skips the per-call weight reorder."""

    kind = "mkldnn"

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.out_features = w.shape[0]
        self.w = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        self.b = b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        return y


class _Int8Linear:
    """Weight-only int8, one scale per output channel (symmetric, round to nearest)."""

    kind = "int8"

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        wf = w.float()
        scale = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.q = (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(w.dtype)
        self.b = b
        self.use_pack = w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_pack:
            y = torch._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
        else:  # CUDA and others: dequantise on the fly (correct everywhere, fast on none)
            y = F.linear(x, self.q.to(x.dtype)) * self.scale
        return y if self.b is None else y + self.b


@functools.cache
def mkldnn_linear_works(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN prepacked linear: float32/bf16 on a CPU whose oneDNN build accepts it (never CUDA)."""
    if (
        device.type != "cpu"
        or dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    ):
        return False
    try:
        w = torch.randn(8, 16).to(dtype)
        x = torch.randn(2, 16).to(dtype)
        y = _MkldnnLinear(w, None)(x)
        return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, AttributeError):
        return False


def make_linear(
    w: torch.Tensor,
    b: torch.Tensor | None,
    kind: str,
    quantize: str,
    gemm_rows: int = 0,
    invariant: bool = False,
    float_out: bool = False,
) -> Linear:
    """kind: auto (gemm for float32 and bf16 on a CPU where the C kernels build, else mkldnn
    where it works: float32/bf16 on CPU; else torch), torch, mkldnn, or gemm (the C kernel: bf16
    for up to `gemm_rows` rows (0: `default_gemm_rows` for this CPU and build), oneDNN above, or
    torch's linear where oneDNN cannot run bf16, as on a CPU without AVX512; float32 for every
    row count; CPU only). invariant: the C kernel for every row count in its batch-invariant
    order (a ValueError where it cannot run); float_out: with it, float32 outputs from bf16
    weights (`SmallGemmLinear`)."""
    if invariant and (quantize != "none" or kind not in ("auto", "gemm")):
        raise ValueError(
            f"a batch-invariant linear needs linear 'auto' or 'gemm' without quantization, got "
            f"linear {kind!r}, quantize {quantize!r}"
        )
    if quantize == "int8":
        return _Int8Linear(w, b)
    bf16 = w.dtype == torch.bfloat16
    gemm_shape = w.device.type == "cpu" and ((bf16 and w.shape[1] % 2 == 0) or w.dtype == torch.float32)
    if kind in ("auto", "gemm") and gemm_shape:
        lib = cpu_kernels.load_kernels()
        if lib is not None and invariant:
            fallback = _TorchLinear(w, b)
            return SmallGemmLinear(lib, w, b, fallback, 1 << 30, invariant=True, float_out=float_out)
        if lib is not None:
            if not bf16:
                # float32 runs every row count through the kernel: it beat oneDNN's float32
                # kernel at 1 to 512 rows (bench/gemm_rows.py), and a row's sums then run in
                # one order however many rows share the call, so float32 linears are
                # batch-invariant. Only a strided input falls back: torch's linear, no
                # second packed copy of the weight.
                return SmallGemmLinear(lib, w, b, _TorchLinear(w, b), 1 << 30)
            onednn = mkldnn_linear_works(w.dtype, w.device)
            above: Linear = _MkldnnLinear(w, b) if onednn else _TorchLinear(w, b)
            return SmallGemmLinear(lib, w, b, above, gemm_rows or _gemm_rows_here())
    if kind == "gemm" or invariant:
        raise ValueError(
            f"linear 'gemm' needs float32 weights, or bfloat16 ones with an even input size, on a CPU "
            f"with a C compiler, got {w.dtype} {tuple(w.shape)} on {w.device}"
        )
    if kind == "mkldnn" or (kind == "auto" and mkldnn_linear_works(w.dtype, w.device)):
        return _MkldnnLinear(w, b)
    return _TorchLinear(w, b)


class FastRMSNorm:
    """RMSNorm as few kernels as the dtype allows. float32, and every CUDA dtype: F.rms_norm (HF's
    maths; fused on CUDA). bf16/fp16 on a CPU, where F.rms_norm runs as ~10 small kernels:
    RMSNorm(x) is LayerNorm([x, -x]) cut to its first half (the mirrored vector has mean 0 and
    the same mean square), and LayerNorm is one fused kernel with float32 statistics and one
    rounding of the output (HF rounds twice; bf16 is not held to bit equality anyway)."""

    def __init__(self, w: torch.Tensor, eps: float) -> None:
        self.w, self.eps, self.d = w, eps, w.shape[0]
        mirrored = w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16)
        self.w2 = torch.cat([w, w]) if mirrored else None

    @classmethod
    def of(cls, norm: torch.nn.Module) -> FastRMSNorm:
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        return cls(norm.weight, eps)  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.w2 is None:
            return F.rms_norm(x, (self.d,), self.w, self.eps)
        y = F.layer_norm(torch.cat([x, -x], dim=-1), (2 * self.d,), self.w2, None, self.eps)
        return y[..., : self.d]
