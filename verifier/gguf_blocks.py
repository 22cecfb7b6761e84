"""The target's weights as GGUF blocks: read in place from the model's .gguf file, or made at load
(Q8_0) from a model given in floats, for the fast forward's block-quantized products
(`ops.quant_kernels.QuantLinear`).

Per decoder layer the products are fused as the fast forward runs them: q/k/v stacked into one
matrix, gate/up into another (one copy of those rows; o and down stay views into the file's
memory map), and the LM head is the file's `output.weight`, or `token_embd.weight` where the
embedding is tied. llama.cpp stores a llama model's q and k rows permuted for its rotary layout;
they are put back in the order the model's own rotary expects (a permutation of whole rows, so
the blocks are untouched). A tensor in a block type without a kernel is left to the float path,
with the reason kept for the start-up log. Every matrix is checked against the float weights the
model was loaded with (sampled rows, bit for bit) before it replaces them.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_serve.ops.quant_kernels import BLOCK_TYPES, QuantLinear, QuantMatrix, quantize
from dspark_serve.verifier.forward import ModelParts
from dspark_serve.verifier.gguf_reader import GgufReader

# where each fused product's rows come from, in order (GGUF tensor names per layer)
PRODUCT_TENSORS: dict[str, tuple[str, ...]] = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
# the HF modules holding the same weights
PRODUCT_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
# architectures whose q/k rows llama.cpp's converter permuted
PERMUTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class LayerBlocks:
    """One decoder layer's fused products as blocks; None: that product stays in floats."""

    qkv: QuantMatrix | None
    o: QuantMatrix | None
    gate_up: QuantMatrix | None
    down: QuantMatrix | None

    def get(self, product: str) -> QuantMatrix | None:
        m: QuantMatrix | None = getattr(self, product)
        return m


@dataclass(frozen=True)
class ModelBlocks:
    """The target's block-quantized products, where they came from, and what stayed in floats."""

    layers: list[LayerBlocks]
    head: QuantMatrix | None
    origin: str
    in_floats: tuple[str, ...] = field(default=())

    def matrices(self) -> list[QuantMatrix]:
        ms = [m for lb in self.layers for p in PRODUCT_TENSORS if (m := lb.get(p)) is not None]
        return ms + ([self.head] if self.head is not None else [])

    def describe(self) -> str:
        """e.g. "Q4_1 x120, Q8_0 x1 (96.4 MB) from X.gguf" (+ what stayed in floats)."""
        ms = self.matrices()
        kinds = Counter(m.type for m in ms)
        nbytes = sum(m.blocks.numel() for m in ms)
        text = ", ".join(f"{t} x{n}" for t, n in sorted(kinds.items()))
        floats = f"; in floats: {', '.join(self.in_floats)}" if self.in_floats else ""
        return f"{text} ({nbytes / 1e6:.1f} MB) {self.origin}{floats}"


def rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """The rows of a q or k weight as the model's rotary reads them, from llama.cpp's permuted
    order: within each head, row i of the first half and row i of the second half were stored
    side by side."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def _tensor_matrix(t: Any) -> QuantMatrix:
    """A GGUF tensor's data (a uint8 [N, row bytes] view of the memory map) as a QuantMatrix."""
    with warnings.catch_warnings():  # the map is read-only, and only ever read
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.asarray(t.data))
    return QuantMatrix(blocks, t.tensor_type.name, int(t.shape[0]))


class GgufFile:
    """A .gguf file's tensors by name (memory-mapped) and its architecture. `GgufFile.open` reads
    a file once per process (a start checks it, chooses the weights, builds the model and reads
    the blocks)."""

    @staticmethod
    def open(path: Path) -> GgufFile:
        st = path.stat()
        return _open_gguf(path.resolve(), st.st_size, st.st_mtime_ns)

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GgufReader(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path.name}: not a readable GGUF file ({exc})") from exc
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = str(self.reader.metadata.get("general.architecture", ""))

    def block_type(self, name: str) -> str | None:
        t = self.tensors.get(name)
        return None if t is None else str(t.tensor_type.name)

    def matrix(self, name: str) -> tuple[QuantMatrix | None, str]:
        """The tensor as blocks, or None and why not."""
        t = self.tensors.get(name)
        if t is None:
            return None, f"{name} missing"
        kind = t.tensor_type.name
        if kind not in BLOCK_TYPES:
            return None, f"{name} is {kind} (no kernel)"
        return _tensor_matrix(t), ""


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GgufFile:
    """GgufFile(path), kept while the file's size and modification time stay the same."""
    return GgufFile(path)


def forget_gguf_files() -> None:
    """Drop the files `GgufFile.open` keeps (and their memory maps: the packed products no longer
    read them), once a start is done."""
    _open_gguf.cache_clear()


