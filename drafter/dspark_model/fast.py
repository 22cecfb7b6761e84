"""The drafter's serving backbone in bf16 on a CPU: DSparkModel's maths (project_context,
context_kv, forward_block) with the kernels the target's fast forward uses.

- q/k/v (and, for context rows, k/v) and gate/up run as one prepacked linear each;
- RMSNorm is the target's fused CPU kernel (`FastRMSNorm`), not ~8 elementwise kernels; with
  the C kernels the q / k head norms run with the rotary embedding in one pass (float32) or as
  one norm call over packed rows;
- rotary tables are built once and read by position (the sign of rotate_half folded into sin);
- attention reads the context K/V in place through the target's C kernel (ops/cpu_kernels.py)
  where it builds (`forward_block_in_place`); otherwise two batched matmuls over (segment, kv
  head), the query heads of a group stacked as rows, over a copy of the context
  (`forward_block`; SDPA is slow on CPU for short bf16 queries);
- in bf16 with the C kernels, the in-place pass's layers run as one C call
  (`ops.cpu_kernels.DraftLayers`: the same kernels in the same order, the same bits),
  which spares the Python dispatch of a layer's dozen kernels (a noticeable share of a
  proposal; bench/drafting_cost.py measures what a proposal costs).

The modules stay the reference (training, float32 serving, CUDA); this path is chosen where
`applies` says so and is tested against them to bf16 rounding.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from dspark_serve.drafter.dspark_model.model import DSparkModel
from dspark_serve.drafter.dspark_model.modules import DecoderLayer, MarkovHead
from dspark_serve.drafter.dspark_model.ops import ACTIVATIONS, rope_cos_sin
from dspark_serve.ops import triton_attention
from dspark_serve.ops.cpu_kernels import (
    DTYPE_CODES,
    DraftLayers,
    DraftLayerWeights,
    FusedElementwise,
    PagedAttention,
    SmallGemmLinear,
    load_kernels,
    pack_small_gemm,
    paged_attention_supports,
)
from dspark_serve.ops.linear import FastRMSNorm, Linear, make_linear, mkldnn_linear_works
from dspark_serve.ops.triton_attention import TritonElementwise


def applies(model: DSparkModel) -> bool:
    """On a CPU: float32 or bf16 weights where the C kernels build (the packed matmul and the
    in-place attention, as in the target's fast forward), or bf16 ones oneDNN takes. On CUDA:
    where Triton is installed (the target's Triton attention reads the pools in place, its
    elementwise kernels fuse the norms and SwiGLU; the products are fused cuBLAS ones)."""
    if model.device.type == "cuda":
        return triton_attention.available() and not triton_attention.interpreted()
    return prepacked_linears_pay(model.dtype, model.device)


def prepacked_linears_pay(dtype: torch.dtype, device: torch.device) -> bool:
    """Linears packed once at load beat nn.Linear here: float32/bf16 on a CPU where the C
    kernels build, or bf16 on a CPU whose oneDNN takes it (nn.Linear would reorder the weight
    on every call)."""
    from dspark_serve.ops.cpu_kernels import load_kernels

    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    return load_kernels() is not None or (dtype == torch.bfloat16 and mkldnn_linear_works(dtype, device))


@dataclass
class _Layer:
    in_norm: FastRMSNorm
    post_norm: FastRMSNorm
    q_norm: FastRMSNorm
    k_norm: FastRMSNorm
    qkv: Linear
    kv: Linear  # the k/v rows of qkv alone, for context rows (no queries there)
    o: Linear
    gate_up: Linear
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ContextRows:
    """Context positions projected into the pools in the same pass as a block
    (`forward_block_in_place`): their k / v ride along with the block's rows through each
    layer's q/k/v linear, rotary pass and pool write, instead of a pass of their own.
    feats: [T, d] (`project_context`'s); slots, positions: [T] int64, where each goes."""

    feats: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def _linear(ws: Sequence[torch.Tensor], bs: Sequence[torch.Tensor | None]) -> Linear:
    w = torch.cat([x.detach() for x in ws]).contiguous()
    b = None if bs[0] is None else torch.cat([x.detach() for x in bs if x is not None]).contiguous()
    return make_linear(w, b, "auto", "none")


def _fused_layer(layer: DecoderLayer, act: Callable[[torch.Tensor], torch.Tensor]) -> _Layer:
    """A decoder layer's weights as fused, prepacked copies."""
    a, m = layer.self_attn, layer.mlp
    return _Layer(
        in_norm=FastRMSNorm.of(layer.input_layernorm),
        post_norm=FastRMSNorm.of(layer.post_attention_layernorm),
        q_norm=FastRMSNorm.of(a.q_norm),
        k_norm=FastRMSNorm.of(a.k_norm),
        qkv=_linear(
            [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
            [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias],
        ),
        kv=_linear([a.k_proj.weight, a.v_proj.weight], [a.k_proj.bias, a.v_proj.bias]),
        o=_linear([a.o_proj.weight], [a.o_proj.bias]),
        gate_up=_linear([m.gate_proj.weight, m.up_proj.weight], [None]),
        down=_linear([m.down_proj.weight], [None]),
        act=act,
    )


def _layer_driver(
    kernels: ctypes.CDLL, layers: list[_Layer], norm: FastRMSNorm, H: int, Hkv: int, D: int
) -> DraftLayers | None:
    """The layers in one C call (`DraftLayers`) where every piece of `_layers` runs through the
    C kernels in bf16 (packed products, the fused norms, SwiGLU); else None. The caller has
    checked the kernels, the fused elementwise ops and the dtype."""
    if D > 256:
        return None
    parts = [lin for L in layers for lin in (L.qkv, L.o, L.gate_up, L.down)]
    if not all(isinstance(lin, SmallGemmLinear) and lin.dtype == torch.bfloat16 for lin in parts):
        return None
    nxt = [L.in_norm for L in layers[1:]] + [norm]
    weights = [
        DraftLayerWeights(
            qkv=cast(SmallGemmLinear, L.qkv),
            o=cast(SmallGemmLinear, L.o),
            gate_up=cast(SmallGemmLinear, L.gate_up),
            down=cast(SmallGemmLinear, L.down),
            q_norm=(L.q_norm.w, L.q_norm.eps),
            k_norm=(L.k_norm.w, L.k_norm.eps),
            post_norm=(L.post_norm.w, L.post_norm.eps),
            next_norm=(N.w, N.eps),
        )
        for L, N in zip(layers, nxt)
    ]
    first = layers[0].in_norm
    try:
        return DraftLayers(kernels, weights, (first.w, first.eps), H, Hkv, D)
    except ValueError:  # a bias on the MLP's products, a norm of another dtype
        return None


class RotaryTables:
    """cos and signed sin by position, built once (doubling as positions grow) and read by
    index: the sign of rotate_half is folded into sin."""

    def __init__(
        self, inv_freq: torch.Tensor, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.inv_freq, self.D, self.dtype, self.device = inv_freq, head_dim, dtype, device
        self.cos = self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def upto(self, n: int) -> None:
        """Make the tables cover positions 0 .. n - 1."""
        if self.cos.shape[0] >= n:
            return
        size = max(n, 2 * self.cos.shape[0])
        cos, sin = rope_cos_sin(torch.arange(size, device=self.device), self.inv_freq, self.dtype)
        sin = sin.clone()
        sin[:, : self.D // 2] *= -1  # rotate_half(x) * sin == roll(x, D/2) * signed sin
        self.cos, self.sin = cos, sin

    def at(self, positions: torch.Tensor, built: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [..., n] -> cos, signed sin: [..., n, 1, D] (broadcast over heads).
        built: the caller made the tables long enough already (`upto`), which spares
        reading the largest position back from the tensor."""
        if not built:
            self.upto(int(positions.max()) + 1)
        flat = positions.reshape(-1)  # index_select: torch's advanced indexing is far slower on CPU
        shape = (*positions.shape, 1, self.D)
        return self.cos.index_select(0, flat).view(shape), self.sin.index_select(0, flat).view(shape)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [..., n, heads, D]; cos, sin from `at`."""
        return x * cos + torch.roll(x, self.D // 2, dims=-1) * sin


@dataclass(frozen=True)
class PoolSegments:
    """Where an in-place block pass reads and writes the drafter's context pools: the C
    attention kernel's segment arrays (row0, n, start: [B] int32; table: [B, nblk] int32 block
    table over pools seen in runs of `block_size` positions) and `flat`, the pool rows viewed
    as [num_slots * capacity, Hkv, D] that the block's own k/v (then the context rows') go to."""

    row0: torch.Tensor
    n: torch.Tensor
    start: torch.Tensor
    table: torch.Tensor
    flat: torch.Tensor
    block_size: int

    @classmethod
    def of(
        cls, slots: Sequence[int], starts: Sequence[int], Lb: int, capacity: int, context: ContextRows | None
    ) -> PoolSegments:
        B = len(slots)
        bs = capacity & -capacity  # the largest power of two dividing it: a request's run of blocks
        per = capacity // bs
        nblk = -(-(max(starts) + Lb) // bs)
        # The kernel's segment arrays from host lists in one tensor (a torch op costs more than
        # the arithmetic here): row0 | n | start | block table [B, nblk]
        ints = torch.tensor(
            [b * Lb for b in range(B)]
            + [Lb] * B
            + list(starts)
            + [s * per + j for s in slots for j in range(nblk)],
            dtype=torch.int32,
        )
        # index_copy_ into the flat rows, not an indexed put: the cheaper of the two
        flat = torch.tensor(
            [s * capacity + p for s, p0 in zip(slots, starts) for p in range(p0, p0 + Lb)], dtype=torch.long
        )
        if context is not None:
            flat = torch.cat([flat, context.slots * capacity + context.positions])
        return cls(ints[:B], ints[B : 2 * B], ints[2 * B : 3 * B], ints[3 * B :].view(B, nblk), flat, bs)

    @property
    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.row0, self.n, self.start, self.table

    def on_device(
        self, dev: torch.device, B: int, Lb: int
    ) -> tuple[torch.Tensor, triton_attention.VarlenSegments]:
        """As the Triton kernel reads them: the flat pool rows the block's (then the context's)
        k/v go to, and the segments (B requests of Lb queries each) on `dev`."""
        ints = torch.cat([self.row0, self.start, self.table.reshape(-1)]).to(dev)  # one copy over
        cu_q = torch.arange(0, (B + 1) * Lb, Lb, dtype=torch.int32, device=dev)
        table = ints[2 * B :].view(B, -1)
        return self.flat.to(dev), triton_attention.VarlenSegments(cu_q, ints[B : 2 * B], table, B * Lb, Lb)


class FastDraftBackbone:
    """Built once from a serving (frozen) DSparkModel; the weights are fused copies, so the
    model must not train afterwards. kernels: "c" (a CPU: the C kernels where they build),
    "triton" (CUDA, or Triton's interpreter in tests: the target's Triton attention and
    elementwise kernels), or "auto" (by the model's device)."""

    def __init__(self, model: DSparkModel, kernels: str = "auto") -> None:
        if kernels not in ("auto", "c", "triton"):
            raise ValueError(f"kernels must be auto, c or triton, got {kernels!r}")
        self.triton = kernels == "triton" or (kernels == "auto" and model.device.type == "cuda")
        cfg = model.config
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(self.D)  # SDPA's default, as the modules use
        self.dtype, self.device = model.dtype, model.device
        self.embed = model.embed_tokens
        self.fc = _linear([model.fc.weight], [model.fc.bias])
        self.hidden_norm = FastRMSNorm.of(model.hidden_norm)
        self.norm = FastRMSNorm.of(model.norm)
        self.layers: list[_Layer] = []
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            self.layers.append(_fused_layer(layer, ACTIVATIONS[cfg.hidden_act]))
        self.rope = RotaryTables(model.inv_freq, self.D, self.dtype, self.device)
        self.rope.upto(256)
        # None: forward_block's batched matmuls only (the C kernels are the CPU's)
        self._kernels = None if self.triton else load_kernels()
        # residual add + norm and SwiGLU in one call each (csrc/elementwise.c, or the Triton
        # kernels), as the target's fused layer loop runs them
        self._fused: FusedElementwise | TritonElementwise | None = None
        if self.triton and cfg.hidden_act == "silu":
            self._fused = TritonElementwise(self.H, self.Hkv, self.D)
        elif self._kernels is not None and cfg.hidden_act == "silu":
            self._fused = FusedElementwise(self._kernels)
        self._paged: dict[int, PagedAttention] = {}  # per pool block size
        self._driver: DraftLayers | None = None
        if self._kernels is not None and self._fused is not None and self.dtype == torch.bfloat16:
            self._driver = _layer_driver(self._kernels, self.layers, self.norm, self.H, self.Hkv, self.D)

    def _paged_kernel(self, block_size: int) -> PagedAttention:
        kernel = self._paged.get(block_size)
        if kernel is None:
            assert self._kernels is not None
            kernel = PagedAttention(self._kernels, self.H, self.Hkv, self.D, block_size, layout="slot-major")
            self._paged[block_size] = kernel
        return kernel

    def _norm(self, norm: FastRMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm over x's last dimension (any leading shape, any strides: the q / k heads are
        views into the fused qkv rows): one C call over a packed copy where the kernels built
        (torch's float32 rms_norm on a CPU runs as several kernels, costly for a block's
        heads), else the norm's own path."""
        E = self._fused
        if E is None or x.dtype not in (torch.float32, torch.bfloat16):
            return norm(x)
        rows = x.reshape(-1, x.shape[-1])  # packs a strided view, reuses a contiguous one
        return E.add_rmsnorm(rows, None, norm.w, norm.eps).view(x.shape)

    def _norm_rope(
        self, norm: FastRMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The q / k head norm and the rotary embedding after it. x: [..., n, heads, D] (a view
        into the fused projection's rows); cos, sin from `RotaryTables.at` -> [..., n, heads, D].
        In float32 or bf16 with the C kernels, one pass over the heads (`norm_rope_f32` / `_bf16`)."""
        E = self._fused
        if isinstance(E, FusedElementwise) and x.dtype in (torch.float32, torch.bfloat16):
            nh, D = x.shape[-2:]
            out = E.norm_rope(x.reshape(-1, nh, D), norm.w, norm.eps, cos.reshape(-1, D), sin.reshape(-1, D))
            if out is not None:
                return out.view(x.shape)
        return self.rope.apply(self._norm(norm, x), cos, sin)

    # -- the DSparkModel methods the serving drafter calls ---------------------------------------
    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[n, m*d] taps -> [n, d] context features."""
        return self._norm(self.hidden_norm, self.fc(target_hidden.to(self.dtype)))

    def context_kv(
        self, layer_idx: int, feats: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """feats: [n, d]; positions: [n] -> k, v: [n, Hkv, D]."""
        L, n, nk = self.layers[layer_idx], feats.shape[0], self.Hkv * self.D
        kv = L.kv(feats)
        k = self._norm_rope(L.k_norm, kv[:, :nk].view(n, self.Hkv, self.D), *self.rope.at(positions))
        return k, kv[:, nk:].view(n, self.Hkv, self.D)

    def forward_block(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """block_ids, block_positions: [B, L]; ctx_kv: per layer (k, v) [B, Lc, Hkv, D];
        ctx_mask: [B, Lc] bool -> hidden [B, L, d] (final norm applied)."""
        B, Lb = block_ids.shape
        nq = self.H * self.D
        x = self.embed(block_ids).to(self.dtype)
        # Additive mask over [context keys, block keys]: the block sees itself whole.
        bias = None
        if not bool(ctx_mask.all()):
            bias = torch.zeros(B, 1, 1, ctx_mask.shape[1] + Lb, dtype=self.dtype, device=self.device)
            bias[:, 0, 0, : ctx_mask.shape[1]].masked_fill_(~ctx_mask, float("-inf"))
        cos, sin = self.rope.at(block_positions)  # once for every layer's q and k

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ck, cv = ctx_kv[li]
            k, v = k.view(B, Lb, self.Hkv, self.D), v.view(B, Lb, self.Hkv, self.D)
            # [B, Hkv, Lc + L, D]: one copy of the context, head-major, as the matmuls read it
            keys = torch.cat([ck.transpose(1, 2), k.transpose(1, 2)], dim=2)
            values = torch.cat([cv.transpose(1, 2), v.transpose(1, 2)], dim=2)
            return self._attend(q, keys, values, bias).view(B * Lb, nq)

        return self._layers(x, cos, sin, attend)

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        context: ContextRows | None = None,
        built: bool = False,
    ) -> torch.Tensor:
        """The decoder layers over the block. x: [B, L, d] embedded block (a fresh tensor: it is
        updated in place); cos, sin from `RotaryTables.at`; attend(layer, q [B, L, H, D], k, v
        [R, Hkv, D]) -> [B * L, H * D], R = B * L rows of the block, then context's rows when
        given (their k / v computed here, from their features, at their positions) -> hidden
        [B, L, d] (final norm applied). With the C kernels each residual add runs fused with the
        norm after it, SwiGLU in one call. built: as `RotaryTables.at`'s, for the context's angles."""
        B, Lb, d = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        nq, nk, n = H * D, Hkv * D, B * Lb
        E = self._fused if x.dtype in (torch.float32, torch.bfloat16) else None
        kcos, ksin = cos.reshape(n, 1, D), sin.reshape(n, 1, D)
        if context is not None:  # the context rows' rotary angles, once for every layer
            ccos, csin = self.rope.at(context.positions, built)
            kcos, ksin = torch.cat([kcos, ccos]), torch.cat([ksin, csin])
        h = x.reshape(n, d).contiguous()
        xn = E.add_rmsnorm(h, None, self.layers[0].in_norm.w, self.layers[0].in_norm.eps) if E else None
        for li, L in enumerate(self.layers):
            nxt = self.layers[li + 1].in_norm if li + 1 < len(self.layers) else self.norm
            rows = xn if xn is not None else L.in_norm(h)
            if context is not None:
                rows = torch.cat([rows, context.feats])
            qkv = L.qkv(rows)
            q = self._norm_rope(L.q_norm, qkv[:n, :nq].view(B, Lb, H, D), cos, sin)
            k = self._norm_rope(L.k_norm, qkv[:, nq : nq + nk].view(-1, Hkv, D), kcos, ksin)
            v = qkv[:, nq + nk :].view(-1, Hkv, D)
            o = L.o(attend(li, q, k, v))
            if E is not None:
                xn = E.add_rmsnorm(h, o, L.post_norm.w, L.post_norm.eps)
                xn = E.add_rmsnorm(h, L.down(E.silu_mul(L.gate_up(xn))), nxt.w, nxt.eps)
            else:
                h = h + o
                g, u = L.gate_up(L.post_norm(h)).chunk(2, dim=-1)
                h = h + L.down(L.act(g) * u)
        return (xn if xn is not None else self.norm(h)).view(B, Lb, d)

    @property
    def reads_pools_in_place(self) -> bool:
        """Whether `forward_block_in_place` can run (the Triton attention, or the C one built here)."""
        if self.triton:
            return True
        return (
            self._kernels is not None and self.D <= 256 and paged_attention_supports(self.dtype, self.device)
        )

    def forward_block_in_place(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        slots: Sequence[int],
        starts: Sequence[int],
        context: ContextRows | None = None,
    ) -> torch.Tensor:
        """`forward_block` reading the context K/V where it lies. k_pools / v_pools: per layer
        [num_slots, capacity, Hkv, D] (the drafter's context cache), request b in slot slots[b]
        with its context at positions 0 .. starts[b] - 1 and room for its block after them
        (block_positions[b] = starts[b] + 0 .. L - 1, where its k/v rows are written):
        each layer writes the block's own k/v at positions starts[b] .. (past the context's
        length, which the caller does not move, so they are never taken for context) and the C
        kernel attends every block query to the context and the whole block, no copies.
        context: positions to project into the pools in the same pass (`ContextRows`; the
        caller has counted them into the context already): each layer writes their k / v with
        the block's, before attending.
        -> hidden [B, L, d] (final norm applied)."""
        assert self._kernels is not None or self.triton
        B, Lb = block_ids.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        seg = PoolSegments.of(slots, starts, Lb, k_pools[0].shape[1], context)
        weight = self.embed.weight
        x = weight.index_select(0, block_ids.reshape(-1)).view(B, Lb, weight.shape[1])
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        self.rope.upto(max(starts) + Lb)
        cos, sin = self.rope.at(block_positions, built=True)
        if self.triton:
            flat, varlen = seg.on_device(self.device, B, Lb)
            return self.block_on_device(x, cos, sin, k_pools, v_pools, flat, varlen, context)
        kernel = self._paged_kernel(seg.block_size)
        rows_all = B * Lb + (0 if context is None else context.feats.shape[0])
        if self._driver is not None and rows_all <= self._driver.max_rows:
            return self._layers_in_c(x, cos, sin, k_pools, v_pools, seg, context)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kp, vp = k_pools[li], v_pools[li]
            kp.view(-1, Hkv, D).index_copy_(0, seg.flat, k)
            vp.view(-1, Hkv, D).index_copy_(0, seg.flat, v)
            a = q.new_empty(B * Lb, H, D)
            kernel(q.reshape(B * Lb, H, D), kp, vp, a, *seg.arrays, self.scale, causal=False)
            return a.view(B * Lb, H * D)

        return self._layers(x, cos, sin, attend, context, built=True)

    def block_on_device(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        flat: torch.Tensor,
        varlen: triton_attention.VarlenSegments,
        context: ContextRows | None = None,
    ) -> torch.Tensor:
        """The in-place block pass with the Triton kernels, from inputs already on the device
        (the CUDA-graphed pass, drafter/dspark_model/graphs.py, runs exactly this). x: [B, L, d]
        embedded block (updated in place); cos, sin from `RotaryTables.at`; flat: [R] the pool
        rows (flat over slots x capacity) of the block's k/v, then the context's; varlen: B
        segments of L queries over the pools, read in place (a slot-major pool viewed
        head-major through its strides; one block-table run of `PoolSegments.block_size`
        positions per entry, as for the C kernel) -> hidden [B, L, d] (final norm applied)."""
        B, Lb = x.shape[0], x.shape[1]
        H, Hkv, D = self.H, self.Hkv, self.D
        bs = k_pools[0].shape[1] & -k_pools[0].shape[1]

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kp, vp = k_pools[li].view(-1, Hkv, D), v_pools[li].view(-1, Hkv, D)
            kp.index_copy_(0, flat, k)
            vp.index_copy_(0, flat, v)
            a = q.new_empty(B * Lb, H, D)
            kc, vc = kp.permute(1, 0, 2), vp.permute(1, 0, 2)  # [Hkv, slots, D] views
            triton_attention.paged_attention(
                q.reshape(B * Lb, H, D), kc, vc, a, varlen, bs, self.scale, causal=False
            )
            return a.view(B * Lb, H * D)

        return self._layers(x, cos, sin, attend, context, built=True)

    def _layers_in_c(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        seg: PoolSegments,
        context: ContextRows | None,
    ) -> torch.Tensor:
        """`_layers` with the in-place attention, as one `DraftLayers` call (the same kernels in
        the same order: the same bits)."""
        assert self._driver is not None
        B, Lb, d = x.shape
        n, D = B * Lb, self.D
        h = x.reshape(n, d)  # fresh from the embedding lookup: updated in place
        cos_q, sin_q = cos.reshape(n, D), sin.reshape(n, D)
        if context is None:
            rows = torch.empty(n, d, dtype=x.dtype)
            cos_k, sin_k = cos_q, sin_q
        else:
            rows = torch.cat([h, context.feats])  # rows n.. stay the context's features
            ccos, csin = self.rope.at(context.positions, built=True)
            cos_k, sin_k = torch.cat([cos_q, ccos.reshape(-1, D)]), torch.cat([sin_q, csin.reshape(-1, D)])
        shift = seg.block_size.bit_length() - 1
        self._driver(
            k_pools, v_pools, h, rows, seg.flat, cos_q, sin_q, cos_k, sin_k, seg.arrays, shift, self.scale
        )
        return rows[:n].view(B, Lb, d)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """q: [B, L, H, D]; k, v: [B, Hkv, Lk, D] contiguous; bias: [B, 1, 1, Lk] additive or
        None -> [B, L, H * D]. Query head h reads kv head h // (H / Hkv)."""
        B, Lb, H, D = q.shape
        Hkv, r = self.Hkv, self.H // self.Hkv
        qg = (q * self.scale).view(B, Lb, Hkv, r, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, r * Lb, D)
        s = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, r*L, Lk]
        if bias is not None:
            s = s + bias
        p = torch.softmax(s, dim=-1)  # float32 inside, one rounding out
        o = torch.matmul(p, v)  # [B, Hkv, r*L, D]
        return o.view(B, Hkv, r, Lb, D).permute(0, 3, 1, 2, 4).reshape(B, Lb, H * D)


class GreedyMarkov:
    """All-greedy drafting through a vanilla Markov head on a CPU: the whole block in one C
    call (`markov_greedy_walk`: each position's bias W2 . W1[prev], the argmax, the next prev)
    instead of ~7 small torch ops per position. For a few rows only (`max_rows`), where those
    ops' fixed cost dominates; a larger batch keeps torch's batched ops (one bias matmul for
    all rows per position is cheaper there).

    Each position's bias is one row through the packed small gemm (W2 packed once, in the
    head's dtype: read whole at every position, so bf16 halves its bytes), in float32, added to
    the logits in float32: a bf16 drafter's bias is not rounded to bf16 as torch's bf16 walk
    rounds it. In a near tie the two walks may draft different tokens, and both are proposals
    verification judges alike (greedy verification reads only the drafted tokens)."""

    max_rows = 4

    def __init__(self, lib: ctypes.CDLL, head: MarkovHead, d2t: torch.Tensor | None) -> None:
        self.fn = lib.markov_greedy_walk
        self.w1 = head.markov_w1.weight.detach().contiguous()  # [vocab, r]
        w2 = head.markov_w2.weight.detach()  # [V', r]
        self.w2 = pack_small_gemm(lib, w2)
        self.d2t = None if d2t is None else d2t.detach().long().contiguous()

    @staticmethod
    def applies(head: MarkovHead | None, dtype: torch.dtype, device: torch.device) -> bool:
        return (
            head is not None
            and head.kind == "vanilla"
            and dtype in (torch.float32, torch.bfloat16)
            and head.markov_w1.weight.dtype == head.markov_w2.weight.dtype == dtype
            and head.rank % 2 == 0  # the bf16 gemm takes its inputs in pairs
            and device.type == "cpu"
            and load_kernels() is not None
        )

    def __call__(self, base: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """base: [B, K, V] float32 or bf16 logits; anchor: [B] -> (tokens, prev tokens) [B, K]
        int64 target ids, or None for more than `max_rows` rows."""
        B, K, V = base.shape
        if B > self.max_rows or base.dtype not in (torch.float32, torch.bfloat16):
            return None
        base = base.contiguous()  # read in its dtype (a float32 copy would cost time every block)
        anchor = anchor.long().contiguous()
        tokens = torch.empty(B, K, dtype=torch.long)
        prevs = torch.empty(B, K, dtype=torch.long)
        d2t = 0 if self.d2t is None else self.d2t.data_ptr()
        rc = self.fn(
            base.data_ptr(),
            DTYPE_CODES[base.dtype],
            anchor.data_ptr(),
            self.w1.data_ptr(),
            self.w2.data_ptr(),
            DTYPE_CODES[self.w1.dtype],
            d2t,
            B,
            K,
            V,
            self.w1.shape[1],
            tokens.data_ptr(),
            prevs.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("the greedy Markov walk could not allocate its buffer")
        return tokens, prevs


class FastConfidence:
    """The confidence head's raw logits while serving on a CPU: w_h . h + (W1 w_e)[prev] + b,
    the Markov embedding's share precomputed once for every previous token, so a block costs a
    gather and one small product instead of an embedding lookup, a concatenation and a
    one-output linear. float32 throughout, where the module rounds
    its bf16 output once more. The weights are a snapshot taken at load (a serving model does
    not train); the bias is read from the module at each call."""

    def __init__(self, model: DSparkModel) -> None:
        head = model.confidence_head
        assert head is not None
        d = model.config.hidden_size
        w = head.proj.weight.detach().float()[0]  # [d (+ r)]
        self.w_h = w[:d].contiguous()
        self.bias = head.proj.bias  # [1] or None
        self.per_prev: torch.Tensor | None = None
        if model.config.confidence_uses_markov:
            assert model.markov_head is not None  # the config guarantees it
            self.per_prev = (model.markov_head.markov_w1.weight.detach().float() @ w[d:]).contiguous()

    def __call__(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """hidden: [B, K, d]; prev_tokens: [B, K] -> raw logits [B, K] float32."""
        B, K, d = hidden.shape
        out = torch.mv(hidden.reshape(B * K, d).float(), self.w_h)  # what [B, K, d] @ [d] runs
        if self.bias is not None:
            out += self.bias.detach()  # widened exactly: the same sum as a float32 copy's
        if self.per_prev is not None:
            out += self.per_prev.index_select(0, prev_tokens.reshape(-1))
        return out.view(B, K)


class GreedyTail:
    """An all-greedy block of a few rows, from its final hidden states to its drafts and their
    raw confidence logits, in one C call (`draft_tail_bf16`): the packed draft LM head, the
    Markov head's walk (`GreedyMarkov`'s) and the confidence head (`FastConfidence`'s maths,
    its sum run in C), instead of three Python calls and a dozen torch ops between them, each
    slow right after a kernel has streamed weights through the caches. bf16 only."""

    def __init__(
        self, lib: ctypes.CDLL, head: SmallGemmLinear, walk: GreedyMarkov, confidence: FastConfidence | None
    ) -> None:
        if head.dtype != torch.bfloat16 or head.bias is not None:
            raise ValueError("the greedy tail takes a bf16 LM head without bias")
        self.fn = lib.draft_tail_bf16
        self.head, self.walk, self.confidence = head, walk, confidence

    def __call__(
        self, hidden: torch.Tensor, anchors: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """hidden: [B, K, d] bf16 contiguous; anchors: B target ids -> (tokens, prev tokens)
        [B, K] int64 target ids and raw confidence logits [B, K] float32 (None without a
        confidence head), or None where it does not apply (more rows than the walk or the
        packed head take)."""
        B, K, d = hidden.shape
        w = self.walk
        if B > w.max_rows or B * K > self.head.max_rows or hidden.dtype != torch.bfloat16:
            return None
        anchor = torch.tensor(anchors, dtype=torch.long)
        tokens = torch.empty(B, K, dtype=torch.long)
        prevs = torch.empty(B, K, dtype=torch.long)
        c = self.confidence
        conf = torch.empty(B, K, dtype=torch.float32) if c is not None else None
        per_prev = c.per_prev if c is not None else None
        bias = float(c.bias) if c is not None and c.bias is not None else 0.0
        rc = self.fn(
            hidden.data_ptr(),
            d,
            self.head.packed.data_ptr(),
            self.head.N,
            w.w1.data_ptr(),
            w.w2.data_ptr(),
            DTYPE_CODES[w.w1.dtype],
            0 if w.d2t is None else w.d2t.data_ptr(),
            w.w1.shape[1],
            anchor.data_ptr(),
            B,
            K,
            d,
            0 if c is None else c.w_h.data_ptr(),
            0 if per_prev is None else per_prev.data_ptr(),
            bias,
            tokens.data_ptr(),
            prevs.data_ptr(),
            0 if conf is None else conf.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("the greedy tail could not allocate its buffer")
        return tokens, prevs, conf
