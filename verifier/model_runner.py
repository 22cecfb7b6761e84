"""The target runner: one flat forward over the new tokens of every scheduled request, with no
padding of the token batch, over a paged KV cache, returning logits at the rows asked for and the
hidden states of chosen layers (the drafter's context features).

Llama, Qwen2 and Qwen3 share one decoder shape (pre-norm attention + SwiGLU MLP); Qwen3 adds a
per-head RMSNorm on q and k, Qwen2 adds q/k/v biases (inside its Linear layers). We reuse the HF
modules' weights and projections and replace only attention and the cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dspark_serve.ops.cpu_kernels import (
    FusedElementwise,
    PagedAttention,
    RopeStore,
    find_compiler,
    kernels_key,
    load_kernels,
    paged_attention_supports,
)
from dspark_serve.verifier.block_manager import BlockManager
from dspark_serve.verifier.config import ATTENTION_KINDS
from dspark_serve.verifier.fast_forward import FastForwardMixin

# Segments this short (decode/verify rounds) are attended together in one padded call per layer;
# longer ones (prefill chunks) get a call each, so one long prompt never pads the whole batch.
SMALL_SEGMENT = 32


@dataclass
class Segment:
    """The new tokens of one request in this forward.

    token_ids: tokens fed this step (prefill chunk, or anchor + drafts).
    start_pos: sequence position of token_ids[0]; the KV of positions < start_pos is cached.
    logits_from: logits are returned for segment rows [logits_from, len(token_ids)).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    logits_from: int

    @property
    def num_logits(self) -> int:
        return len(self.token_ids) - self.logits_from


