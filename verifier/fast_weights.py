"""The fast forward's weights, built once at load.

q/k/v are fused into one [(H + 2 Hkv) D, d] matrix and gate/up into one [2 I, d] matrix (the HF
modules keep views into them, so no memory is duplicated); every product goes through
`ops.linear.make_linear` (oneDNN prepacked weights, the C gemm kernel, or int8); rotary reads a
cos/sin table built once; where every kernel of the layer loop is a C one, the whole loop is one
C call (`ops.cpu_kernels.TargetLayers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dspark_serve.ops import cpu_kernels
from dspark_serve.ops.cpu_kernels import SmallGemmLinear, TargetLayers, TargetLayerWeights
from dspark_serve.ops.linear import FastRMSNorm, Linear, make_linear
from dspark_serve.ops.quant_kernels import QuantLinear
from dspark_serve.ops.triton_linear import InvariantTritonLinear
from dspark_serve.verifier.forward import ModelParts
from dspark_serve.verifier.gguf_blocks import LayerBlocks, ModelBlocks


@dataclass
class FastLayer:
    in_norm: FastRMSNorm
    post_norm: FastRMSNorm
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: FastRMSNorm | None
    k_norm: FastRMSNorm | None


def _fuse(
    layer: Any, parts: ModelParts, quantize: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One layer's fused q/k/v weight and bias and gate/up weight; without quantization the HF
    modules are pointed at views into them (no second copy in memory)."""
    a, m = layer.self_attn, layer.mlp
    with torch.no_grad():
        wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
        bqkv = None
        if a.q_proj.bias is not None:
            bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).contiguous()
        wgu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous()
        if quantize == "none":
            nq, nk = parts.num_heads * parts.head_dim, parts.num_kv_heads * parts.head_dim
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
    return wqkv, bqkv, wgu


def _layer(
    layer: Any,
    parts: ModelParts,
    lb: LayerBlocks,
    quantize: str,
    lin: Callable[[torch.Tensor, torch.Tensor | None], Linear],
) -> FastLayer:
    """One decoder layer's products: from its blocks where `lb` has them, else `lin` over the
    fused float weights."""
    a, m = layer.self_attn, layer.mlp
    if lb.qkv is not None and lb.gate_up is not None:  # the fused float weights are not needed
        wqkv = wgu = bqkv = None
        if a.q_proj.bias is not None:
            bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
    else:
        wqkv, bqkv, wgu = _fuse(layer, parts, quantize)

    def product(block: str, w: torch.Tensor | None, b: torch.Tensor | None) -> Linear:
        mat = lb.get(block)
        if mat is not None:
            return QuantLinear(mat, b)
        assert w is not None
        return lin(w, b)

    return FastLayer(
        in_norm=FastRMSNorm.of(layer.input_layernorm),
        post_norm=FastRMSNorm.of(layer.post_attention_layernorm),
        qkv=product("qkv", wqkv, bqkv),
        o=product("o", a.o_proj.weight, a.o_proj.bias),
        gate_up=product("gate_up", wgu, None),
        down=product("down", m.down_proj.weight, m.down_proj.bias),
        q_norm=FastRMSNorm.of(a.q_norm) if parts.has_qk_norm else None,
        k_norm=FastRMSNorm.of(a.k_norm) if parts.has_qk_norm else None,
    )


