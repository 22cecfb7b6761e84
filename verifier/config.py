"""Configuration of the target model and its KV cache."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KINDS = ("auto", "sdpa", "matmul", "paged", "triton")
LINEAR_KINDS = ("auto", "torch", "mkldnn", "gemm")
WEIGHTS_KINDS = ("auto", "gguf", "q8_0", "bf16", "fp32")


@dataclass(frozen=True)
class ModelConfig:
    """What target to load and where its KV cache lives."""

    model: str | None = None
    """None: the embedded SmolLM2-135M-Instruct; else a HF directory or a .gguf file."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu or cuda."""
    dtype: str = "auto"
    """auto (bfloat16 where the hardware computes it natively: CUDA with bf16, x86 CPUs with
    AVX512-BF16 or AMX; float32 elsewhere), float32, float16 or bfloat16."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) a request may reach."""
    kv_cache_tokens: int = 0
    """Token slots in the paged KV cache; 0 = derive from kv_cache_memory_fraction."""
    kv_cache_memory_fraction: float = 0.1
    """CPU, with kv_cache_tokens 0: the fraction of the RAM the KV cache takes."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the fraction of the device's memory the engine plans to use (weights, activations,
    CUDA graphs, the drafter's pools, and the KV cache and tap rows in what remains; logged as a
    table at start-up, `scheduler/memory_plan.py`)."""
    kv_block_size: int = 16
    """Token slots per KV block."""
    cache_dir: str | None = None
    """Where GGUF conversions are cached; None = the user cache directory."""
    forward: str = "fast"
    """fast (fused weights, vectorised step planning, block-granular KV reads) or reference (the
    original per-module forward, kept as the fallback and the tests' reference)."""
    linear: str = "auto"
    """Matmul kernels of the fast forward: auto (on CPU: the C gemm kernel where it builds,
    oneDNN prepacked weights for bfloat16 without a compiler; torch elsewhere), torch
    (F.linear), mkldnn (CPU only), or gemm (a C kernel streaming weights packed at load: float32
    at every row count, bfloat16 for steps of up to gemm_rows tokens, oneDNN above; CPU only)."""
    gemm_rows: int = 0
    """The most rows (tokens of one forward) a bfloat16 product takes through the C gemm kernel
    before oneDNN's; 0 = by the CPU and the kernels' build: 8 where oneDNN runs on AMX tiles and
    the kernel does not (oneDNN then overtakes it after a handful of rows), else 128
    (bench/gemm_rows.py measures the crossover)."""
    attention: str = "auto"
    """How the fast forward attends: paged (a C kernel, built on first use with the system
    compiler, that reads the paged KV cache in place for every segment, decode, verify and
    prefill chunk alike; float32/bfloat16 on CPU), sdpa (torch's scaled_dot_product_attention),
    matmul (two batched matmuls and a float32 softmax; on CPUs torch's bf16 SDPA kernel is
    several times slower for such short queries), triton (CUDA, the `gpu` extra: one Triton
    kernel a layer for every segment, reading the cache in place; off by default until a GPU
    suite run shows greedy equality with it), or auto (paged on a CPU where it builds; else
    matmul for bf16/fp16 on CPU and sdpa elsewhere). With sdpa and matmul, segments longer than
    32 tokens (prefill chunks) use sdpa over their gathered blocks."""
    cuda_graphs: bool = False
    """Replay decode and verify steps as CUDA graphs, one per bucket of (tokens, requests),
    captured on first use within 60 s (attention triton on CUDA, which auto then means; off by
    default until a GPU suite run shows greedy equality with it)."""
    batch_invariant: bool = False
    """A row's logits the same bits whatever shares its forward: how many requests, which, and
    how many tokens each (decode, a verified block, a prefill chunk, a recompute after
    preemption or a prefix-cache hit). Every product runs the C gemm kernel in one order of
    sums for every row count (no switching between it, AMX tiles and oneDNN by batch size),
    every query row attends alone in one order, and the LM head gives float32 logits, so
    greedy (and seeded) output is the same with and without speculation and batching in bf16
    too. On a CPU the C kernels (float32 on CPUs with AVX2 and FMA is batch-invariant anyway);
    on CUDA the Triton attention in one tile shape and a Triton matmul with fixed tiles and no
    split over K for every product (cuBLAS picks its algorithm by the row count). It costs
    speed on steps of many rows (bench/batch_invariance.py; on GPUs bench/gpu_suite.py)."""
    retain_freed_mib: int = 1024
    """CPU: freed host blocks of up to this many MiB stay with the process for the next step
    (glibc's malloc: its mmap and trim thresholds fixed there) instead of going back to the OS
    and being faulted in again at every step; 0 keeps the allocator's defaults. A step's large
    temporaries (logits, sampling probabilities) would otherwise be mapped and faulted in afresh
    every step (`verifier/host_memory.py`)."""
    weights: str = "auto"
    """What the target's products multiply from. gguf: the GGUF file's own blocks (Q4_0, Q4_1,
    Q8_0), read in place and dequantized in registers against float32 activations, so the model
    is exactly the one published, at 5-8.5 bits a weight read per token instead of 16-32 (CPU;
    a tensor type without a kernel stays in floats, logged); q8_0: every product quantized to
    Q8_0 at load (a model given as a HF directory; CHANGES THE TARGET slightly); bf16 / fp32:
    dense weights in that dtype (as --dtype); auto: gguf on a CPU when the model is a GGUF file
    whose tensors have kernels and the dense weights would be float32 (a CPU without native
    bf16, or --dtype float32), else dense in --dtype's dtype (on CPUs with native bf16 its dot
    products overtake the blocks' float32 arithmetic from a few tokens a step)."""
    quantize: str = "none"
    """none, or int8: weight-only int8 with one scale per output channel (fast forward only).
    int8 CHANGES THE TARGET: outputs follow the quantised model, not the float one. On CPU it pays
    with bfloat16 only (torch's int8 weight kernel is slow with float32 activations)."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.max_model_len < 16:
            raise ValueError(f"max_model_len must be >= 16, got {self.max_model_len!r}")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens must be >= 0, got {self.kv_cache_tokens!r}")
        if not (0.0 < self.kv_cache_memory_fraction <= 0.95):
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction!r}"
            )
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.forward not in ("fast", "reference"):
            raise ValueError(f"forward must be fast or reference, got {self.forward!r}")
        if self.linear not in LINEAR_KINDS:
            raise ValueError(f"linear must be one of {LINEAR_KINDS}, got {self.linear!r}")
        if self.gemm_rows < 0:
            raise ValueError(f"gemm_rows must be >= 0 (0 = by the CPU), got {self.gemm_rows!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.retain_freed_mib < 0:
            raise ValueError(
                f"retain_freed_mib must be >= 0 (0 = the allocator's defaults), got {self.retain_freed_mib!r}"
            )
        if self.cuda_graphs and self.attention not in ("auto", "triton"):
            raise ValueError(f"cuda_graphs needs attention 'triton' (or auto), got {self.attention!r}")
        if self.quantize not in ("none", "int8"):
            raise ValueError(f"quantize must be none or int8, got {self.quantize!r}")
        self._check_weights()
        if self.quantize != "none" and self.forward != "fast":
            raise ValueError(f"quantize {self.quantize!r} needs forward 'fast', got {self.forward!r}")
        if self.batch_invariant and (
            self.forward != "fast"
            or self.quantize != "none"
            or self.linear not in ("auto", "gemm")
            or self.attention not in ("auto", "paged", "triton")
        ):
            raise ValueError(
                "batch_invariant needs forward 'fast', linear auto or gemm, attention auto, paged or "
                f"triton and no quantization, got forward {self.forward!r}, linear {self.linear!r}, "
                f"attention {self.attention!r}, quantize {self.quantize!r}"
            )
        if self.kv_block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"kv_block_size must be a power of two <= 256, got {self.kv_block_size!r}")

    def _check_weights(self) -> None:
        if self.weights not in WEIGHTS_KINDS:
            raise ValueError(f"weights must be one of {WEIGHTS_KINDS}, got {self.weights!r}")
        dense = {"bf16": "bfloat16", "fp32": "float32"}
        if self.weights in dense and self.dtype not in ("auto", dense[self.weights]):
            raise ValueError(f"weights {self.weights!r} contradicts dtype {self.dtype!r}")
        if self.weights in ("gguf", "q8_0"):
            if self.dtype not in ("auto", "float32"):
                raise ValueError(
                    f"weights {self.weights!r} computes with float32 activations; got dtype {self.dtype!r}"
                )
            if self.forward != "fast" or self.quantize != "none":
                raise ValueError(
                    f"weights {self.weights!r} needs forward 'fast' and no quantize, got forward "
                    f"{self.forward!r}, quantize {self.quantize!r}"
                )
