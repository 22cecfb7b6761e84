"""The fast forward of the model runner: the same maths as the reference forward, with fewer and
larger kernels and almost no Python per token.

- Weights are fused once at load: q/k/v into one [(H + 2 Hkv) D, d] matrix, gate/up into one
  [2 I, d] matrix (the HF modules keep views into them, so no memory is duplicated).
- A step's index tensors (token positions, cache slots, rotary rows, attention masks, the block
  lists attention reads) are built from the block tables with tensor ops, not loops over tokens.
- Rotary embedding reads a cos/sin table built once; q and k are rotated in one op.
- Attention "paged" (CPUs, the C kernel of ops/cpu_kernels.py): every segment, decode,
  verify and prefill chunk alike, reads its keys and values where they lie in the paged cache,
  walking its block table; nothing is gathered. Attention "sdpa"/"matmul" (CUDA, or without a
  compiler) reads the cache by whole blocks (`index_select` of [block_size, Hkv, D] rows straight
  from the block tables); there a prefill chunk that starts a sequence attends to its own new
  keys with no cache read at all, and decode/verify segments of equal length need no query
  re-packing.
- Linear layers go through `make_linear`: plain `F.linear`, oneDNN prepacked weights on CPUs, a
  C kernel for bf16 decode/verify rows on CPUs (ops/cpu_kernels.py; both guarded by device
  and dtype, never used on CUDA), or weight-only int8.

Greedy equality with the reference forward in float32 is what the tests hold it to.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

import dspark_serve.ops.linear as ops_linear
from dspark_serve.ops.linear import FastRMSNorm, Linear, make_linear
from dspark_serve.verifier.config import LINEAR_KINDS

if TYPE_CHECKING:
    from dspark_serve.ops.cpu_kernels import FusedElementwise, PagedAttention, RopeStore, TargetLayers
    from dspark_serve.verifier.block_manager import BlockManager
    from dspark_serve.verifier.model_runner import ForwardOutput, Segment

SMALL_SEGMENT = 32


# -- per-step plan --------------------------------------------------------------------------------
@dataclass
class _FastPlan:
    ids: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each new token
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D] (sign of rotate_half folded in)
    # decode/verify segments (<= SMALL_SEGMENT tokens), attended in one call per layer
    g_count: int = 0
    g_q: int = 0  # padded queries per segment
    g_row0: int = -1  # >= 0: rows [g_row0, g_row0 + G*Q) in order
    g_rows: torch.Tensor | None = None  # else [G, Q] flat row per query (pad -> 0)
    g_valid: torch.Tensor | None = None  # [G, Q] bool (with g_rows)
    g_blocks: torch.Tensor | None = None  # [G * nblk] block ids (pad -> 0)
    g_nblk: int = 0
    # [G, 1, Q, keys]: bool for SDPA, additive 0 / -inf in the model dtype for the matmul
    # attention; None: every key (one 1-token segment)
    g_mask: torch.Tensor | None = None
    # One segment alone (G == 1): its blocks as a view when they are consecutive in the pool
    # (no gather), and exactly its keys (no padding to whole blocks to mask away).
    g_first: int = -1  # >= 0: its blocks are g_first .. g_first + nblk - 1
    g_keys: int = 0  # > 0: attend to keys [0, g_keys) only
    # attention "paged": the C kernel reads the cache in place; int32 [G] rows, counts and start
    # positions of every segment's pieces (<= SMALL_SEGMENT queries each) and their [G, nblk]
    # block table (None: not this path)
    p_segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (row0, n, start, blocks [nb] | None, mask | None) per segment longer than SMALL_SEGMENT
    # (attention "sdpa" and "matmul": gathered blocks, then SDPA)
    big: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    logit_rows: torch.Tensor | None = None
    logits_offsets: list[int] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=list)


@dataclass
class _FastLayer:
    in_norm: FastRMSNorm
    post_norm: FastRMSNorm
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: FastRMSNorm | None
    k_norm: FastRMSNorm | None


class FastForwardMixin:
    """Mixed into ModelRunner; uses its attributes (layers, caches, blocks, sizes)."""

    # Set by ModelRunner.__init__ (declared here for the type checker).
    config: Any
    device: torch.device
    dtype: torch.dtype
    quantize: str
    embed: torch.nn.Module
    layers: list[Any]  # the HF decoder layers
    norm: torch.nn.Module
    rotary: torch.nn.Module
    lm_head: torch.nn.Linear
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    block_size: int
    blocks: BlockManager
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    has_qk_norm: bool
    scaling: float
    linear_kind: str
    gemm_max_rows: int | None
    attention: str  # "sdpa", "matmul" or "paged" (resolved from "auto")
    paged_attention: PagedAttention | None  # the C kernel, when attention is "paged"
    rope_store: RopeStore | None  # with paged attention: rotary + K/V write in one C call
    fused: FusedElementwise | None  # with rope_store: residual add + norm, SwiGLU in C
    target_driver: TargetLayers | None  # with all of those and the packed gemm: the layers in one C call

    # -- build ------------------------------------------------------------------------------------
    def _build_fast(self, linear: str, gemm_rows: int = 0) -> None:
        if linear not in LINEAR_KINDS:
            raise ValueError(f"linear must be one of {LINEAR_KINDS}, got {linear!r}")
        if linear == "mkldnn" and not ops_linear.mkldnn_linear_works(self.dtype, self.device):
            raise ValueError("linear 'mkldnn' needs float32/bfloat16 weights on a CPU with oneDNN")
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.fast_layers: list[_FastLayer] = []
        kinds: set[str] = set()
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            with torch.no_grad():
                wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
                bqkv = None
                if a.q_proj.bias is not None:
                    bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).contiguous()
                wgu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous()
                if self.quantize == "none":
                    # The HF modules keep views into the fused weights: no second copy in memory.
                    nq, nk = H * D, Hkv * D
                    a.q_proj.weight.data = wqkv[:nq]
                    a.k_proj.weight.data = wqkv[nq : nq + nk]
                    a.v_proj.weight.data = wqkv[nq + nk :]
                    if bqkv is not None:
                        a.q_proj.bias.data = bqkv[:nq]
                        a.k_proj.bias.data = bqkv[nq : nq + nk]
                        a.v_proj.bias.data = bqkv[nq + nk :]
                    ni = m.gate_proj.weight.shape[0]
                    m.gate_proj.weight.data = wgu[:ni]
                    m.up_proj.weight.data = wgu[ni:]
            fl = _FastLayer(
                in_norm=FastRMSNorm.of(layer.input_layernorm),
                post_norm=FastRMSNorm.of(layer.post_attention_layernorm),
                qkv=make_linear(wqkv, bqkv, linear, self.quantize, gemm_rows),
                o=make_linear(a.o_proj.weight, a.o_proj.bias, linear, self.quantize, gemm_rows),
                gate_up=make_linear(wgu, None, linear, self.quantize, gemm_rows),
                down=make_linear(m.down_proj.weight, m.down_proj.bias, linear, self.quantize, gemm_rows),
                q_norm=FastRMSNorm.of(a.q_norm) if self.has_qk_norm else None,
                k_norm=FastRMSNorm.of(a.k_norm) if self.has_qk_norm else None,
            )
            kinds.add(fl.qkv.kind)
            self.fast_layers.append(fl)
        # The LM head stays as is (tied to the embedding the drafter shares); prepacking helps it too.
        lm_w = self.lm_head.weight
        self.fast_lm_head = make_linear(lm_w, self.lm_head.bias, linear, "none", gemm_rows)
        self.linear_kind = "/".join(sorted(kinds))
        # bf16 products of more rows than this leave the C kernel for oneDNN (None: no such limit)
        rows = getattr(self.fast_layers[0].qkv, "max_rows", None) if self.fast_layers else None
        self.gemm_max_rows = rows if rows is not None and rows < 1 << 30 else None
        self.fast_norm = FastRMSNorm.of(self.norm)
        self._rope_dynamic = "dynamic" in str(getattr(self.rotary, "rope_type", ""))
        self._cos_table: torch.Tensor | None = None
        self._sin_table: torch.Tensor | None = None
        self._ensure_rope(min(4096, getattr(self.config, "max_position_embeddings", 4096) or 4096))
        self.target_driver = self._make_target_driver()

    def _make_target_driver(self) -> TargetLayers | None:
        """The decoder layers in one C call (`cpu_kernels.TargetLayers`) where every kernel of the
        loop is a C one: the paged attention with rotary and the K/V write fused, the fused
        elementwise kernels, every product through the packed gemm; no q/k head norms."""
        from dspark_serve.ops.cpu_kernels import (
            SmallGemmLinear,
            TargetLayers,
            TargetLayerWeights,
            load_kernels,
        )

        if self.fused is None or self.rope_store is None or self.paged_attention is None or self.has_qk_norm:
            return None
        lib = load_kernels()
        layers = self.fast_layers
        products = [lin for L in layers for lin in (L.qkv, L.o, L.gate_up, L.down)]
        if lib is None or not all(isinstance(lin, SmallGemmLinear) for lin in products):
            return None
        weights = [
            TargetLayerWeights(
                L.qkv,  # type: ignore[arg-type]
                L.o,  # type: ignore[arg-type]
                L.gate_up,  # type: ignore[arg-type]
                L.down,  # type: ignore[arg-type]
                (L.post_norm.w, L.post_norm.eps),
                (nxt.w, nxt.eps),
            )
            for L, nxt in zip(layers, [L.in_norm for L in layers[1:]] + [self.fast_norm])
        ]
        first = (layers[0].in_norm.w, layers[0].in_norm.eps)
        try:
            return TargetLayers(
                lib, weights, first, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size
            )
        except ValueError:  # a layout it does not take (a bias on gate_up, norms of another dtype)
            return None

    def _ensure_rope(self, n: int) -> None:
        if self._cos_table is not None and self._cos_table.shape[0] >= n:
            return
        size = max(n, 2 * (0 if self._cos_table is None else self._cos_table.shape[0]))
        pos = torch.arange(size, device=self.device)[None]
        cos, sin = self.rotary(torch.empty(1, device=self.device, dtype=self.dtype), pos)
        half = self.head_dim // 2
        sin = sin[0].clone()
        sin[:, :half] = -sin[:, :half]  # rotate_half(x) * sin == roll(x) * signed sin
        self._cos_table, self._sin_table = cos[0].contiguous(), sin.contiguous()

    # -- plan ---------------------------------------------------------------------------------------
    def _plan_fast(self, segments: Sequence[Segment]) -> _FastPlan:
        dev, bs = self.device, self.block_size
        lens = [len(s.token_ids) for s in segments]
        starts = [s.start_pos for s in segments]
        S = len(segments)
        T = sum(lens)
        row0 = list(itertools.accumulate(lens, initial=0))[:-1]
        ends = [a + n for a, n in zip(starts, lens)]
        nblks = [-(-e // bs) for e in ends]
        maxblk = max(nblks)
        tables = [self.blocks.table(s.request_id).blocks for s in segments]
        bt = torch.tensor(
            [t[:nb] + [0] * (maxblk - nb) for t, nb in zip(tables, nblks)], dtype=torch.long
        ).reshape(S, maxblk)
        lens_t = torch.tensor(lens)
        seg_of = torch.repeat_interleave(torch.arange(S), lens_t)
        pos = torch.tensor(starts)[seg_of] + torch.arange(T) - torch.tensor(row0)[seg_of]
        slots = bt[seg_of, pos // bs] * bs + pos % bs
        ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in segments)))
        if self._rope_dynamic:
            cos, sin = self.rotary(torch.empty(1, device=dev, dtype=self.dtype), pos.to(dev)[None])
            cos, sin = cos[0], sin[0].clone()
            sin[:, : self.head_dim // 2] *= -1
        else:
            self._ensure_rope(max(ends))
            assert self._cos_table is not None and self._sin_table is not None
            pd = pos.to(dev)
            cos, sin = self._cos_table[pd], self._sin_table[pd]
        plan = _FastPlan(ids=ids.to(dev), slots=slots.to(dev), cos=cos[:, None, :], sin=sin[:, None, :])

        if self.attention == "paged":
            # Every segment reads the cache in place, prefill chunks too: a long one is cut into
            # pieces of SMALL_SEGMENT queries (each attends to the keys before it and its own,
            # through the segment's block table), which bounds the kernel's score buffers and
            # gives the threads work items even for one long chunk.
            piece_of = [(i, a) for i in range(S) for a in range(0, lens[i], SMALL_SEGMENT)]
            seg = torch.tensor([i for i, _ in piece_of])
            off = torch.tensor([a for _, a in piece_of], dtype=torch.int32)
            plan.p_segments = (
                torch.tensor(row0, dtype=torch.int32)[seg] + off,
                (lens_t.to(torch.int32)[seg] - off).clamp_(max=SMALL_SEGMENT),
                torch.tensor(starts, dtype=torch.int32)[seg] + off,
                bt[seg].to(torch.int32).contiguous(),
            )
        small = [i for i in range(S) if lens[i] <= SMALL_SEGMENT]
        if small and self.attention != "paged":
            G = len(small)
            Q = max(lens[i] for i in small)
            nb = max(nblks[i] for i in small)
            sel = torch.tensor(small)
            plan.g_count, plan.g_q, plan.g_nblk = G, Q, nb
            plan.g_blocks = bt[sel, :nb].reshape(-1).to(dev)
            qn = lens_t[sel]
            qpos = torch.tensor(starts)[sel][:, None] + torch.arange(Q)[None, :]  # [G, Q]
            valid = torch.arange(Q)[None, :] < qn[:, None]
            kpos = torch.arange(nb * bs)
            mask = kpos[None, None, :] <= qpos[:, :, None]
            mask[:, :, 0] |= ~valid  # padded query rows see key 0
            if G == 1:
                blocks = tables[small[0]][:nb]
                if blocks == list(range(blocks[0], blocks[0] + nb)):
                    plan.g_first = blocks[0]
                plan.g_keys = ends[small[0]]
                mask = mask[:, :, : plan.g_keys]
            if not (G == 1 and Q == 1):
                if self.attention == "matmul":  # additive: one in-place add per layer
                    bias = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf"))
                    plan.g_mask = bias[:, None].to(dev)
                else:
                    plan.g_mask = mask[:, None].to(dev)
            contiguous = all(lens[i] == Q for i in small) and small == list(range(small[0], small[-1] + 1))
            if contiguous:
                plan.g_row0 = row0[small[0]]
            else:
                rows = torch.tensor(row0)[sel][:, None] + torch.arange(Q)[None, :]
                plan.g_rows = torch.where(valid, rows, 0).to(dev)
                plan.g_valid = valid.to(dev)
        for i in range(S):
            if lens[i] <= SMALL_SEGMENT or self.attention == "paged":
                continue
            n, st = lens[i], starts[i]
            if st == 0:
                plan.big.append((row0[i], n, 0, None, None))
            else:
                c = st + n
                m = torch.arange(nblks[i] * bs)[None, :] <= torch.arange(st, c)[:, None]
                plan.big.append((row0[i], n, st, bt[i, : nblks[i]].to(dev), m.to(dev)))
        logit_rows: list[int] = []
        for s, a in zip(segments, row0):
            plan.token_offsets.append(a)
            plan.logits_offsets.append(len(logit_rows))
            logit_rows.extend(range(a + s.logits_from, a + len(s.token_ids)))
        if logit_rows:
            plan.logit_rows = torch.tensor(logit_rows, device=dev)
        return plan

    # -- attention ----------------------------------------------------------------------------------
    def _attention(
        self, li: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, plan: _FastPlan
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens; None: already in the cache) -> [T, H * D].
        New K/V are written to their slots, then every segment attends to its blocks in the paged
        cache. The cache is head-major ([Hkv, slots, D] per layer), so the blocks of a segment,
        gathered or read in place, are already each head's [C, D] key matrix: no further copy
        before the matmuls."""
        bs, Hkv, D = self.block_size, self.num_kv_heads, self.head_dim
        kc, vc = self.k_cache[li], self.v_cache[li]  # [Hkv, num_blocks * bs, D]
        if k is not None and v is not None:
            kc.index_copy_(1, plan.slots, k.transpose(0, 1))
            vc.index_copy_(1, plan.slots, v.transpose(0, 1))
        kb = kc.view(Hkv, -1, bs, D)
        vb = vc.view(Hkv, -1, bs, D)
        T = q.shape[0]
        gqa = self.num_heads != Hkv
        out: torch.Tensor | None = None  # None: the whole step is one group
        if plan.p_segments is not None:
            assert self.paged_attention is not None
            out = q.new_empty(q.shape)
            self.paged_attention(q, kc, vc, out, *plan.p_segments, scale=self.scaling)
        elif not (plan.g_count and plan.g_row0 >= 0 and plan.g_count * plan.g_q == T and not plan.big):
            out = q.new_empty(q.shape)
        if plan.g_count:
            G, Q = plan.g_count, plan.g_q
            C = plan.g_nblk * bs
            if plan.g_row0 >= 0:
                qs = q[plan.g_row0 : plan.g_row0 + G * Q].view(G, Q, *q.shape[1:])
            else:
                assert plan.g_rows is not None and plan.g_valid is not None
                qs = q[plan.g_rows]
            if plan.g_first >= 0:  # one segment on consecutive blocks: read the pool in place
                lo = plan.g_first * bs
                ks = kc[:, lo : lo + C].view(Hkv, G, C, D)
                vs = vc[:, lo : lo + C].view(Hkv, G, C, D)
            else:
                assert plan.g_blocks is not None
                ks = kb.index_select(1, plan.g_blocks).view(Hkv, G, C, D)
                vs = vb.index_select(1, plan.g_blocks).view(Hkv, G, C, D)
            if plan.g_keys:
                ks, vs = ks[:, :, : plan.g_keys], vs[:, :, : plan.g_keys]
            if self.attention == "matmul":
                o = _matmul_attention(qs, ks, vs, plan.g_mask, self.scaling)
            else:
                o = F.scaled_dot_product_attention(
                    qs.transpose(1, 2),
                    ks.transpose(0, 1),
                    vs.transpose(0, 1),
                    attn_mask=plan.g_mask,
                    scale=self.scaling,
                    enable_gqa=gqa,
                ).transpose(1, 2)  # [G, Q, H, D]
            if out is None:
                return o.reshape(T, -1)
            if plan.g_row0 >= 0:
                out[plan.g_row0 : plan.g_row0 + G * Q] = o.reshape(G * Q, *q.shape[1:])
            else:
                assert plan.g_rows is not None and plan.g_valid is not None
                out[plan.g_rows[plan.g_valid]] = o[plan.g_valid]
        assert out is not None
        for r0, n, _st, blocks, mask in plan.big:
            qs = q[r0 : r0 + n].transpose(0, 1)[None]
            if blocks is None:  # a sequence's first chunk: its own new keys only
                if k is not None and v is not None:
                    ks = k[r0 : r0 + n].transpose(0, 1)[None]
                    vs = v[r0 : r0 + n].transpose(0, 1)[None]
                else:  # already written (rope_store): read them back from their slots
                    ks = kc[:, plan.slots[r0 : r0 + n]][None]
                    vs = vc[:, plan.slots[r0 : r0 + n]][None]
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scaling, enable_gqa=gqa
                )
            else:
                assert mask is not None
                ks = kb.index_select(1, blocks).view(Hkv, -1, D)[None]
                vs = vb.index_select(1, blocks).view(Hkv, -1, D)[None]
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask[None, None], scale=self.scaling, enable_gqa=gqa
                )
            out[r0 : r0 + n] = o[0].transpose(0, 1)
        return out.reshape(T, -1)

    # -- forward ------------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.roll(x, self.head_dim // 2, dims=-1) * sin

    @torch.inference_mode()
    def forward_fast(self, segments: Sequence[Segment], tap_layers: tuple[int, ...] = ()) -> ForwardOutput:

        plan = self._plan_fast(segments)
        T = plan.ids.numel()
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        nq, nk = H * D, Hkv * D
        h = self.embed(plan.ids)
        drv = self.target_driver
        if (
            drv is not None
            and plan.p_segments is not None
            and T <= drv.max_rows
            and h.dtype == drv.dtype
            and len(set(tap_layers)) == len(tap_layers)
        ):
            # the loop below in one C call: same kernels, same order, bit for bit
            cos, sin = plan.cos[:, 0].contiguous(), plan.sin[:, 0].contiguous()
            x, hidden = drv(
                h.contiguous(),
                self.k_cache,
                self.v_cache,
                cos,
                sin,
                plan.slots,
                plan.p_segments,
                self.scaling,
                tap_layers,
            )
            return self._output(x, plan, hidden)
        if self.fused is not None and self.rope_store is not None:
            h, hidden = self._layers_fused(h, plan, tap_layers)
            return self._output(h, plan, hidden)
        taps: dict[int, torch.Tensor] = {}
        if -1 in tap_layers:
            taps[-1] = h
        cos, sin = plan.cos, plan.sin
        last = self.num_layers - 1
        for li, L in enumerate(self.fast_layers):
            x = L.in_norm(h)
            qkv = L.qkv(x)
            if L.q_norm is not None and L.k_norm is not None:
                q = L.q_norm(qkv[:, :nq].view(T, H, D))
                k = L.k_norm(qkv[:, nq : nq + nk].view(T, Hkv, D))
                q = self._rope(q, cos, sin)
                k = self._rope(k, cos, sin)
            else:
                qk = self._rope(qkv[:, : nq + nk].view(T, H + Hkv, D), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, nq + nk :].view(T, Hkv, D)
            h = h + L.o(self._attention(li, q, k, v, plan))
            gu = L.gate_up(L.post_norm(h))
            g, u = gu.chunk(2, dim=-1)
            h = h + L.down(F.silu(g) * u)
            if li in tap_layers and li != last:
                taps[li] = h
        h = self.fast_norm(h)
        if last in tap_layers:
            taps[last] = h
        hidden = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        return self._output(h, plan, hidden)

    def _layers_fused(
        self, h: torch.Tensor, plan: _FastPlan, tap_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers on a CPU with the C kernels (bf16 or float32): each residual add is
        fused with the norm after it (h is updated in place, so taps take copies), rotary with the K/V
        write, SwiGLU into one call. -> the final-normed hidden states [T, d] and the tap states
        [T, len(tap_layers) * d] (None without tap layers), each copied once into its columns
        (a prefill chunk's taps are megabytes: no clone-then-concatenate)."""
        assert self.fused is not None and self.rope_store is not None
        E, T = self.fused, h.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        nq, nk = H * D, Hkv * D
        h = h.contiguous()
        d = h.shape[1]
        hidden = h.new_empty(T, len(tap_layers) * d) if tap_layers else None

        def tap(layer: int, state: torch.Tensor) -> None:
            if hidden is not None:
                for j, t in enumerate(tap_layers):
                    if t == layer:
                        hidden[:, j * d : (j + 1) * d].copy_(state)

        tap(-1, h)
        last = self.num_layers - 1
        first = self.fast_layers[0].in_norm
        x = E.add_rmsnorm(h, None, first.w, first.eps)
        for li, L in enumerate(self.fast_layers):
            qkv = L.qkv(x)
            q, k = qkv[:, :nq].view(T, H, D), qkv[:, nq : nq + nk].view(T, Hkv, D)
            if L.q_norm is not None and L.k_norm is not None:
                q, k = L.q_norm(q), L.k_norm(k)
            v = qkv[:, nq + nk :].view(T, Hkv, D)
            self.rope_store(q, k, v, plan.cos, plan.sin, plan.slots, self.k_cache[li], self.v_cache[li])
            x = E.add_rmsnorm(
                h, L.o(self._attention(li, q, None, None, plan)), L.post_norm.w, L.post_norm.eps
            )
            after = self.fast_layers[li + 1].in_norm if li < last else self.fast_norm
            x = E.add_rmsnorm(h, L.down(E.silu_mul(L.gate_up(x))), after.w, after.eps)
            if li != last:
                tap(li, h)
        tap(last, x)
        return x, hidden

    def _output(self, h: torch.Tensor, plan: _FastPlan, hidden: torch.Tensor | None) -> ForwardOutput:
        """Logits of the rows that need them, from the final-normed h, beside the tap states
        (hidden: [T, len(tap_layers) * d] or None)."""
        from dspark_serve.verifier.model_runner import ForwardOutput

        T = h.shape[0]
        if plan.logit_rows is not None:
            # decode: every row; index_select, not h[rows] (torch's CPU advanced indexing is slow)
            rows = h if plan.logit_rows.numel() == T else h.index_select(0, plan.logit_rows)
            # in the model's dtype: a greedy step needs only each row's argmax, and widening
            # 32 requests' 4-token verify rows to float32 alone took 2.3 ms (4.8 ms for 8 tokens)
            logits = self.fast_lm_head(rows)
        else:
            logits = h.new_zeros(0, self.vocab_size)
        return ForwardOutput(
            logits=logits,
            logits_offsets=plan.logits_offsets,
            hidden=hidden,
            token_offsets=plan.token_offsets,
            slots=plan.slots,
        )


def _matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention of short segments as two batched matmuls.

    q: [G, Q, H, D]; k, v: [Hkv, G, C, D] (head-major, as the cache holds them); bias:
    [G, 1, Q, C], 0 where a query may attend and -inf where not (every query row has at least
    one 0; adding it is exact, and half the cost of a masked fill), or None (every key)
    -> [G, Q, H, D]. Query head h reads kv head h // (H / Hkv), as SDPA's enable_gqa does.
    The batch runs over (kv head, segment) so k and v are used as they are; only the (small)
    queries and output are rearranged. The softmax computes in float32 (CPU kernels for
    bf16/fp16 widen internally) and rounds its output once to the model dtype.

    Two CPU details decide the speed: oneDNN's batched matmul copies any operand whose batch
    stride is not rows x cols (a view into the cache), and copies a transposed view element by
    element (4-5x slower than a row copy at 4K keys), so k is made contiguous before it is
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