class FastWeights:
    """The decoder layers' fused weights and products, the LM head and the final norm."""

    def __init__(
        self,
        parts: ModelParts,
        linear: str,
        quantize: str,
        gemm_rows: int = 0,
        invariant: str | None = None,
        blocks: ModelBlocks | None = None,
    ) -> None:
        """invariant: every product batch-invariant, through the C gemm ("c", `make_linear`) or a
        Triton matmul ("triton", `InvariantTritonLinear`), the LM head's logits float32; None:
        the products `linear` picks. blocks: the products (and LM head) that multiply from GGUF
        blocks (`QuantLinear`, batch-invariant by construction); the rest as above."""
        if invariant not in (None, "c", "triton"):
            raise ValueError(f"invariant must be None, 'c' or 'triton', got {invariant!r}")
        self.layers: list[FastLayer] = []
        kinds: set[str] = set()

        def lin(w: torch.Tensor, b: torch.Tensor | None, float_out: bool = False) -> Linear:
            if invariant == "triton":
                if quantize != "none":
                    raise ValueError(f"a batch-invariant forward takes no quantization, got {quantize!r}")
                return InvariantTritonLinear(w, b, float_out)
            return make_linear(w, b, linear, quantize, gemm_rows, invariant == "c", float_out)

        for i, layer in enumerate(parts.layers):
            lb = blocks.layers[i] if blocks is not None else LayerBlocks(None, None, None, None)
            fl = _layer(layer, parts, lb, quantize, lin)
            kinds.update(p.kind for p in (fl.qkv, fl.o, fl.gate_up, fl.down))
            self.layers.append(fl)
        # The LM head stays as is (tied to the embedding the drafter shares); prepacking helps it too.
        head = parts.lm_head
        if blocks is not None and blocks.head is not None:
            self.lm_head: Linear = QuantLinear(blocks.head, head.bias)
        elif invariant is None:
            self.lm_head = make_linear(head.weight, head.bias, linear, "none", gemm_rows)
        else:
            self.lm_head = lin(head.weight, head.bias, float_out=True)
        self.norm = FastRMSNorm.of(parts.norm)
        self.linear_kind = "/".join(sorted(kinds))
        # bf16 products of more rows than this leave the C kernel for oneDNN (None: no such limit)
        rows = getattr(self.layers[0].qkv, "max_rows", None) if self.layers else None
        self.gemm_max_rows: int | None = rows if rows is not None and rows < 1 << 30 else None

    def products(self) -> list[Linear]:
        return [lin for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down)]

    def block_products(self) -> list[dict[str, QuantLinear]]:
        """Per layer, the products served from GGUF blocks, by name (qkv, o, gate_up, down)."""
        names = ("qkv", "o", "gate_up", "down")
        return [
            {n: p for n, p in zip(names, (L.qkv, L.o, L.gate_up, L.down)) if isinstance(p, QuantLinear)}
            for L in self.layers
        ]

    def target_driver(
        self, parts: ModelParts, block_size: int, invariant: bool = False
    ) -> TargetLayers | None:
        """The decoder layers in one C call where every product is the packed gemm and the layer
        has no q/k head norms (the caller checks the attention and elementwise kernels)."""
        lib = cpu_kernels.load_kernels()
        if lib is None or parts.has_qk_norm:
            return None
        if not all(isinstance(lin, (SmallGemmLinear, QuantLinear)) for lin in self.products()):
            return None
        layers = self.layers
        weights = [
            TargetLayerWeights(
                L.qkv,  # type: ignore[arg-type]
                L.o,  # type: ignore[arg-type]
                L.gate_up,  # type: ignore[arg-type]
                L.down,  # type: ignore[arg-type]
                (L.post_norm.w, L.post_norm.eps),
                (nxt.w, nxt.eps),
            )
            for L, nxt in zip(layers, [L.in_norm for L in layers[1:]] + [self.norm])
        ]
        first = (layers[0].in_norm.w, layers[0].in_norm.eps)
        geometry = (parts.num_heads, parts.num_kv_heads, parts.head_dim, block_size)
        try:
            return TargetLayers(lib, weights, first, *geometry, invariant=invariant)
        except ValueError:  # a layout it does not take (a bias on gate_up, norms of another dtype)
            return None


class RopeTable:
    """cos and signed sin rows by position (rotate_half(x) * sin == roll(x) * signed sin), grown
    by doubling; rotary embeddings whose angles depend on the length ("dynamic") are computed
    per step instead."""

    def __init__(self, parts: ModelParts) -> None:
        self.parts = parts
        self.dynamic = "dynamic" in str(getattr(parts.rotary, "rope_type", ""))
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.ensure(min(4096, getattr(parts.config, "max_position_embeddings", 4096) or 4096))

    def _compute(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        P = self.parts
        cos, sin = P.rotary(torch.empty(1, device=P.device, dtype=P.dtype), pos[None])
        sin = sin[0].clone()
        sin[:, : P.head_dim // 2] *= -1
        return cos[0].contiguous(), sin.contiguous()

    def ensure(self, n: int) -> None:
        if self.cos is not None and self.cos.shape[0] >= n:
            return
        size = max(n, 2 * (0 if self.cos is None else self.cos.shape[0]))
        self.cos, self.sin = self._compute(torch.arange(size, device=self.parts.device))

    def rows(self, pos: torch.Tensor, max_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D] cos and signed sin of positions `pos` (host tensor), all below max_end."""
        pd = pos.to(self.parts.device)
        if self.dynamic:
            return self._compute(pd)
        self.ensure(max_end)
        assert self.cos is not None and self.sin is not None
        return self.cos[pd], self.sin[pd]
