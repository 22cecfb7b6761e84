"""Attention of the fast forward over the paged KV cache.

"triton" (CUDA; `ops/triton_attention.py`): every segment of the step in one kernel launch a
layer, reading the cache in place through the block tables, nothing gathered or padded.
"paged" (CPUs, the C kernel of ops/cpu_kernels.py): every segment, decode, verify and prefill
chunk alike, reads its keys and values where they lie in the cache, walking its block table;
nothing is gathered. "sdpa"/"matmul" (CUDA, or without a compiler) read the cache by whole
blocks (`index_select` of [block_size, Hkv, D] rows straight from the block tables); there a
prefill chunk that starts a sequence attends to its own new keys with no cache read at all, and
decode/verify segments of equal length need no query re-packing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark_serve.ops import triton_attention
from dspark_serve.ops.cpu_kernels import PagedAttention
from dspark_serve.verifier.fast_plan import FastPlan
from dspark_serve.verifier.kv_cache import KVCache


class CacheAttention:
    """q [T, H, D], k/v [T, Hkv, D] of one layer's new tokens -> [T, H * D]."""

    def __init__(
        self,
        kind: str,
        kv: KVCache,
        num_heads: int,
        scaling: float,
        paged: PagedAttention | None,
        invariant: bool = False,
    ) -> None:
        """invariant: the Triton kernel in its batch-invariant tile shape (the C kernel, `paged`,
        carries its own mode)."""
        if kind == "paged" and paged is None:
            raise ValueError("attention 'paged' needs the paged C kernel")
        self.kind, self.kv, self.num_heads, self.scaling, self.paged = kind, kv, num_heads, scaling, paged
        self.invariant = invariant

    def __call__(
        self, li: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, plan: FastPlan
    ) -> torch.Tensor:
        """New K/V (None: already written, by the fused rotary kernel) go to their slots, then
        every segment attends to its blocks. The cache is head-major ([Hkv, slots, D] per layer),
        so the blocks of a segment, gathered or read in place, are already each head's [C, D]
        key matrix: no further copy before the matmuls."""
        kc, vc = self.kv.k[li], self.kv.v[li]  # [Hkv, num_blocks * bs, D]
        if k is not None and v is not None:
            kc.index_copy_(1, plan.slots, k.transpose(0, 1))
            vc.index_copy_(1, plan.slots, v.transpose(0, 1))
        T = q.shape[0]
        if plan.varlen is not None:
            out = q.new_empty(q.shape)
            bs = self.kv.block_size
            triton_attention.paged_attention(
                q, kc, vc, out, plan.varlen, bs, self.scaling, invariant=self.invariant
            )
            return out.reshape(T, -1)
        if plan.p_segments is not None:
            assert self.paged is not None
            out = q.new_empty(q.shape)
            self.paged(q, kc, vc, out, *plan.p_segments, scale=self.scaling)
            return out.reshape(T, -1)
        if plan.g_count and plan.g_row0 >= 0 and plan.g_count * plan.g_q == T and not plan.big:
            return self._group(q, kc, vc, plan).reshape(T, -1)  # the whole step is one group
        out = q.new_empty(q.shape)
        if plan.g_count:
            o = self._group(q, kc, vc, plan)
            G, Q = plan.g_count, plan.g_q
            if plan.g_row0 >= 0:
                out[plan.g_row0 : plan.g_row0 + G * Q] = o.reshape(G * Q, *q.shape[1:])
            else:
                assert plan.g_rows is not None and plan.g_valid is not None
                out[plan.g_rows[plan.g_valid]] = o[plan.g_valid]
        self._big(q, k, v, kc, vc, plan, out)
        return out.reshape(T, -1)

    def _group(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan: FastPlan) -> torch.Tensor:
        """The short segments together -> [G, Q, H, D]."""
        bs = self.kv.block_size
        Hkv, D = kc.shape[0], kc.shape[2]
        G, Q = plan.g_count, plan.g_q
        C = plan.g_nblk * bs
        if plan.g_row0 >= 0:
            qs = q[plan.g_row0 : plan.g_row0 + G * Q].view(G, Q, *q.shape[1:])
        else:
            assert plan.g_rows is not None
            qs = q[plan.g_rows]
        if plan.g_first >= 0:  # one segment on consecutive blocks: read the pool in place
            lo = plan.g_first * bs
            ks = kc[:, lo : lo + C].view(Hkv, G, C, D)
            vs = vc[:, lo : lo + C].view(Hkv, G, C, D)
        else:
            assert plan.g_blocks is not None
            ks = kc.view(Hkv, -1, bs, D).index_select(1, plan.g_blocks).view(Hkv, G, C, D)
            vs = vc.view(Hkv, -1, bs, D).index_select(1, plan.g_blocks).view(Hkv, G, C, D)
        if plan.g_keys:
            ks, vs = ks[:, :, : plan.g_keys], vs[:, :, : plan.g_keys]
        if self.kind == "matmul":
            return matmul_attention(qs, ks, vs, plan.g_mask, self.scaling)
        o = sdpa(qs.transpose(1, 2), ks.transpose(0, 1), vs.transpose(0, 1), plan.g_mask, self.scaling)
        return o.transpose(1, 2)  # [G, Q, H, D]

    def _big(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kc: torch.Tensor,
        vc: torch.Tensor,
        plan: FastPlan,
        out: torch.Tensor,
    ) -> None:
        """Each long segment (a prefill chunk) on its own, written into `out`."""
        bs = self.kv.block_size
        Hkv, D = kc.shape[0], kc.shape[2]
        for r0, n, _st, blocks, mask in plan.big:
            qs = q[r0 : r0 + n].transpose(0, 1)[None]
            if blocks is None:  # a sequence's first chunk: its own new keys only
                if k is not None and v is not None:
                    ks = k[r0 : r0 + n].transpose(0, 1)[None]
                    vs = v[r0 : r0 + n].transpose(0, 1)[None]
                else:  # already written (rope_store): read them back from their slots
                    ks = kc[:, plan.slots[r0 : r0 + n]][None]
                    vs = vc[:, plan.slots[r0 : r0 + n]][None]
                o = sdpa(qs, ks, vs, None, self.scaling, causal=True)
            else:
                assert mask is not None
                ks = kc.view(Hkv, -1, bs, D).index_select(1, blocks).view(Hkv, -1, D)[None]
                vs = vc.view(Hkv, -1, bs, D).index_select(1, blocks).view(Hkv, -1, D)[None]
                o = sdpa(qs, ks, vs, mask[None, None], self.scaling)
            out[r0 : r0 + n] = o[0].transpose(0, 1)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """torch's SDPA with grouped-query attention: q [B, H, Q, D], k/v [B, Hkv, C, D] -> [B, H, Q, D].

    With a mask, K/V are expanded to every query head here rather than passed with
    `enable_gqa=True`: CUDA's flash and memory-efficient kernels take no GQA with a mask, so
    torch would fall back to its math kernel (float32 GEMMs, a kernel per op) for every verify
    and chunked-prefill step. The expansion is a copy of the gathered blocks, the same values in
    the same order: the result is the math of `enable_gqa`."""
    H, Hkv = q.shape[1], k.shape[1]
    if H != Hkv and mask is not None:
        B, _, C, D = k.shape
        k = k[:, :, None].expand(B, Hkv, H // Hkv, C, D).reshape(B, H, C, D)
        v = v[:, :, None].expand(B, Hkv, H // Hkv, C, D).reshape(B, H, C, D)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=H != k.shape[1]
    )


def matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention of short segments as two batched matmuls.

    q: [G, Q, H, D]; k, v: [Hkv, G, C, D] (head-major, as the cache holds them); bias:
    [G, 1, Q, C], 0 where a query may attend and -inf where not (every query row has at least
    one 0; adding it is exact, and cheaper than a masked fill), or None (every key)
    -> [G, Q, H, D]. Query head h reads kv head h // (H / Hkv), as SDPA's enable_gqa does.
    The batch runs over (kv head, segment) so k and v are used as they are; only the (small)
    queries and output are rearranged. The softmax computes in float32 (CPU kernels for
    bf16/fp16 widen internally) and rounds its output once to the model dtype.

    Two CPU details decide the speed: oneDNN's batched matmul copies any operand whose batch
    stride is not rows x cols (a view into the cache), and copies a transposed view element by
    element (far slower than a row copy for long contexts), so k is made contiguous before it is
    transposed; and a power-of-two scale (head_dim 64: 1/8) is folded into q, which is exact,
    so the scores need no separate scaling pass."""
    G, Q, H, D = q.shape
    Hkv, C = k.shape[0], k.shape[2]
    r = H // Hkv
    exact_scale = math.frexp(scale)[0] == 0.5  # a power of two: multiplying by it is exact
    if exact_scale:
        q = q * scale
    qh = q.reshape(G, Q, Hkv, r, D).permute(2, 0, 3, 1, 4).reshape(Hkv * G, r * Q, D)
    kf, vf = k.reshape(Hkv * G, C, D).contiguous(), v.reshape(Hkv * G, C, D)
    s = torch.bmm(qh, kf.transpose(1, 2))  # [Hkv * G, r * Q, C]
    if not exact_scale:
        s = s.float() * scale
    if bias is not None:
        s.view(Hkv, G, r, Q, C).add_(bias.view(1, G, 1, Q, C))
    if s.dtype == q.dtype:  # the kernel computes in float32 and rounds once: one pass, no copy
        p = torch.softmax(s, dim=-1)
    else:
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    p = p.view(Hkv * G, r * Q, C)
    o = torch.bmm(p, vf)  # [Hkv * G, r * Q, D]
    return o.view(Hkv, G, r, Q, D).permute(1, 3, 0, 2, 4).reshape(G, Q, H, D)
