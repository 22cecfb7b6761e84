"""The fast forward: the same maths as the reference forward, with fewer and larger kernels and
almost no Python per token. Its weights (`fast_weights.py`), its step plan (`fast_plan.py`) and
its attention (`attention.py`) are built once; a step is the plan, the layer loop and the logits.

On a CPU with the C kernels (bf16 or float32) the layer loop runs them: rotary with the K/V
write, the residual adds with their norms, SwiGLU, the paged attention, and where every product
is the packed gemm the whole loop is one C call. Greedy equality with the reference forward in
float32 is what the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dspark_serve.ops import cpu_kernels, triton_attention
from dspark_serve.ops import linear as ops_linear
from dspark_serve.ops.cpu_kernels import FusedElementwise, PagedAttention, RopeStore, TargetLayers
from dspark_serve.ops.triton_attention import TritonElementwise
from dspark_serve.verifier.attention import CacheAttention
from dspark_serve.verifier.config import ATTENTION_KINDS, LINEAR_KINDS
from dspark_serve.verifier.fast_plan import FastPlan, FastPlanner
from dspark_serve.verifier.fast_weights import FastWeights, RopeTable
from dspark_serve.verifier.forward import ForwardOutput, ModelParts, Segment
from dspark_serve.verifier.gguf_blocks import ModelBlocks
from dspark_serve.verifier.kv_cache import KVCache


def resolve_attention(
    attention: str, parts: ModelParts, block_size: int, invariant: bool = False
) -> tuple[str, PagedAttention | None]:
    """auto: the paged C kernel on a CPU (float32/bfloat16) where it builds; else matmul for
    bf16/fp16 on CPU and sdpa elsewhere. "paged" asked for where it cannot run is an error.
    invariant: the paged kernel in its batch-invariant order, which must then run."""
    if invariant and attention == "auto":  # the kernels whose orders of sums are fixed
        attention = "triton" if parts.device.type == "cuda" else "paged"
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    if attention == "triton":
        on_cuda = parts.device.type == "cuda" and not triton_attention.interpreted()
        on_interpreter = parts.device.type == "cpu" and triton_attention.interpreted()
        if not (triton_attention.available() and (on_cuda or on_interpreter)):
            raise ValueError(
                f"attention 'triton' needs Triton (the gpu extra) and a CUDA device, got "
                f"{parts.device} ({'Triton found' if triton_attention.available() else 'no Triton'}"
                f"{', interpreter on' if triton_attention.interpreted() else ''})"
            )
        return attention, None
    pow2 = block_size & (block_size - 1) == 0  # the kernel walks blocks by shifts
    fits = parts.head_dim <= 256  # its per-row buffers
    if (
        attention in ("auto", "paged")
        and pow2
        and fits
        and cpu_kernels.paged_attention_supports(parts.dtype, parts.device)
    ):
        lib = cpu_kernels.load_kernels()
        if lib is not None:
            return "paged", PagedAttention(
                lib, parts.num_heads, parts.num_kv_heads, parts.head_dim, block_size, invariant=invariant
            )
    if attention == "paged":
        raise ValueError(
            f"attention 'paged'{' (batch-invariant)' if invariant else ''} needs the fast forward "
            f"with float32/bfloat16 on a CPU, a "
            f"power-of-two block size, head_dim <= 256 and a C compiler; got "
            f"{parts.dtype} on {parts.device}, block size {block_size}, head_dim "
            f"{parts.head_dim} ({cpu_kernels.find_compiler() or 'no compiler'})"
        )
    if attention == "auto":
        reduced = parts.dtype in (torch.bfloat16, torch.float16)
        attention = "matmul" if parts.device.type == "cpu" and reduced else "sdpa"
    return attention, None


class FastForward:
    def __init__(
        self,
        parts: ModelParts,
        kv: KVCache,
        linear: str = "auto",
        quantize: str = "none",
        attention: str = "auto",
        gemm_rows: int = 0,
        batch_invariant: bool = False,
        blocks: ModelBlocks | None = None,
    ) -> None:
        """blocks: the products that multiply from GGUF blocks (float32 activations, CPU)."""
        if linear not in LINEAR_KINDS:
            raise ValueError(f"linear must be one of {LINEAR_KINDS}, got {linear!r}")
        if linear == "mkldnn" and not ops_linear.mkldnn_linear_works(parts.dtype, parts.device):
            raise ValueError("linear 'mkldnn' needs float32/bfloat16 weights on a CPU with oneDNN")
        self.parts, self.kv, self.quantize = parts, kv, quantize
        self.batch_invariant = batch_invariant
        self.attention, paged = resolve_attention(attention, parts, kv.block_size, batch_invariant)
        self.attend = CacheAttention(
            self.attention, kv, parts.num_heads, parts.scaling, paged, batch_invariant
        )
        # With the paged kernel (bf16 or float32): rotary and the K/V write fused too, and the
        # residual adds with their norms and SwiGLU (csrc/elementwise.c).
        self.rope_store: RopeStore | TritonElementwise | None = None
        self.fused: FusedElementwise | TritonElementwise | None = None
        lib = cpu_kernels.load_kernels() if paged is not None else None
        if lib is not None and parts.dtype in (torch.bfloat16, torch.float32) and parts.head_dim <= 256:
            self.rope_store = RopeStore(lib, parts.num_heads, parts.num_kv_heads, parts.head_dim)
            self.fused = FusedElementwise(lib)
        D = parts.head_dim
        if self.attention == "triton" and D & (D - 1) == 0:  # the same steps as Triton kernels
            self.fused = self.rope_store = TritonElementwise(parts.num_heads, parts.num_kv_heads, D)
        # a batch-invariant forward's products: the C gemm beside the C attention, a Triton
        # matmul beside the Triton one
        invariant = ("triton" if self.attention == "triton" else "c") if batch_invariant else None
        if blocks is not None and (parts.device.type != "cpu" or parts.dtype != torch.float32):
            raise ValueError(
                f"GGUF blocks run with float32 activations on a CPU, got {parts.dtype} on {parts.device}"
            )
        self.blocks_text = None if blocks is None else blocks.describe()
        self.weights = FastWeights(parts, linear, quantize, gemm_rows, invariant, blocks)
        self.rope = RopeTable(parts)
        self.plan = FastPlanner(self.attention, kv.block_size, self.rope, parts.dtype)
        self.target_driver: TargetLayers | None = None
        if self.fused is not None and self.rope_store is not None and paged is not None:
            self.target_driver = self.weights.target_driver(parts, kv.block_size, batch_invariant)

    @property
    def paged_attention(self) -> PagedAttention | None:
        return self.attend.paged

    def describe(self) -> str:
        """Which forward runs and how it multiplies."""
        w = self.weights
        q = "" if self.quantize == "none" else f", weights {self.quantize}"
        if self.blocks_text is not None:
            q += f", weights {self.blocks_text}"
        fused = ", fused elementwise" if self.fused is not None else ""
        rows = "" if w.gemm_max_rows is None else f" up to {w.gemm_max_rows} rows, oneDNN above"
        inv = ", batch-invariant" if self.batch_invariant else ""
        return f"fast (linear {w.linear_kind}{rows}, attention {self.attention}{fused}{q}{inv})"

    def uses_c_kernels(self) -> bool:
        return (
            self.paged_attention is not None
            or self.weights.linear_kind == "gemm"
            or self.blocks_text is not None
            or isinstance(self.fused, FusedElementwise)
        )

    @torch.inference_mode()
    def __call__(self, segments: Sequence[Segment], tap_layers: tuple[int, ...] = ()) -> ForwardOutput:
        plan = self.plan(segments)
        h = self.parts.embed(plan.ids)
        drv = self.target_driver
        if (
            drv is not None
            and plan.p_segments is not None
            and plan.ids.numel() <= drv.max_rows
            and h.dtype == drv.dtype
            and len(set(tap_layers)) == len(tap_layers)
        ):
            # the fused loop below in one C call: same kernels, same order, bit for bit
            cos, sin = plan.cos[:, 0].contiguous(), plan.sin[:, 0].contiguous()
            args = (self.kv.k, self.kv.v, cos, sin, plan.slots, plan.p_segments, self.parts.scaling)
            x, hidden = drv(h.contiguous(), *args, tap_layers)
            return self._output(x, hidden, plan)
        return self._output(*self.layers(h, plan, tap_layers), plan)

    def layers(
        self, h: torch.Tensor, plan: FastPlan, tap_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers, fused where the kernels are (C on a CPU, Triton on CUDA), on
        torch's kernels otherwise -> the final-normed hidden states and the taps."""
        if self.fused is not None and self.rope_store is not None:
            return self._layers_fused(h, plan, tap_layers)
        return self._layers_torch(h, plan, tap_layers)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.roll(x, self.parts.head_dim // 2, dims=-1) * sin

    def _layers_torch(
        self, h: torch.Tensor, plan: FastPlan, tap_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers on torch's kernels -> the final-normed hidden states and the taps."""
        P = self.parts
        T, H, Hkv, D = h.shape[0], P.num_heads, P.num_kv_heads, P.head_dim
        nq, nk = H * D, Hkv * D
        taps: dict[int, torch.Tensor] = {-1: h} if -1 in tap_layers else {}
        last = P.num_layers - 1
        for li, L in enumerate(self.weights.layers):
            qkv = L.qkv(L.in_norm(h))
            if L.q_norm is not None and L.k_norm is not None:
                q = self._rope(L.q_norm(qkv[:, :nq].view(T, H, D)), plan.cos, plan.sin)
                k = self._rope(L.k_norm(qkv[:, nq : nq + nk].view(T, Hkv, D)), plan.cos, plan.sin)
            else:
                qk = self._rope(qkv[:, : nq + nk].view(T, H + Hkv, D), plan.cos, plan.sin)
                q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, nq + nk :].view(T, Hkv, D)
            h = h + L.o(self.attend(li, q, k, v, plan))
            g, u = L.gate_up(L.post_norm(h)).chunk(2, dim=-1)
            h = h + L.down(F.silu(g) * u)
            if li in tap_layers and li != last:
                taps[li] = h
        h = self.weights.norm(h)
        if last in tap_layers:
            taps[last] = h
        return h, torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None

    def _layers_fused(
        self, h: torch.Tensor, plan: FastPlan, tap_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers on fused kernels (C on a CPU, bf16 or float32; Triton): each residual add is
        fused with the norm after it (h is updated in place, so taps take copies), rotary with the K/V
        write, SwiGLU into one call. -> the final-normed hidden states [T, d] and the tap states
        [T, len(tap_layers) * d] (None without tap layers), each copied once into its columns
        (a prefill chunk's taps are large: no clone-then-concatenate)."""
        assert self.fused is not None and self.rope_store is not None
        P, E, layers = self.parts, self.fused, self.weights.layers
        T, H, Hkv, D = h.shape[0], P.num_heads, P.num_kv_heads, P.head_dim
        nq, nk = H * D, Hkv * D
        h = h.contiguous()
        d = h.shape[1]
        hidden = h.new_empty(T, len(tap_layers) * d) if tap_layers else None

        def tap(layer: int, state: torch.Tensor) -> None:
            for j, t in enumerate(tap_layers):
                if t == layer and hidden is not None:
                    hidden[:, j * d : (j + 1) * d].copy_(state)

        tap(-1, h)
        last = P.num_layers - 1
        x = E.add_rmsnorm(h, None, layers[0].in_norm.w, layers[0].in_norm.eps)
        for li, L in enumerate(layers):
            qkv = L.qkv(x)
            q, k = qkv[:, :nq].view(T, H, D), qkv[:, nq : nq + nk].view(T, Hkv, D)
            if L.q_norm is not None and L.k_norm is not None:
                q, k = L.q_norm(q), L.k_norm(k)
            v = qkv[:, nq + nk :].view(T, Hkv, D)
            self.rope_store(q, k, v, plan.cos, plan.sin, plan.slots, self.kv.k[li], self.kv.v[li])
            x = E.add_rmsnorm(h, L.o(self.attend(li, q, None, None, plan)), L.post_norm.w, L.post_norm.eps)
            after = layers[li + 1].in_norm if li < last else self.weights.norm
            x = E.add_rmsnorm(h, L.down(E.silu_mul(L.gate_up(x))), after.w, after.eps)
            if li != last:
                tap(li, h)
        tap(last, x)
        return x, hidden

    def _output(self, h: torch.Tensor, hidden: torch.Tensor | None, plan: FastPlan) -> ForwardOutput:
        """Logits of the rows that need them, from the final-normed h, beside the tap states."""
        if plan.logit_rows is not None:
            # decode: every row; index_select, not h[rows] (torch's CPU advanced indexing is slow)
            rows = h if plan.logit_rows.numel() == h.shape[0] else h.index_select(0, plan.logit_rows)
            # in the model's dtype: a greedy step needs only each row's argmax, and widening
            # every verify row to float32 would cost a pass over [rows, V] for nothing; a
            # batch-invariant forward's LM head sums into float32 logits (fewer near-ties)
            logits = self.weights.lm_head(rows)
        else:
            logits = h.new_zeros(0, self.parts.vocab_size)
        return ForwardOutput(logits, plan.logits_offsets, hidden, plan.token_offsets, plan.slots)
