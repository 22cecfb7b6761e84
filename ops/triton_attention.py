"""Attention over the paged KV cache as one Triton kernel family, for the target and the drafter.

One launch serves any mix of segments: prefill chunks, one-token decodes and multi-token
verification blocks, each with its own query count and context length. A segment's queries sit
at the end of its context (query i of a segment starting at position `start` is at position
start + i, and sees keys [0, start + i]: causal inside the new block, everything before it). The
kernel reads keys and values where they lie in the cache, walking each segment's block table; it
gathers nothing and pads no segment to the longest.

Layouts (those of `verifier/kv_cache.py`): q and out [T, H, D] (the step's new tokens, flat,
segments in order); one layer's cache [Hkv, slots, D], the slot of position p of a segment
`table[s, p // block_size] * block_size + p % block_size`. Grouped-query attention: query head h
reads kv head h // (H // Hkv); one program takes the query tokens of a tile times the heads that
share a kv head, so a kv tile is loaded once for all of them.

The grid is fixed by numbers the host knows without reading the device (tokens T and segments
S): T // BLOCK_Q + S tiles, since segment s's tiles start at cu_q[s] // BLOCK_Q + s, and each
program finds its segment by a binary search over cu_q. So a CUDA graph captured for a bucket
of (T, S) replays for any query lengths within it; tiles past a segment's queries (and segments
with no queries, which pad a bucket) return at once.

Triton is optional (the `gpu` extra) and imported on first use. On a CPU the kernels run only
under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which is how the
tests prove them; nothing serves through the interpreter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from dspark_serve.ops.triton_launch import (
    ATTENTION_BLOCK_N,
    add_rmsnorm_launch,
    attention_launch,
    rope_store_launch,
    silu_mul_launch,
)


@dataclass(frozen=True)
class VarlenSegments:
    """Where a step's segments lie, on the device the kernel runs on.

    cu_q: int32 [S + 1], the first row of each segment in the flat batch, then T.
    starts: int32 [S], the position of each segment's first query (its cached context length).
    table: int32 [S, max_blocks], each segment's block table (entries past its context unused).
    num_tokens, max_query_len: T and the longest segment, known on the host (they fix the grid
    and the tile shape; reading them from the device would synchronise).
    """

    cu_q: torch.Tensor
    starts: torch.Tensor
    table: torch.Tensor
    num_tokens: int
    max_query_len: int

    @property
    def num_segments(self) -> int:
        return int(self.starts.shape[0])


def available() -> bool:
    """Whether Triton imports, and can run here: a CUDA device, or its interpreter on a CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or interpreted()


def interpreted() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): kernels run as numpy on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel() -> Any:
    """The jitted kernel, built on first use (importing triton is slow and optional)."""
    from dspark_serve.ops import triton_kernels

    if interpreted():
        fix_interpreter_scalar_index()
    return triton_kernels.paged_attention_kernel


