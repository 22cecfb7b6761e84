"""The reference forward: the HF modules as they are (separate q/k/v and gate/up projections),
per-token planning in Python, and every request's whole context gathered into padded buffers
each layer. Kept as the fallback (`forward = "reference"`) and the reference the fast forward is
tested against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark_serve.verifier.forward import SMALL_SEGMENT, ForwardOutput, ModelParts, RowLayout, Segment
from dspark_serve.verifier.kv_cache import KVCache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class _SmallGroup:
    """Short segments attended together, padded to the longest: rows [G, Qmax] flat row of each
    query (pad -> 0), gather [G, Cmax] cache slot per key (pad -> 0), mask [G, 1, Qmax, Cmax],
    dst [sum n] flat row of each real query, src [sum n] its index in the flattened [G * Qmax]."""

    rows: torch.Tensor
    gather: torch.Tensor
    mask: torch.Tensor
    dst: torch.Tensor
    src: torch.Tensor


@dataclass
class _Plan:
    """Index tensors shared by all layers of one forward."""

    slots: torch.Tensor  # [T] cache slot of each new token
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]
    small: _SmallGroup | None = None
    # (row_start, n, gather [C], mask [n, C]) per segment longer than a small one
    big: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class ReferenceForward:
    def __init__(self, parts: ModelParts, kv: KVCache) -> None:
        self.parts, self.kv = parts, kv

    def describe(self) -> str:
        return "reference"

    def uses_c_kernels(self) -> bool:
        return False

    @torch.inference_mode()
    def __call__(self, segments: Sequence[Segment], tap_layers: tuple[int, ...] = ()) -> ForwardOutput:
        P = self.parts
        plan = self.plan(segments)
        ids = torch.tensor([t for s in segments for t in s.token_ids], device=P.device)
        T = ids.numel()
        h = P.embed(ids)
        taps: dict[int, torch.Tensor] = {-1: h} if -1 in tap_layers else {}
        H, Hkv, D = P.num_heads, P.num_kv_heads, P.head_dim
        last = P.num_layers - 1
        for li, layer in enumerate(P.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(T, H, D)
            k = attn.k_proj(x).view(T, Hkv, D)
            v = attn.v_proj(x).view(T, Hkv, D)
            if P.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * plan.cos + _rotate_half(q) * plan.sin
            k = k * plan.cos + _rotate_half(k) * plan.sin
            h = h + attn.o_proj(self._attention(li, q, k, v, plan))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if li in tap_layers and li != last:
                taps[li] = h
        h = P.norm(h)
        # Like HF's output_hidden_states, the last layer's tap is taken after the final norm.
        if last in tap_layers:
            taps[last] = h
        layout = RowLayout.of(segments)
        if layout.logit_rows:
            logits = P.lm_head(h[torch.tensor(layout.logit_rows, device=P.device)]).float()
        else:
            logits = h.new_zeros(0, P.vocab_size, dtype=torch.float32)
        hidden = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        return ForwardOutput(logits, layout.logits_offsets, hidden, layout.token_offsets, plan.slots)

    # -- plan --------------------------------------------------------------------------------------
    def plan(self, segments: Sequence[Segment]) -> _Plan:
        P, bs = self.parts, self.kv.block_size
        slots: list[int] = []
        positions: list[int] = []
        small: list[tuple[int, Segment]] = []
        big: list[tuple[int, Segment]] = []
        row = 0
        for seg in segments:
            slots += seg.slots(bs, seg.start_pos, seg.end_pos)
            positions += range(seg.start_pos, seg.end_pos)
            (small if len(seg.token_ids) <= SMALL_SEGMENT else big).append((row, seg))
            row += len(seg.token_ids)
        pos = torch.tensor(positions, device=P.device)
        cos, sin = P.rotary(torch.empty(1, device=P.device, dtype=P.dtype), pos[None])
        plan = _Plan(torch.tensor(slots, device=P.device), cos[0, :, None, :], sin[0, :, None, :])
        if small:
            plan.small = self._small_group(small)
        for r0, s in big:
            c = s.end_pos
            gather = torch.tensor(s.slots(bs, 0, c), device=P.device)
            causal = (
                torch.arange(c, device=P.device)[None, :]
                <= torch.arange(s.start_pos, c, device=P.device)[:, None]
            )
            plan.big.append((r0, len(s.token_ids), gather, causal))
        return plan

    def _small_group(self, small: list[tuple[int, Segment]]) -> _SmallGroup:
        dev, bs = self.parts.device, self.kv.block_size
        G = len(small)
        qmax = max(len(s.token_ids) for _, s in small)
        cmax = max(s.end_pos for _, s in small)
        rows = torch.zeros(G, qmax, dtype=torch.long)
        valid = torch.zeros(G, qmax, dtype=torch.bool)
        gather = torch.zeros(G, cmax, dtype=torch.long)
        qpos = torch.full((G, qmax), -1, dtype=torch.long)
        ctx = torch.zeros(G, 1, dtype=torch.long)
        for g, (r0, s) in enumerate(small):
            n, c = len(s.token_ids), s.end_pos
            rows[g, :n] = torch.arange(r0, r0 + n)
            valid[g, :n] = True
            gather[g, :c] = torch.tensor(s.slots(bs, 0, c))
            qpos[g, :n] = torch.arange(s.start_pos, c)
            ctx[g] = c
        kpos = torch.arange(cmax)[None, None, :]
        # causal within the request; padded query rows see key 0 so softmax stays finite
        mask = (kpos <= qpos[:, :, None]) & (kpos < ctx[:, :, None])
        mask[:, :, 0] |= ~valid
        # Integer indices built on the host: a boolean mask index on the device would
        # synchronise with it in every layer.
        return _SmallGroup(
            rows=rows.to(dev),
            gather=gather.to(dev),
            mask=mask[:, None].to(dev),
            dst=rows[valid].to(dev),
            src=valid.flatten().nonzero().squeeze(1).to(dev),
        )

    # -- attention ---------------------------------------------------------------------------------
    def _attention(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens) -> out [T, H*D]: the new K/V written to
        their slots, then every request attends to its whole gathered context."""
        P = self.parts
        kc, vc = self.kv.k[li].transpose(0, 1), self.kv.v[li].transpose(0, 1)  # [slots, Hkv, D] views
        kc.index_copy_(0, plan.slots, k)
        vc.index_copy_(0, plan.slots, v)
        out = q.new_empty(q.shape)
        gqa = P.num_heads != P.num_kv_heads
        g = plan.small
        if g is not None:
            qs = q[g.rows].transpose(1, 2)  # [G, H, Qmax, D]
            ks = kc[g.gather].transpose(1, 2)  # [G, Hkv, Cmax, D]
            vs = vc[g.gather].transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, scale=P.scaling, enable_gqa=gqa)
            out[g.dst] = o.transpose(1, 2).flatten(0, 1)[g.src]  # [G, Qmax, H, D] -> real rows
        for r0, n, gidx, mask in plan.big:
            qs = q[r0 : r0 + n].transpose(0, 1)[None]  # [1, H, n, D]
            ks = kc[gidx].transpose(0, 1)[None]  # [1, Hkv, C, D]
            vs = vc[gidx].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask[None, None], scale=P.scaling, enable_gqa=gqa
            )
            out[r0 : r0 + n] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)
