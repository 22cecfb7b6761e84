"""What each Triton kernel launch compiles: the kernel, the types of its arguments and its
constexprs, as the launchers (`ops/triton_attention.py`, `ops/triton_linear.py`) pick them.

The launchers take their constexprs from these functions, and `engine_launches` lists every
launch the engine can make for a model's shapes from the same functions, so the compile test
(`tests/ops/test_triton_compile.py`, the real compiler for sm_80 and sm_90, no GPU needed)
covers exactly what can run. No Triton import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# Triton's names of the element types the kernels take
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# paged attention reads keys BLOCK_N at a time (`triton_attention.paged_attention`'s default)
ATTENTION_BLOCK_N = 32
# the batch-invariant matmul's one tile shape for every call: 64 rows (the tensor cores' wide
# instructions; a decode step's one row wastes the rest, its time being the weights' streaming
# anyway), 64 outputs, 64 inputs a step
MATMUL_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
SILU_MAX_BLOCK = 1024


@dataclass(frozen=True)
class KernelLaunch:
    """One launch's compiled side: `kernel` (its name in ops/triton_kernels.py), `signature`
    (each runtime argument's Triton type), `constexprs` and `num_warps` (the threads of a
    program, in warps: enough that no thread spills its registers, which the compile test
    checks for every launch)."""

    kernel: str
    signature: Mapping[str, str] = field(hash=False)
    constexprs: Mapping[str, int | str | bool] = field(hash=False)
    num_warps: int = 4

    @property
    def key(self) -> tuple[object, ...]:
        return self.kernel, tuple(self.signature.items()), tuple(self.constexprs.items()), self.num_warps

    @property
    def options(self) -> dict[str, int | str | bool]:
        """What a launch passes after its runtime arguments: the constexprs and num_warps."""
        return {**self.constexprs, "num_warps": self.num_warps}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_shape(group: int, max_query_len: int, invariant: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of a program (query tokens x the heads of one kv head, a power of
    two, at least 16 for the tensor cores) and the query tokens they hold. Decode and verify
    steps take the smallest tile that holds a segment's block; prefill chunks a tall one, so a kv
    tile read serves many queries. invariant: the tall one for every step, so a row's products
    run the same instructions whatever the step (batch invariance)."""
    need = max(16, next_pow2(group))
    rows = need if max_query_len * group <= need and not invariant else max(64, need)
    return rows, rows // group


def _typed(dtype: torch.dtype, *names: str) -> dict[str, str]:
    return {n: "*" + TRITON_TYPES[dtype] for n in names}


def attention_launch(
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    invariant: bool,
    causal: bool,
) -> KernelLaunch:
    block_m, block_q = tile_shape(group, max_query_len, invariant)
    strides = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kh", "stride_ks", "stride_vh")
    return KernelLaunch(
        "paged_attention_kernel",
        {
            **_typed(dtype, "q_ptr", "k_ptr", "v_ptr", "o_ptr"),
            **{n: "*i32" for n in ("cu_q_ptr", "starts_ptr", "table_ptr")},
            "scale": "fp32",
            "num_segments": "i32",
            **{n: "i32" for n in (*strides, "stride_vs", "stride_table")},
        },
        {
            "BLOCK_SIZE": block_size,
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_P": next_pow2(max(head_dim, 16)),
            "BLOCK_M": block_m,
            "BLOCK_Q": block_q,
            "BLOCK_N": ATTENTION_BLOCK_N,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "CAUSAL": causal,
        },
    )