@dataclass
class ForwardOutput:
    """logits: [sum num_logits, V], segments in order: float32, or the model's dtype from the
    fast CPU forward (consumers that need float32, sampling and logprobs, widen the rows they
    read; a greedy verdict is the argmax, the same in either). hidden: [sum len(token_ids), m*d]
    (tap layers concatenated) or None. *_offsets[i]: first row of segment i. slots: [sum
    len(token_ids)] the KV cache slot of every row (where its K/V was written), or None."""

    logits: torch.Tensor
    logits_offsets: list[int]
    hidden: torch.Tensor | None
    token_offsets: list[int]
    slots: torch.Tensor | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class _AttnPlan:
    """Index tensors shared by all layers of one forward."""

    slots: torch.Tensor  # [T] cache slot of each new token
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]
    small_rows: torch.Tensor | None = None  # [G, Qmax] flat row of each padded query (pad -> 0)
    small_gather: torch.Tensor | None = None  # [G, Cmax] cache slot per key (pad -> 0)
    small_mask: torch.Tensor | None = None  # [G, 1, Qmax, Cmax] bool
    small_dst: torch.Tensor | None = None  # [sum n] flat row of each real padded query
    small_src: torch.Tensor | None = None  # [sum n] its index in the flattened [G * Qmax]
    # (row_start, n, gather [C], mask [n, C]) per segment longer than a small one
    big: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class ModelRunner(FastForwardMixin):
    """Runs a HF causal LM (Llama/Qwen2/Qwen3) over a paged KV cache it owns."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        impl: str = "fast",
        linear: str = "auto",
        quantize: str = "none",
        attention: str = "auto",
        gemm_rows: int = 0,
    ) -> None:
        """impl: "fast" (fused weights, vectorised planning, block-granular KV reads) or
        "reference" (the original per-module forward). linear: how the fast path multiplies
        (see `verifier.kernels.make_linear`). quantize: "none" or "int8" (weight-only,
        per output channel; changes the target's numerics). attention: how the fast path attends
        decode/verify segments (auto, sdpa or matmul; see ModelConfig.attention). gemm_rows: the
        most rows a bf16 product takes through the C gemm kernel (0: by the CPU; see
        ModelConfig.gemm_rows)."""
        if impl not in ("fast", "reference"):
            raise ValueError(f"impl must be fast or reference, got {impl!r}")
        if quantize not in ("none", "int8"):
            raise ValueError(f"quantize must be none or int8, got {quantize!r}")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if quantize != "none" and impl != "fast":
            raise ValueError(f"quantize {quantize!r} needs impl='fast', got {impl!r}")
        self.impl = impl
        self.quantize = quantize
        self.model = model
        cfg: Any = model.config
        self.config = cfg
        inner: Any = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head  # type: ignore[assignment]
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size)
        # Head-major: each layer's cache is [Hkv, slots, D], so a head's keys of a run of blocks
        # are one [C, D] matrix (the attention matmuls read them without rearranging).
        shape = (self.num_layers, self.num_kv_heads, num_blocks * block_size, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.has_qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.scaling = self.head_dim**-0.5
        self.linear_kind = "module"
        self.gemm_max_rows = None
        self.attention, self.paged_attention = self._resolve_attention(attention, impl)
        # With the paged kernel (bf16 or float32): rotary and the K/V write fused too, and the
        # residual adds with their norms and SwiGLU (csrc/elementwise.c).
        self.rope_store: RopeStore | None = None
        self.fused: FusedElementwise | None = None
        lib = load_kernels() if self.paged_attention is not None else None
        if lib is not None and self.dtype in (torch.bfloat16, torch.float32) and self.head_dim <= 256:
            self.rope_store = RopeStore(lib, self.num_heads, self.num_kv_heads, self.head_dim)
            self.fused = FusedElementwise(lib)
        if impl == "fast":
            self._build_fast(linear, gemm_rows)

    def _resolve_attention(self, attention: str, impl: str) -> tuple[str, PagedAttention | None]:
        """auto: the paged C kernel on a CPU (float32/bfloat16) where it builds; else matmul for
        bf16/fp16 on CPU and sdpa elsewhere. "paged" asked for where it cannot run is an error."""
        pow2 = self.block_size & (self.block_size - 1) == 0  # the kernel walks blocks by shifts
        fits = self.head_dim <= 256  # its per-row buffers
        paged_ok = impl == "fast" and pow2 and fits and paged_attention_supports(self.dtype, self.device)
        if attention in ("auto", "paged") and paged_ok:
            lib = load_kernels()
            if lib is not None:
                geometry = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
                return "paged", PagedAttention(lib, *geometry)
        if attention == "paged":
            raise ValueError(
                f"attention 'paged' needs the fast forward with float32/bfloat16 on a CPU, a "
                f"power-of-two block size, head_dim <= 256 and a C compiler; got impl {impl!r}, "
                f"{self.dtype} on {self.device}, block size {self.block_size}, head_dim "
                f"{self.head_dim} ({find_compiler() or 'no compiler'})"
            )
        if attention == "auto":
            reduced = self.dtype in (torch.bfloat16, torch.float16)
            attention = "matmul" if self.device.type == "cpu" and reduced else "sdpa"
        return attention, None

    def describe(self) -> str:
        """One line for logs and benchmarks: which forward runs and how it multiplies."""
        if self.impl == "reference":
            return "reference"
        q = "" if self.quantize == "none" else f", weights {self.quantize}"
        fused = ", fused elementwise" if self.fused is not None else ""
        rows = "" if self.gemm_max_rows is None else f" up to {self.gemm_max_rows} rows, oneDNN above"
        return f"fast (linear {self.linear_kind}{rows}, attention {self.attention}{fused}{q})"

    def cost_signature(self) -> str:
        """describe() plus the C kernels' build key where the forward runs them: a cost table
        measured with other kernel code (an older build of the same kinds) is not reused."""
        uses_c = self.paged_attention is not None or self.linear_kind == "gemm" or self.fused is not None
        key = kernels_key() if uses_c else None
        return self.describe() + (f" [kernels {key}]" if key else "")

    @torch.inference_mode()
    def copy_kv_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (a fork's partial block, `BlockManager.fork`)."""
        bs = self.block_size
        for cache in (self.k_cache, self.v_cache):
            cache[:, :, dst * bs : (dst + 1) * bs].copy_(cache[:, :, src * bs : (src + 1) * bs])

    def forward(self, segments: list[Segment], tap_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Forward the new tokens of all segments. The caller has already reserved their KV slots
        with `self.blocks.append` (so a failed allocation never leaves half a forward)."""
        with self.attention_backends():
            if self.impl == "reference":
                return self.forward_reference(segments, tap_layers)
            return self.forward_fast(segments, tap_layers)

    def attention_backends(self) -> contextlib.AbstractContextManager[object]:
        """Where torch's SDPA may run: on CUDA, anything but its cuDNN backend. cuDNN builds an
        execution plan per new input shape (tens of milliseconds each), and in serving the
        shapes change every step (every request's context grows), so it would plan almost every
        step; the flash, memory-efficient and math kernels need no plan. The engine enters this
        around a whole step, so the drafter's attention follows the same rule."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    @staticmethod
    def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        elt = torch.tensor([], dtype=dtype).element_size()
        return int(2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elt)

    # -- planning --------------------------------------------------------------------------
    def _plan_reference(self, segments: list[Segment]) -> _AttnPlan:
        dev = self.device
        slots: list[int] = []
        positions: list[int] = []
        small: list[tuple[int, Segment]] = []
        big: list[tuple[int, Segment]] = []
        row = 0
        for seg in segments:
            n = len(seg.token_ids)
            slots += self.blocks.slots(seg.request_id, seg.start_pos, seg.start_pos + n)
            positions += range(seg.start_pos, seg.start_pos + n)
            (small if n <= SMALL_SEGMENT else big).append((row, seg))
            row += n
        pos = torch.tensor(positions, device=dev)
        cos, sin = self.rotary(torch.empty(1, device=dev, dtype=self.dtype), pos[None])
        plan = _AttnPlan(
            slots=torch.tensor(slots, device=dev), cos=cos[0, :, None, :], sin=sin[0, :, None, :]
        )
        if small:
            qmax = max(len(s.token_ids) for _, s in small)
            cmax = max(s.start_pos + len(s.token_ids) for _, s in small)
            rows = torch.zeros(len(small), qmax, dtype=torch.long)
            valid = torch.zeros(len(small), qmax, dtype=torch.bool)
            gather = torch.zeros(len(small), cmax, dtype=torch.long)
            qpos = torch.full((len(small), qmax), -1, dtype=torch.long)
            ctx = torch.zeros(len(small), 1, dtype=torch.long)
            for g, (r0, s) in enumerate(small):
                n, c = len(s.token_ids), s.start_pos + len(s.token_ids)
                rows[g, :n] = torch.arange(r0, r0 + n)
                valid[g, :n] = True
                gather[g, :c] = torch.tensor(self.blocks.slots(s.request_id, 0, c))
                qpos[g, :n] = torch.arange(s.start_pos, c)
                ctx[g] = c
            kpos = torch.arange(cmax)[None, None, :]
            # causal within the request; padded query rows see key 0 so softmax stays finite
            mask = (kpos <= qpos[:, :, None]) & (kpos < ctx[:, :, None])
            mask[:, :, 0] |= ~valid
            plan.small_rows = rows.to(dev)
            plan.small_gather, plan.small_mask = gather.to(dev), mask[:, None].to(dev)
            # Integer indices built on the host: a boolean mask index on the device would
            # synchronise with it in every layer.
            plan.small_dst = rows[valid].to(dev)
            plan.small_src = valid.flatten().nonzero().squeeze(1).to(dev)
        for r0, s in big:
            n, c = len(s.token_ids), s.start_pos + len(s.token_ids)
            gather = torch.tensor(self.blocks.slots(s.request_id, 0, c), device=dev)
            mask_ = torch.arange(c, device=dev)[None, :] <= torch.arange(s.start_pos, c, device=dev)[:, None]
            plan.big.append((r0, n, gather, mask_))
        return plan

    # -- forward ---------------------------------------------------------------------------
    def _attention_reference(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _AttnPlan
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens) -> out [T, H*D]; gathers every request's
        whole context into padded buffers (the reference the fast path is tested against)."""
        kc, vc = self.k_cache[li].transpose(0, 1), self.v_cache[li].transpose(0, 1)  # [slots, Hkv, D] views
        kc.index_copy_(0, plan.slots, k)
        vc.index_copy_(0, plan.slots, v)
        out = q.new_empty(q.shape)
        gqa = self.num_heads != self.num_kv_heads
        if plan.small_rows is not None:
            qs = q[plan.small_rows].transpose(1, 2)  # [G, H, Qmax, D]
            ks = kc[plan.small_gather].transpose(1, 2)  # [G, Hkv, Cmax, D]
            vs = vc[plan.small_gather].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=plan.small_mask, scale=self.scaling, enable_gqa=gqa
            )
            o = o.transpose(1, 2)  # [G, Qmax, H, D]
            out[plan.small_dst] = o.flatten(0, 1)[plan.small_src]
        for r0, n, gidx, mask in plan.big:
            qs = q[r0 : r0 + n].transpose(0, 1)[None]  # [1, H, n, D]
            ks = kc[gidx].transpose(0, 1)[None]  # [1, Hkv, C, D]
            vs = vc[gidx].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask[None, None], scale=self.scaling, enable_gqa=gqa
            )
            out[r0 : r0 + n] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)

    @torch.inference_mode()
    def forward_reference(self, segments: list[Segment], tap_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """The original forward on the HF modules: per-token Python planning, separate q/k/v and
        gate/up projections, a padded gather of every context per layer. Kept as the reference
        (and as `impl="reference"`)."""
        plan = self._plan_reference(segments)
        ids = torch.tensor([t for s in segments for t in s.token_ids], device=self.device)
        T = ids.numel()
        h = self.embed(ids)
        taps: dict[int, torch.Tensor] = {}
        if -1 in tap_layers:
            taps[-1] = h
        cos, sin = plan.cos, plan.sin
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(T, H, D)
            k = attn.k_proj(x).view(T, Hkv, D)
            v = attn.v_proj(x).view(T, Hkv, D)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            h = h + attn.o_proj(self._attention_reference(li, q, k, v, plan))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if li in tap_layers and li != self.num_layers - 1:
                taps[li] = h
        h = self.norm(h)
        # Like HF's output_hidden_states, the last layer's tap is taken after the final norm.
        if self.num_layers - 1 in tap_layers:
            taps[self.num_layers - 1] = h
        logit_rows: list[int] = []
        logits_offsets: list[int] = []
        token_offsets: list[int] = []
        r = 0
        for s in segments:
            token_offsets.append(r)
            logits_offsets.append(len(logit_rows))
            logit_rows += range(r + s.logits_from, r + len(s.token_ids))
            r += len(s.token_ids)
        if logit_rows:
            logits = self.lm_head(h[torch.tensor(logit_rows, device=self.device)]).float()
        else:
            logits = h.new_zeros(0, self.vocab_size, dtype=torch.float32)
        hidden = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        return ForwardOutput(
            logits=logits,
            logits_offsets=logits_offsets,
            hidden=hidden,
            token_offsets=token_offsets,
            slots=plan.slots,
        )
