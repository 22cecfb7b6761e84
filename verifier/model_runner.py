"""The target runner: the model's parts, the paged KV cache's memory and the forward that runs
over them (fast or reference, one object behind one interface, `verifier/forward.py`).

Llama, Qwen2 and Qwen3 share one decoder shape (pre-norm attention + SwiGLU MLP); Qwen3 adds a
per-head RMSNorm on q and k, Qwen2 adds q/k/v biases (inside its Linear layers). The HF modules'
weights and projections are reused; attention and the cache are replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from dspark_serve.ops.cpu_kernels import kernels_key
from dspark_serve.verifier.cuda_graphs import CudaCapture, EagerReplay, GraphedForward
from dspark_serve.verifier.forward import Forward, ForwardOutput, ModelParts, Segment
from dspark_serve.verifier.forward_fast import FastForward
from dspark_serve.verifier.forward_reference import ReferenceForward
from dspark_serve.verifier.gguf_blocks import ModelBlocks, release_float_weights
from dspark_serve.verifier.kv_cache import KVCache

__all__ = ["ForwardOutput", "ModelRunner", "Segment"]

# forward name -> how it is built from (parts, kv cache, linear, quantize, attention, gemm_rows,
# batch_invariant, GGUF blocks)
FORWARDS: dict[
    str, Callable[[ModelParts, KVCache, str, str, str, int, bool, ModelBlocks | None], Forward]
] = {
    "fast": FastForward,
    "reference": lambda parts, kv, *_: ReferenceForward(parts, kv),
}


def _check_options(
    model: torch.nn.Module, impl: str, quantize: str, cuda_graphs: bool, batch_invariant: bool
) -> None:
    if impl not in FORWARDS:
        raise ValueError(f"impl must be one of {sorted(FORWARDS)}, got {impl!r}")
    if batch_invariant and impl != "fast":
        raise ValueError(f"batch_invariant needs impl='fast', got {impl!r}")
    if quantize not in ("none", "int8"):
        raise ValueError(f"quantize must be none or int8, got {quantize!r}")
    if quantize != "none" and impl != "fast":
        raise ValueError(f"quantize {quantize!r} needs impl='fast', got {impl!r}")
    if quantize != "none" and next(model.parameters()).device.type == "cuda":
        raise ValueError(
            f"quantize {quantize!r} is for CPUs: on CUDA its weights would be dequantised on "
            f"every call; serve the model in bfloat16 there"
        )
    if cuda_graphs and impl != "fast":
        raise ValueError(f"cuda_graphs needs impl='fast', got {impl!r}")


class ModelRunner:
    """Runs a HF causal LM (Llama/Qwen2/Qwen3) over a paged KV cache whose memory it holds."""

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
        cuda_graphs: bool = False,
        max_model_len: int = 2048,
        batch_invariant: bool = False,
        blocks: ModelBlocks | None = None,
    ) -> None:
        """impl: a forward of FORWARDS: "fast" (fused weights, vectorised planning, block-granular
        KV reads) or "reference" (the original per-module forward). linear: how the fast path
        multiplies (`ops.linear.make_linear`). quantize: "none" or "int8" (weight-only, per output
        channel; changes the target's numerics). attention: how the fast path attends (auto,
        sdpa, matmul or paged; see ModelConfig.attention). gemm_rows: the most rows a bf16 product
        takes through the C gemm kernel (0: by the CPU; see ModelConfig.gemm_rows). cuda_graphs:
        decode and verify steps replay CUDA graphs (`verifier/cuda_graphs.py`; the fast forward
        with attention "triton"), sized for sequences of up to max_model_len. batch_invariant: a
        row's logits do not depend on what shares its forward (see ModelConfig.batch_invariant).
        blocks: products served from GGUF blocks (`verifier/gguf_blocks.py`; the fast forward on
        a CPU in float32); their float weights are released once the forward holds the blocks."""
        _check_options(model, impl, quantize, cuda_graphs, batch_invariant)
        if blocks is not None and (impl != "fast" or quantize != "none"):
            raise ValueError(f"GGUF blocks need impl='fast' without quantize, got {impl!r}, {quantize!r}")
        self.impl = impl
        self.model = model
        self.parts = P = ModelParts.of(model)
        self.config = P.config
        self.embed = P.embed
        self.device, self.dtype = P.device, P.dtype
        self.num_layers, self.hidden_size, self.vocab_size = P.num_layers, P.hidden_size, P.vocab_size
        if cuda_graphs and attention == "auto":  # graphs replay the Triton attention
            attention = "triton"
        geometry = (P.num_layers, P.num_kv_heads, P.head_dim, num_blocks, block_size, P.device, P.dtype)
        self.kv = KVCache(*geometry, scratch_block=cuda_graphs)
        self.block_size = block_size
        forward = FORWARDS[impl]
        self.forward_impl: Forward = forward(
            P, self.kv, linear, quantize, attention, gemm_rows, batch_invariant, blocks
        )
        self.released_bytes = self._release_floats() if blocks is not None else 0
        if cuda_graphs:
            assert isinstance(self.forward_impl, FastForward)
            capture = CudaCapture() if P.device.type == "cuda" else EagerReplay()
            self.forward_impl = GraphedForward(self.forward_impl, max_model_len, capture)

    def _release_floats(self) -> int:
        """The float weights of the products the forward serves from blocks, released -> bytes."""
        assert isinstance(self.forward_impl, FastForward)
        return release_float_weights(self.parts, self.forward_impl.weights.block_products())

    def describe(self) -> str:
        """One line for logs and benchmarks: which forward runs and how it multiplies."""
        return self.forward_impl.describe()

    def cost_signature(self) -> str:
        """describe() plus the C kernels' build key where the forward runs them: a cost table
        measured with other kernel code (an older build of the same kinds) is not reused."""
        key = kernels_key() if self.forward_impl.uses_c_kernels() else None
        return self.describe() + (f" [kernels {key}]" if key else "")

    def copy_kv_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (a fork's partial block, `BlockManager.fork`)."""
        self.kv.copy_block(src, dst)

    def forward(self, segments: Sequence[Segment], tap_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Forward the new tokens of all segments; each segment's block table already covers
        its new positions (the scheduler reserved them, so a failed allocation never leaves
        half a forward)."""
        with self.attention_backends():
            return self.forward_impl(segments, tap_layers)

    def attention_backends(self) -> contextlib.AbstractContextManager[object]:
        """Where torch's SDPA may run: on CUDA, anything but its cuDNN backend. cuDNN builds an
        execution plan per new input shape, and in serving the shapes change every step (every
        request's context grows), so it would plan almost every step; the flash,
        memory-efficient and math kernels need no plan. The engine enters this around a whole
        step, so the drafter's attention follows the same rule."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    kv_bytes_per_token = staticmethod(KVCache.bytes_per_token)