def add_rmsnorm_launch(dtype: torch.dtype, d: int, has_delta: bool) -> KernelLaunch:
    return KernelLaunch(
        "add_rmsnorm_kernel",
        {
            **_typed(dtype, "h_ptr", "delta_ptr", "w_ptr", "out_ptr"),
            "d": "i32",
            "eps": "fp32",
            **{n: "i32" for n in ("stride_h", "stride_delta", "stride_out")},
        },
        {"HAS_DELTA": has_delta, "BLOCK": next_pow2(d)},
        # a row's elements spread over more threads as rows widen: at 4 warps an 8192-wide row
        # holds 64 elements a thread and spills
        num_warps=min(16, max(4, next_pow2(d) // 1024)),
    )


def silu_mul_launch(dtype: torch.dtype, n: int) -> KernelLaunch:
    """n: the up projection's width (the input is gate | up, 2n wide)."""
    return KernelLaunch(
        "silu_mul_kernel",
        {**_typed(dtype, "gu_ptr", "out_ptr"), "n": "i32", "stride_gu": "i32", "stride_out": "i32"},
        {"BLOCK": min(SILU_MAX_BLOCK, next_pow2(n))},
    )


def rope_store_launch(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> KernelLaunch:
    strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ch")
    return KernelLaunch(
        "rope_store_kernel",
        {
            **_typed(dtype, "q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr"),
            "slots_ptr": "*i64",
            **_typed(dtype, "kc_ptr", "vc_ptr"),
            **{n: "i32" for n in (*strides, "stride_cs")},
        },
        {
            "NUM_HEADS": num_heads,
            "NUM_KV_HEADS": num_kv_heads,
            "HEADS_P": next_pow2(num_heads),
            "KV_HEADS_P": next_pow2(num_kv_heads),
            "HEAD_DIM": head_dim,
        },
    )


def matmul_launch(dtype: torch.dtype, has_bias: bool, float_out: bool) -> KernelLaunch:
    out = torch.float32 if float_out else dtype
    return KernelLaunch(
        "matmul_kernel",
        {
            **_typed(dtype, "x_ptr", "w_ptr", "b_ptr"),
            **_typed(out, "y_ptr"),
            **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")},
        },
        {
            "HAS_BIAS": has_bias,
            **MATMUL_BLOCKS,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        },
        num_warps=8,  # at 4 warps the 64 x 64 x 64 tile's pipeline spills on sm_90
    )


@dataclass(frozen=True)
class ModelShape:
    """What a model's kernels are specialised on: heads, head size, widths."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


def engine_launches(
    shape: ModelShape, dtype: torch.dtype, block_size: int, max_tokens: int
) -> list[KernelLaunch]:
    """Every launch the engine can make for `shape` in `dtype` with KV blocks of `block_size`
    and steps of up to `max_tokens` query tokens a segment: attention for each tile shape a
    step can take (decode, verify and prefill steps of the target, causal; the drafter's
    block, bidirectional; the batch-invariant mode's one tile), the fused elementwise kernels
    and the batch-invariant matmul (with and without bias, bf16/fp16 or float32 outputs)."""
    group = shape.num_heads // shape.num_kv_heads
    attention = (
        attention_launch(dtype, group, shape.head_dim, block_size, q, invariant, causal)
        for q in range(1, max_tokens + 1)
        for invariant in (False, True)
        for causal in (True, False)
    )
    launches = {launch.key: launch for launch in attention}
    others = [
        *(add_rmsnorm_launch(dtype, shape.hidden, has_delta) for has_delta in (False, True)),
        add_rmsnorm_launch(dtype, shape.head_dim, False),  # the drafter's q / k norms
        silu_mul_launch(dtype, shape.intermediate),
        rope_store_launch(dtype, shape.num_heads, shape.num_kv_heads, shape.head_dim),
        *(matmul_launch(dtype, bias, out) for bias in (False, True) for out in (False, True)),
    ]
    for launch in others:
        launches[launch.key] = launch
    return list(launches.values())


# Shared memory one block may use, by compute capability (the opt-in maximum: sm_80 A100,
# sm_90 H100/H200)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class CompiledLaunch:
    """A launch compiled for one GPU target: registers a thread, spilled bytes (stack and local
    memory the compiler reports), shared memory a block."""

    launch: KernelLaunch
    arch: int
    registers: int
    spilled: int
    shared: int


def compile_launch(launch: KernelLaunch, arch: int) -> CompiledLaunch:
    """Compile `launch` with Triton's own compiler for CUDA sm_`arch` (no GPU or driver needed:
    Triton's bundled ptxas builds the cubin, its cuobjdump reads the resources)."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dspark_serve.ops import triton_kernels

    fn = getattr(triton_kernels, launch.kernel)
    signature = {**launch.signature, **{k: "constexpr" for k in launch.constexprs}}
    source = ASTSource(fn, signature=signature, constexprs=dict(launch.constexprs))
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": launch.num_warps}
    )
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(
        item.split(":", 1)
        for line in usage.splitlines()
        if "REG:" in line
        for item in line.split()
        if ":" in item
    )
    return CompiledLaunch(
        launch,
        arch,
        registers=int(fields["REG"]),
        spilled=int(fields["STACK"]) + int(fields["LOCAL"]),
        shared=int(compiled.metadata.shared),
    )