def _product(
    f: GgufFile, layer: int, product: str, heads: int, kv_heads: int, permuted: bool
) -> tuple[QuantMatrix | None, str]:
    parts = []
    for name in PRODUCT_TENSORS[product]:
        m, why = f.matrix(f"blk.{layer}.{name}.weight")
        if m is None:
            return None, why
        if permuted and name in ("attn_q", "attn_k"):
            m = m.take_rows(rotary_row_order(m.N, heads if name == "attn_q" else kv_heads))
        parts.append(m)
    if len(parts) == 1:
        return parts[0], ""
    fused = QuantMatrix.cat(parts)
    if fused is None:
        kinds = "/".join(p.type for p in parts)
        return None, f"blk.{layer}.{product} mixes block types ({kinds})"
    return fused, ""


def read_gguf_blocks(path: Path, parts: ModelParts) -> ModelBlocks:
    """The products of the model in `path` as its own blocks (see the module's docstring)."""
    f = GgufFile.open(path)
    permuted = f.architecture in PERMUTED_ARCHITECTURES
    layers, in_floats = [], []
    for i in range(parts.num_layers):
        got = {}
        for product in PRODUCT_TENSORS:
            m, why = _product(f, i, product, parts.num_heads, parts.num_kv_heads, permuted)
            got[product] = m
            if m is None:
                in_floats.append(why)
        layers.append(LayerBlocks(**got))
    head_name = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    head, why = f.matrix(head_name)
    if head is None:
        in_floats.append(why)
    blocks = ModelBlocks(layers, head, f"from {path.name}", tuple(in_floats))
    check_blocks(blocks, parts)
    return blocks


def quantize_blocks(parts: ModelParts, type: str = "Q8_0") -> ModelBlocks:
    """Every product (and the LM head) of a model given in floats, quantized once at load."""
    layers = []
    for layer in parts.layers:
        got = {}
        for product, mods in PRODUCT_MODULES.items():
            w = torch.cat([_module(layer, m).weight.detach() for m in mods])
            got[product] = quantize(w, type)
        layers.append(LayerBlocks(**got))
    return ModelBlocks(layers, quantize(parts.lm_head.weight.detach(), type), f"made at load ({type})")


def _module(layer: torch.nn.Module, dotted: str) -> Any:
    mod: Any = layer
    for name in dotted.split("."):
        mod = getattr(mod, name)
    return mod


def float_weight(layer: torch.nn.Module, product: str) -> torch.Tensor:
    """The float weight of a fused product as the model holds it."""
    return torch.cat([_module(layer, m).weight.detach() for m in PRODUCT_MODULES[product]])


def check_blocks(blocks: ModelBlocks, parts: ModelParts, samples: int = 6) -> None:
    """Each matrix against the float weights the model was loaded with (the same file
    dequantized): a few rows each, bit for bit. A mismatch (a tensor mapped to the wrong
    product, rows in another order) is an error naming the product, never a wrong model."""
    gen = torch.Generator().manual_seed(0)

    def check(m: QuantMatrix, w: torch.Tensor, what: str) -> None:
        if tuple(w.shape) != (m.N, m.K):
            raise ValueError(f"{what}: blocks [{m.N}, {m.K}] but the model's weight is {tuple(w.shape)}")
        ids = torch.cat([torch.tensor([0, m.N - 1]), torch.randint(0, m.N, (samples,), generator=gen)])
        if not torch.equal(m.rows(ids), w.index_select(0, ids).to(torch.float32)):
            raise ValueError(f"{what}: the blocks do not dequantize to the model's weights")

    for i, (lb, layer) in enumerate(zip(blocks.layers, parts.layers)):
        for product in PRODUCT_TENSORS:
            m = lb.get(product)
            if m is not None:
                check(m, float_weight(layer, product), f"layer {i} {product}")
    if blocks.head is not None:
        check(blocks.head, parts.lm_head.weight.detach(), "LM head")


class BlockLinear(torch.nn.Module):
    """A model's linear layer computed from GGUF blocks, standing in the HF module tree for the
    float one it replaced: the model's own forward (transformers' generate, a reference forward
    in a test) still runs, on the same blocks and kernel as the engine. It runs its product's
    fused matrix (shared with the fast forward: no copy) and keeps its rows' columns. `weight` is
    a meta tensor of the layer's shape: its size is readable, its data is not."""

    def __init__(self, fused: QuantLinear, rows: slice, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.fused, self.rows = fused, rows
        self.in_features, self.out_features = fused.K, rows.stop - rows.start
        self.weight = torch.empty(self.out_features, self.in_features, device="meta")
        self.bias = None if bias is None else bias.detach().to(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fused(x.reshape(-1, self.in_features))[:, self.rows]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def release_float_weights(parts: ModelParts, products: Sequence[dict[str, QuantLinear]]) -> int:
    """Replace each float linear module whose product is served from blocks (`products`: per
    layer, the fast forward's block linears by product) with a BlockLinear over its rows ->
    bytes of float weights released. The LM head's stays: the drafter shares it."""
    freed = 0
    for served, layer in zip(products, parts.layers):
        for product, lin in served.items():
            row = 0
            for name in PRODUCT_MODULES[product]:
                mod = _module(layer, name)
                n = mod.weight.shape[0]
                freed += mod.weight.numel() * mod.weight.element_size()
                owner, attr = name.rsplit(".", 1)
                setattr(_module(layer, owner), attr, BlockLinear(lin, slice(row, row + n), mod.bias))
                row += n
    return freed