def fix_interpreter_scalar_index() -> None:
    """Triton's interpreter under NumPy 2.4 and later: it holds a scalar loaded from memory as a
    one-element array and turns a scalar into a Python int (a loop bound) with `int(array)`,
    which NumPy 2.4 refuses for arrays that are not 0-dimensional. Here that one conversion reads
    the element instead; nothing else of the interpreter changes, and compiled kernels never
    come here."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fixed", False):
        return

    def patch(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._scalar_index_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    segments: VarlenSegments,
    block_size: int,
    scale: float,
    block_n: int = ATTENTION_BLOCK_N,
    invariant: bool = False,
    causal: bool = True,
) -> torch.Tensor:
    """q [T, H, D], k_cache/v_cache [Hkv, slots, D] (one layer, the new tokens' K/V already
    written), out [T, H, D] -> out, every row attended over its segment's cache. Keys are read
    in tiles of block_n from key 0 whatever the step; invariant: one tile shape of queries too
    (`triton_launch.tile_shape`), so a row's output is the same bits whatever else shares the step. causal
    False: every query of a segment sees all its keys, the cached ones and the segment's own
    (the drafter's block). k_cache / v_cache may be strided views (a slot-major pool
    [slots, Hkv, D] permuted to [Hkv, slots, D]): the kernel reads through their strides.

    float32 inputs multiply in IEEE float32 (no TF32), so float32 results match a float32
    reference; fp16/bf16 multiply in their own precision and accumulate in float32."""
    T, H, D = q.shape
    Hkv = k_cache.shape[0]
    if H % Hkv:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {Hkv}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q, the caches and out need a contiguous head dimension")
    S = segments.num_segments
    if T == 0 or S == 0:
        return out
    launch = attention_launch(q.dtype, H // Hkv, D, block_size, segments.max_query_len, invariant, causal)
    options = {**launch.options, "BLOCK_N": block_n}
    grid = (T // int(options["BLOCK_Q"]) + S, Hkv)
    _kernel()[grid](
        q, k_cache, v_cache, out, segments.cu_q, segments.starts, segments.table, scale, S,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), segments.table.stride(0), **options,
    )  # fmt: skip
    return out


class TritonElementwise:
    """The fast forward's fused elementwise steps as Triton kernels (CUDA; the interpreter in
    tests), with the interface of the CPU's C kernels (`ops.cpu_kernels.FusedElementwise` and
    `RopeStore`), so one layer loop drives either: the residual add fused with the RMSNorm
    after it, SwiGLU's silu(g) * u, and rotary with the K/V write to the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """The rotary kernel (`__call__`) needs a power-of-two head_dim; the others any."""
        self.H, self.Hkv, self.D = num_heads, num_kv_heads, head_dim

    def add_rmsnorm(
        self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h [T, d] += delta (in place, rounded as torch's add rounds); -> RMSNorm(h) * w."""
        T, d = h.shape
        if h.stride(1) != 1 or (delta is not None and delta.stride(1) != 1):
            raise ValueError("add_rmsnorm needs rows with contiguous elements")
        out = torch.empty_like(h)
        if T:
            kernels().add_rmsnorm_kernel[(T,)](
                h, h if delta is None else delta, w, out, d, eps, h.stride(0),
                0 if delta is None else delta.stride(0), out.stride(0),
                **add_rmsnorm_launch(h.dtype, d, delta is not None).options,
            )  # fmt: skip
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2n] (gate | up) -> silu(gate) * up [T, n]."""
        T, n2 = gu.shape
        if gu.stride(1) != 1 or n2 % 2:
            raise ValueError(f"silu_mul needs a [T, 2n] input with contiguous rows, got {tuple(gu.shape)}")
        out = gu.new_empty(T, n2 // 2)
        launch = silu_mul_launch(gu.dtype, n2 // 2)
        if T:
            grid = (T, -(-(n2 // 2) // int(launch.constexprs["BLOCK"])))
            kernels().silu_mul_kernel[grid](gu, out, n2 // 2, gu.stride(0), out.stride(0), **launch.options)
        return out

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """rope_store: q [T, H, D] rotated in place; rotated k [T, Hkv, D] and v written to the
        caches [Hkv, slots, D] at `slots` [T]; cos / sin [T, D] contiguous (sign folded in sin)."""
        if self.D & (self.D - 1) or self.D < 2:
            raise ValueError(f"the Triton rotary kernel needs a power-of-two head_dim, got {self.D!r}")
        T = q.shape[0]
        for t in (q, k, v, k_cache, v_cache):
            if t.stride(-1) != 1:
                raise ValueError(f"rope_store needs each head's elements contiguous, got {t.stride()}")
        if not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope_store needs contiguous cos and sin")
        if T:
            kernels().rope_store_kernel[(T,)](
                q, k, v, cos, sin, slots, k_cache, v_cache,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                k_cache.stride(0), k_cache.stride(1),
                **rope_store_launch(q.dtype, self.H, self.Hkv, self.D).options,
            )  # fmt: skip


def kernels() -> Any:
    from dspark_serve.ops import triton_kernels

    if interpreted():
        fix_interpreter_scalar_index()
    return triton_kernels
