"""Small C kernels for the CPU forward, built on first use with the system C compiler.

- `paged_attention` (csrc/paged_attention.c) attends short decode/verify segments straight from
  the paged KV cache: no per-layer gather of each request's context, no padded mask tensors,
  one call per layer.
- `small_gemm` (csrc/small_gemm.c) multiplies a few bfloat16 (or float32) rows by weights
  packed once at load, streaming every weight byte once per call (decode and short verify
  steps).
- `rope_store`, `add_rmsnorm`, `silu_mul` fuse a layer's small elementwise steps (rotary with
  the K/V write, the residual add with the next norm, SwiGLU), one call each, for bf16 and
  float32 rows.
- `draft_layers_bf16` (csrc/draft_layers.c) runs the drafter's decoder layers over a block as
  one call of the kernels above (`DraftLayers`), without a Python dispatch per kernel, and
  `draft_tail_bf16` an all-greedy block's LM head, Markov walk and confidence logits
  (`drafter.dspark_model.fast.GreedyTail`).

All are compiled once per machine into one library (-O3 -march=native, OpenMP) in the user
cache directory and called through ctypes, so they need no torch headers and build in about a
second. Where no compiler is found or the build fails, `load_kernels()` returns None and the
forward keeps torch's kernels: the kernels are an accelerator, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dspark_serve.ops.platform import cpu_flags, cpu_model, default_cache_dir, emulated_level, level_of

log = logging.getLogger(__name__)

# A linear layer as the gemm wrapper sees its fallback: [N, in] -> [N, out].
LinearFn = Callable[[torch.Tensor], torch.Tensor]

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention.c",
        "quant_panels_q4_0.c",
        "quant_panels_q4_1.c",
        "quant_panels_q8_0.c",
        "elementwise.c",
        "small_gemm.c",
        "quant_gemm.c",
        "draft_layers.c",
        "target_layers.c",
    )
)
HEADERS = (CSRC / "amx.h", CSRC / "common.h", CSRC / "kernels.h")  # and quant_gemm.c, in SOURCES
# -fassociative-math and friends let the compiler vectorise the float32 dot products and sums
# (a fixed, deterministic order per build); no -ffinite-math-only: masked scores stay exact.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-ffp-contract=fast",
)
# Flags of small_gemm_ex and paged_attention_ex (csrc/kernels.h).
GEMM_INVARIANT, GEMM_F32_OUT, ATTN_INVARIANT = 1, 2, 1
# The dtype code every kernel takes (its `dtype` argument).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_loaded: dict[str, ctypes.CDLL | None] = {}


def find_compiler() -> str | None:
    """The system C compiler (cc, gcc or clang on PATH), or None."""
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def build_flags() -> tuple[str, ...]:
    """CFLAGS, narrowed to the CPU level this process runs as (`platform.emulated_level`)."""
    level = emulated_level()
    return CFLAGS + (level.cflags if level is not None else ())


def _build(compiler: str, out: Path) -> None:
    """Compile each source to an object, as many at once as there are cores, in SOURCES' order
    (the slowest first: the attention and the quantized gemm's block types take most of the
    time), then link. A start reads the model meanwhile: no more compilers than cores, so it
    keeps its share of them."""
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = [f for f in build_flags() if f != "-shared"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = {src: Path(tmp) / f"{src.stem}.o" for src in SOURCES}

        def compile_one(src: Path) -> str | None:
            proc = subprocess.run(
                [compiler, *flags, "-c", str(src), "-o", str(objs[src])],
                capture_output=True,
                text=True,
                timeout=300,
            )
            return f"{src.name}: {proc.stderr}" if proc.returncode else None

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            errors = [e for e in pool.map(compile_one, SOURCES) if e]
        if errors:
            raise subprocess.CalledProcessError(1, compiler, stderr="\n".join(errors))
        so = Path(tmp) / out.name
        subprocess.run(
            [compiler, *build_flags(), *map(str, objs.values()), "-o", str(so), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(so, out)  # atomic: a concurrent process sees the old file or the whole new one


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn = lib.paged_attention
    fn.restype = i32
    # q, q_stride, q_hstride, k, v, out, dtype, G, row0, n, start, table, max_blocks, block_shift,
    # kv_token_stride, kv_head_stride, causal, H, Hkv, D, scale
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, i32, ptr, ptr, ptr, ptr, i32, i32, i64, i64, i32]
    fn.argtypes += [i32, i32, i32, ctypes.c_float]
    lib.paged_attention_ex.restype = i32
    lib.paged_attention_ex.argtypes = fn.argtypes + [i32]  # ... scale, flags (ATTN_INVARIANT)
    lib.paged_attention_f32_row_invariant.restype = i32
    lib.paged_attention_f32_row_invariant.argtypes = []
    lib.rope_store.restype = None
    # q, q_stride, q_hstride, k, k_stride, k_hstride, v, v_stride, cos, sin, slots, k_cache,
    # v_cache, num_slots, dtype, T, H, Hkv, D
    lib.rope_store.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64]
    lib.rope_store.argtypes += [i32, i32, i32, i32, i32]
    lib.add_rmsnorm.restype = None
    lib.add_rmsnorm.argtypes = [
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i32,
        i32,
        ctypes.c_float,
    ]  # h, delta, stride, w, out, T, d, eps
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [ptr, ptr, i32, i32]  # gu, out, T, n
    lib.add_rmsnorm_f32.restype = None
    lib.add_rmsnorm_f32.argtypes = lib.add_rmsnorm.argtypes
    lib.silu_mul_f32.restype = None
    lib.silu_mul_f32.argtypes = lib.silu_mul.argtypes
    lib.norm_rope_f32.restype = None
    # x, token stride, head stride, w, eps, cos, sin, out, T, heads, D
    lib.norm_rope_f32.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, ptr, ptr, i32, i32, i32]
    lib.norm_rope_bf16.restype = None
    lib.norm_rope_bf16.argtypes = lib.norm_rope_f32.argtypes
    lib.markov_greedy_walk.restype = i32
    # base, its dtype, anchor, w1, w2 (packed), their dtype (0 float32, 1 bf16), d2t, B, K, V, r,
    # tokens, prevs
    lib.markov_greedy_walk.argtypes = [ptr, i32, ptr, ptr, ptr, i32, ptr, i32, i32, i32, i32, ptr, ptr]
    _declare_row_ops(lib)
    lib.small_gemm_tiles.restype = i32
    lib.small_gemm_tiles.argtypes = []
    lib.kernel_paths.restype = i32
    lib.kernel_paths.argtypes = []
    lib.paged_attention_tiles.restype = i32
    lib.paged_attention_tiles.argtypes = []
    lib.small_gemm_pack.restype = None
    lib.small_gemm_pack.argtypes = [ptr, ptr, i32, i32]  # W, packed, N, K
    lib.small_gemm.restype = None
    lib.small_gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i32, i32, i32]  # x, stride, packed, bias, y, M, N, K
    lib.small_gemm_ex.restype = None
    lib.small_gemm_ex.argtypes = lib.small_gemm.argtypes + [i32]  # ... K, flags (GEMM_*)
    lib.small_gemm_f32_pack.restype = None
    lib.small_gemm_f32_pack.argtypes = lib.small_gemm_pack.argtypes
    lib.small_gemm_f32.restype = None
    lib.small_gemm_f32.argtypes = lib.small_gemm.argtypes
    lib.draft_layers_bf16.restype = i32
    # layers, L, k_pools, v_pools, h, rows, first_norm, first_eps, flat, cos_q, sin_q, cos_k,
    # sin_k, G, row0, n, start, table, max_blocks, block_shift, n, m, d, H, Hkv, D, I, scale
    lib.draft_layers_bf16.argtypes = [ptr, i32, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ptr, ptr, ptr]
    lib.draft_layers_bf16.argtypes += [ptr, ptr, i32, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32]
    lib.draft_layers_bf16.argtypes += [i32, i32, i32, ctypes.c_float]
    lib.draft_tail_bf16.restype = i32
    # hidden, row stride, head (packed), V, w1, w2 (packed), their dtype, d2t, r, anchor, B, K, d,
    # w_h, per_prev, bias, tokens, prevs, conf
    lib.draft_tail_bf16.argtypes = [ptr, i64, ptr, i32, ptr, ptr, i32, ptr, i32, ptr, i32, i32, i32]
    lib.draft_tail_bf16.argtypes += [ptr, ptr, ctypes.c_float, ptr, ptr, ptr]
    lib.target_layers.restype = i32
    # layers, L, bf16, k_caches, v_caches, num_slots, h, x, first_norm, first_eps, cos, sin, slots,
    # G, row0, n, start, table, max_blocks, block_shift, T, d, H, Hkv, D, I, scale, tap_col, taps,
    # ntaps, invariant
    lib.target_layers.argtypes = [ptr, i32, i32, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_float, ptr, ptr]
    lib.target_layers.argtypes += [ptr, i32, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32, i32]
    lib.target_layers.argtypes += [ctypes.c_float, ptr, ptr, i32, i32]
    _declare_quant(lib)


def _declare_quant(lib: ctypes.CDLL) -> None:
    """The GGUF block products (csrc/quant_gemm.c; used through `ops.quant_kernels`)."""
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.quant_gemm.restype = i32
    lib.quant_gemm.argtypes = [
        ptr,
        i64,
        ptr,
        i32,
        ptr,
        ptr,
        i32,
        i32,
        i32,
    ]  # x, x stride, packed, type, bias, y, M, N, K
    lib.quant_pack_bytes.restype = i64
    lib.quant_pack_bytes.argtypes = [i32, i32, i32]  # type, N, K
    lib.quant_pack.restype = i32
    lib.quant_pack.argtypes = [ptr, i64, i32, i32, i32, ptr]  # blocks, row bytes, type, N, K, out
    lib.quant_rows.restype = i32
    lib.quant_rows.argtypes = [ptr, i64, i32, ptr, i32, i32, ptr]  # w, row bytes, type, ids, n, K, out
    lib.quant_gemm_path.restype = i32
    lib.quant_gemm_path.argtypes = []


def _declare_row_ops(lib: ctypes.CDLL) -> None:
    """The kernels that read logits or probability rows: argmax, token masks, draws."""
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.argmax_rows.restype = None
    # x, dtype (0 float32, 1 bf16), T, V, row stride, out
    lib.argmax_rows.argtypes = [ptr, i32, i32, i64, i64, ptr]
    lib.argmax_allowed.restype = i64
    lib.argmax_allowed.argtypes = [ptr, i32, i64, ptr, ptr, i64]  # x, dtype, V, d2t (or NULL), bits, W
    lib.mask_rows_bits.restype = None
    lib.mask_rows_bits.argtypes = [ptr, i32, i64, i64, ptr, i64]  # x, T, V, row stride, bits, W
    lib.sample_final_rows.restype = i32
    # probs, its row stride, p's rows, q (or NULL), its row stride, q's rows, one-hot flags, tokens,
    # rejected flags, eps, N, V, u (double), out
    lib.sample_final_rows.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_double, i32, i64]
    lib.sample_final_rows.argtypes += [ptr, ptr]


@functools.cache
def _library_key(compiler: str) -> str:
    """Hash of the sources, flags, compiler and CPU: read once per process (every linear layer
    of a model asks for the library at load)."""
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    flags = " ".join(sorted(cpu_flags()))  # a cache shared between CPUs: each its own build
    digest.update((" ".join(build_flags()) + compiler + platform.machine() + flags).encode())
    return digest.hexdigest()[:16]


def kernels_key() -> str | None:
    """The key of the kernel library this process would build or load (sources, flags,
    compiler, CPU), or None without a compiler: what a cost measured with the kernels depends on."""
    compiler = find_compiler()
    return _library_key(compiler) if compiler else None


_load_lock = threading.Lock()


def prepare_kernels(cache_dir: Path | None = None) -> threading.Thread:
    """Build or load the kernel library on a thread of its own, so that a first start compiles
    while it reads the model (the compiler runs outside the interpreter); whoever needs the
    library next waits for it in `load_kernels`."""
    thread = threading.Thread(target=load_kernels, args=(cache_dir,), name="kernels", daemon=True)
    thread.start()
    return thread


def load_kernels(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library (built once, cached by sources, compiler flags and CPU), or
    None where it cannot be built here. Thread-safe: a second caller waits for the first's build."""
    with _load_lock:
        return _load_kernels(cache_dir)


def _load_kernels(cache_dir: Path | None) -> ctypes.CDLL | None:
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler found: the CPU forward stays on torch's kernels")
        return None
    key = _library_key(compiler)
    if key in _loaded:
        return _loaded[key]
    path = (cache_dir or default_cache_dir()) / "kernels" / f"cpu_kernels-{key}.so"
    lib: ctypes.CDLL | None = None
    try:
        if not path.exists():
            t0 = time.perf_counter()
            _build(compiler, path)
            log.info("compiled the CPU kernels for this machine in %.1fs (cached)", time.perf_counter() - t0)
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning("CPU kernels unavailable (%s): using torch's kernels", str(detail)[:500])
        lib = None
    _loaded[key] = lib
    return lib


# kernel_paths()'s bits (csrc/small_gemm.c) and the CPU level each path is first built at
KERNEL_PATHS = {1: "avx2", 2: "avx512", 4: "avx512-bf16", 8: "amx"}


def kernel_paths(lib: ctypes.CDLL) -> tuple[str, ...]:
    """The instruction-set paths the loaded library was built with (empty: plain C only)."""
    bits = lib.kernel_paths()
    return tuple(name for bit, name in KERNEL_PATHS.items() if bits & bit)


def describe_cpu() -> str:
    """One line for the start-up log: the CPU, its level (as this process sees it), the C
    kernels' paths and torch's vectorised kernels."""
    flags = cpu_flags()
    level = emulated_level()
    seen = level_of(flags).name + (f", run as {level.name}" if level is not None else "")
    lib = load_kernels()
    paths = "none (torch's kernels)" if lib is None else ", ".join(kernel_paths(lib)) or "plain C"
    return f"{cpu_model()} ({seen}); C kernel paths: {paths}; torch {torch.backends.cpu.get_cpu_capability()}"


def loaded_kernels() -> ctypes.CDLL | None:
    """The kernel library this process already loaded (a model's forward loads it), or None:
    for per-step helpers that must not build or look anything up."""
    return next((lib for lib in _loaded.values() if lib is not None), None)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, V] -> x.argmax(-1) [T] int64, the same indices (first maximum; a NaN counts as the
    maximum). float32 / bf16 CPU rows go through the C kernel once it is loaded: torch's CPU
    argmax is slow on bf16 rows as wide as a vocabulary; anything else, torch's."""
    lib = loaded_kernels()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.dtype not in DTYPE_CODES
        or x.stride(-1) != 1
        or x.shape[1] == 0
    ):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.argmax_rows(x.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def mask_rows_bits(x: torch.Tensor, bits: torch.Tensor) -> None:
    """x [T, V] float32 (in place), bits [T, W] int32 packed token masks (bit j of word w allows
    token 32 w + j, llguidance's layout): every token not allowed becomes -inf. float32 CPU rows
    go through the C kernel once it is loaded; anything else, unpacked by torch."""
    lib = loaded_kernels()
    if (
        lib is not None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(-1) == 1
        and bits.dtype == torch.int32
        and bits.is_contiguous()
        and bits.device.type == "cpu"
        and bits.shape[0] == x.shape[0]
    ):
        lib.mask_rows_bits(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), bits.data_ptr(), bits.shape[1])
        return
    x.masked_fill_(~unpack_bits(bits.to(x.device), x.shape[1]), float("-inf"))


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed token mask (`mask_rows_bits`' layout)."""
    return (vocab_size + 31) // 32


def argmax_allowed(row: torch.Tensor, bits: torch.Tensor, d2t: torch.Tensor | None = None) -> int:
    """row [V'] logits, bits [W] int32 a packed token mask (`mask_rows_bits`' layout), d2t [V']
    int64 the target token of each entry (None: entry j is token j) -> the index of the row's
    first maximum among the entries whose token the mask allows (a NaN counts as the maximum),
    or -1 when it allows none of them: the argmax of the row masked off the allowed tokens,
    without building the mask. float32 / bf16 CPU rows go through the C kernel once it is
    loaded; anything else, torch's ops."""
    lib = loaded_kernels()
    if (
        lib is not None
        and row.device.type == "cpu"
        and row.dim() == 1
        and row.dtype in DTYPE_CODES
        and row.is_contiguous()
        and bits.dtype == torch.int32
        and bits.dim() == 1
        and bits.is_contiguous()
        and (d2t is None or (d2t.dtype == torch.long and d2t.is_contiguous() and d2t.numel() == row.numel()))
    ):
        return int(
            lib.argmax_allowed(
                row.data_ptr(),
                DTYPE_CODES[row.dtype],
                row.numel(),
                None if d2t is None else d2t.data_ptr(),
                bits.data_ptr(),
                bits.numel(),
            )
        )
    tokens = torch.arange(row.numel()) if d2t is None else d2t.cpu().long()
    allowed = unpack_bits(bits.cpu().reshape(1, -1), 32 * bits.numel())[0]  # [32 W] bool
    inside = (tokens >= 0) & (tokens < allowed.numel())
    keep = inside & allowed[torch.where(inside, tokens, 0)] if allowed.numel() else inside & False
    if not bool(keep.any()):
        return -1
    x = row.detach().float().cpu()
    nan = keep & torch.isnan(x)
    if bool(nan.any()):
        return int(nan.nonzero()[0])
    best = x[keep].max()  # the first allowed entry equal to it (-inf included)
    return int((keep & (x == best)).nonzero()[0])


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """probs [N, V] float32 CPU rows (need not be normalised), u [N] uniforms in [0, 1) -> [N]
    int64 inverse-CDF draws (`ops.sampling.sample_from_uniforms`' rule, the mass summed in
    double in blocks: csrc/elementwise.c `sample_final_rows` with nothing rejected), or None
    where the C kernel does not apply (not loaded, another dtype or device)."""
    if probs.dim() != 2 or u.shape != probs.shape[:1]:
        return None
    n = probs.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    plain = FinalDraws(probs, torch.arange(n), None, zeros, zeros.bool(), zeros, zeros.bool(), 0.0)
    return sample_final_rows(plain, u)


@dataclass(frozen=True)
class FinalDraws:
    """What speculative sampling's last draw of each of B requests reads (`sample_final_rows`):
    p_rows [B] the rows of `probs` [T, V] it draws from; where `rejected` [B] bool, the residual
    max(0, p - q) instead, q being row q_rows [B] of `q` [D, V] (None: one-hot on `tokens` [B],
    as on rows flagged `one_hot` [B] bool), unless that residual's mass is not above `eps`."""

    probs: torch.Tensor
    p_rows: torch.Tensor
    q: torch.Tensor | None
    q_rows: torch.Tensor
    one_hot: torch.Tensor
    tokens: torch.Tensor
    rejected: torch.Tensor
    eps: float


def sample_final_rows(d: FinalDraws, u: torch.Tensor) -> torch.Tensor | None:
    """d's draws with u [B] uniforms in [0, 1) -> [B] int64: the inverse-CDF draws of
    `sample_rows` from each request's p or residual, the residual computed as it is read (never
    stored), or None where the C kernel does not apply (not loaded, another dtype or device)."""
    lib = loaded_kernels()
    probs, q = d.probs, d.q
    if (
        lib is None
        or probs.device.type != "cpu"
        or probs.dtype != torch.float32
        or probs.dim() != 2
        or probs.stride(-1) != 1
        or probs.shape[1] == 0
        or (q is not None and (q.dtype != torch.float32 or q.device.type != "cpu" or q.dim() != 2))
        or (q is not None and (q.stride(-1) != 1 or q.shape[1] != probs.shape[1]))
    ):
        return None
    b = d.p_rows.numel()
    ints = [t.to(dtype=torch.long, device="cpu").contiguous() for t in (d.p_rows, d.q_rows, d.tokens)]
    flags = [t.to(dtype=torch.uint8, device="cpu").contiguous() for t in (d.one_hot, d.rejected)]
    uniforms = u.to(dtype=torch.float64, device="cpu").contiguous()
    if any(t.numel() != b for t in (*ints, *flags, uniforms)):
        raise ValueError(f"{b} requests need {b} rows, q rows, tokens, flags and uniforms each")
    if b and (int(ints[0].min()) < 0 or int(ints[0].max()) >= probs.shape[0]):
        raise ValueError(f"p rows outside the {probs.shape[0]} rows of probs")
    if b and q is not None and (int(ints[1].min()) < 0 or int(ints[1].max()) >= q.shape[0]):
        raise ValueError(f"q rows outside the {q.shape[0]} rows of q")
    out = torch.empty(b, dtype=torch.long)
    rc = lib.sample_final_rows(
        probs.data_ptr(),
        probs.stride(0),
        ints[0].data_ptr(),
        None if q is None else q.data_ptr(),
        0 if q is None else q.stride(0),
        ints[1].data_ptr(),
        flags[0].data_ptr(),
        ints[2].data_ptr(),
        flags[1].data_ptr(),
        d.eps,
        b,
        probs.shape[1],
        uniforms.data_ptr(),
        out.data_ptr(),
    )
    if rc != 0:
        raise MemoryError("sample_final_rows could not allocate its buffer")
    return out


def unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:  # [T, W] int32 -> [T, vocab] bool
    """Packed token masks as one bool per token (tokens past 32 W: not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([allowed, pad], 1)


def paged_attention_supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel handles this dtype and device (float32 or bfloat16 on a CPU)."""
    return device.type == "cpu" and dtype in DTYPE_CODES


def float32_attention_row_invariant(lib: ctypes.CDLL) -> bool:
    """Whether this build's float32 attention computes each query row alone, in one order of
    sums (AVX2 + FMA CPUs): a row's output is then the same bits whatever else shares the call,
    as with the float32 linears (`small_gemm_f32`)."""
    return bool(lib.paged_attention_f32_row_invariant())


class PagedAttention:
    """Callable wrapper of the kernel for one geometry.

    __call__(q, k_cache, v_cache, out, row0, n, start, block_table, scale, causal=True):
    q [T, H, D] (any token and head strides, each head's D elements contiguous); out [T, H, D]
    contiguous; row0 / n / start [G] and block_table [G, max_blocks], int32 and contiguous.
    k_cache / v_cache: the target's head-major pool [Hkv, num_slots, D] (`layout="head-major"`)
    or a slot-major pool [num_slots, Hkv, D] flattened over its leading dimensions
    (`layout="slot-major"`, the drafter's [requests, positions, Hkv, D]). Writes out rows
    row0[g] .. row0[g] + n[g] - 1 of every segment g; other rows are left as they are.
    invariant: every query row computed alone, in one order of sums (`ATTN_INVARIANT`), so a
    row's output is the same bits whatever segments, rows and lengths share the call."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        layout: str = "head-major",
        invariant: bool = False,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads!r} is not a multiple of num_kv_heads {num_kv_heads!r}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size!r}")
        if layout not in ("head-major", "slot-major"):
            raise ValueError(f"layout must be head-major or slot-major, got {layout!r}")
        if not (0 < head_dim <= 256):  # the kernel's per-row buffers
            raise ValueError(f"paged attention needs head_dim <= 256, got {head_dim!r}")
        self.fn = lib.paged_attention_ex
        self.flags = ATTN_INVARIANT if invariant else 0
        self.block_shift = block_size.bit_length() - 1
        self.H, self.Hkv, self.D, self.layout = num_heads, num_kv_heads, head_dim, layout

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        row0: torch.Tensor,
        n: torch.Tensor,
        start: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
        causal: bool = True,
    ) -> None:
        for t in (k_cache, v_cache, out, row0, n, start, block_table):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("paged_attention needs contiguous CPU tensors")
        if q.device.type != "cpu" or q.stride(2) != 1:
            raise ValueError(
                f"paged_attention needs each q head's elements contiguous, got strides {q.stride()}"
            )
        if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype) or q.dtype not in DTYPE_CODES:
            raise ValueError(f"paged_attention needs one dtype of {list(DTYPE_CODES)}, got {q.dtype}")
        for t in (row0, n, start, block_table):
            if t.dtype != torch.int32:
                raise ValueError(f"paged_attention needs int32 segment tensors, got {t.dtype}")
        if self.layout == "head-major":  # [Hkv, num_slots, D]
            token_stride, head_stride = self.D, k_cache.shape[1] * self.D
        else:  # [..., Hkv, D]
            token_stride, head_stride = self.Hkv * self.D, self.D
        rc = self.fn(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            DTYPE_CODES[q.dtype],
            row0.numel(),
            row0.data_ptr(),
            n.data_ptr(),
            start.data_ptr(),
            block_table.data_ptr(),
            block_table.shape[1],
            self.block_shift,
            token_stride,
            head_stride,
            int(causal),
            self.H,
            self.Hkv,
            self.D,
            scale,
            self.flags,
        )
        if rc != 0:
            raise MemoryError("paged_attention could not allocate its work buffers")


class RopeStore:
    """Rotary embedding of a step's new q/k and the K/V write to the head-major paged cache, one
    kernel call per layer (`rope_store` in csrc/paged_attention.c).

    __call__(q, k, v, cos, sin, slots, k_cache, v_cache): q [T, H, D], k / v [T, Hkv, D], views
    at any token and head strides (each head's D elements contiguous; v's heads adjacent); cos / sin
    [T, D] (contiguous; rotate_half's sign folded into sin); slots [T] int64; caches
    [Hkv, num_slots, D]. q is rotated in place; rotated k and v land at their slots."""

    def __init__(self, lib: ctypes.CDLL, num_heads: int, num_kv_heads: int, head_dim: int):
        if head_dim > 256 or head_dim % 2:
            raise ValueError(f"rope_store needs an even head_dim <= 256, got {head_dim!r}")
        self.fn = lib.rope_store
        self.H, self.Hkv, self.D = num_heads, num_kv_heads, head_dim

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        D = self.D
        for t in (q, k, v):
            if t.stride(-1) != 1 or (t is v and t.stride(-2) != D) or t.device.type != "cpu":
                raise ValueError(f"rope_store needs each token's heads contiguous, got strides {t.stride()}")
        for t in (cos, sin, slots, k_cache, v_cache):
            if not t.is_contiguous():
                raise ValueError("rope_store needs contiguous cos, sin, slots and caches")
        if slots.dtype != torch.int64 or q.dtype not in DTYPE_CODES:
            raise ValueError(
                f"rope_store needs int64 slots and float32/bf16 rows, got {slots.dtype}, {q.dtype}"
            )
        if not (q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype):
            raise ValueError("rope_store needs one dtype throughout")
        self.fn(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            v.data_ptr(),
            v.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.shape[1],
            DTYPE_CODES[q.dtype],
            q.shape[0],
            self.H,
            self.Hkv,
            D,
        )


class FusedElementwise:
    """bf16 or float32 rows: the residual add fused with the RMSNorm after it, and SwiGLU's
    silu(g) * u (csrc/elementwise.c), each one call in place of 3-4 small torch kernels."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # per dtype: (add_rmsnorm, silu_mul)
        self._fns = {
            torch.bfloat16: (lib.add_rmsnorm, lib.silu_mul),
            torch.float32: (lib.add_rmsnorm_f32, lib.silu_mul_f32),
        }

    def add_rmsnorm(
        self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h [T, d] += delta (in place, rounded as torch's add rounds); -> RMSNorm(h) * w."""
        T, d = h.shape
        fns = self._fns.get(h.dtype)
        if fns is None or not h.is_contiguous() or not w.is_contiguous() or w.dtype != h.dtype:
            raise ValueError(f"add_rmsnorm needs a contiguous bf16/float32 h and weight, got {h.dtype}")
        if delta is not None and (delta.dtype != h.dtype or delta.stride(-1) != 1):
            raise ValueError("add_rmsnorm needs delta rows of h's dtype with contiguous elements")
        out = torch.empty_like(h)
        dptr, dstride = (0, 0) if delta is None else (delta.data_ptr(), delta.stride(0))
        fns[0](h.data_ptr(), dptr, dstride, w.data_ptr(), out.data_ptr(), T, d, eps)
        return out

    def norm_rope(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """float32 or bf16 x [T, heads, D] (any token and head strides, each head's D
        contiguous) -> rotary(RMSNorm(x) * w) [T, heads, D], cos / sin [T, D] contiguous with
        rotate_half's sign folded into sin, w, cos and sin of x's dtype; None where it does not
        apply (another dtype, D > 256 or odd)."""
        T, nh, D = x.shape
        if x.dtype not in DTYPE_CODES or D > 256 or D % 2 or x.stride(-1) != 1:
            return None
        if not (w.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("norm_rope needs a contiguous weight, cos and sin")
        if w.dtype != x.dtype or cos.dtype != x.dtype or sin.dtype != x.dtype or tuple(cos.shape) != (T, D):
            got = f"{w.dtype} w, {cos.dtype} cos of shape {tuple(cos.shape)}"
            raise ValueError(f"norm_rope needs w and cos / sin [{T}, {D}] of x's dtype {x.dtype}, got {got}")
        out = x.new_empty(T, nh, D)
        fn = self.lib.norm_rope_f32 if x.dtype == torch.float32 else self.lib.norm_rope_bf16
        fn(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            w.data_ptr(),
            eps,
            cos.data_ptr(),
            sin.data_ptr(),
            out.data_ptr(),
            T,
            nh,
            D,
        )
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2n] (gate | up) -> silu(gate) * up [T, n]."""
        T, n2 = gu.shape
        fns = self._fns.get(gu.dtype)
        if fns is None or not gu.is_contiguous() or n2 % 2:
            raise ValueError(f"silu_mul needs a contiguous bf16/float32 [T, 2n] input, got {gu.dtype}")
        out = gu.new_empty(T, n2 // 2)
        fns[1](gu.data_ptr(), out.data_ptr(), T, n2 // 2)
        return out


def pack_small_gemm(lib: ctypes.CDLL, w: torch.Tensor) -> torch.Tensor:
    """W [N, K] (float32, or bf16 with K even; CPU) in small_gemm's packed layout, a buffer of
    its own (what small_gemm, small_gemm_f32 and small_gemv_part read)."""
    N, K = w.shape
    packed = torch.empty(-(-N // 16) * 16 * K, dtype=w.dtype)
    pack = lib.small_gemm_pack if w.dtype == torch.bfloat16 else lib.small_gemm_f32_pack
    pack(w.contiguous().data_ptr(), packed.data_ptr(), N, K)
    return packed


# Rows above `max_rows` go to the fallback in multiples of this (16 where `max_rows` is
# smaller), the remainder to the kernel.
FALLBACK_ROW_BUCKET = 64


class SmallGemmLinear:
    """A bfloat16 or float32 linear layer through `small_gemm` (`small_gemm_f32`) for up to
    `max_rows` rows (decode and short verify steps), and through `fallback` (oneDNN's prepacked
    kernel, or torch's linear where oneDNN cannot run bf16) for more. The weight is packed once,
    into its own buffer.

    invariant: every row count through the kernel in its batch-invariant order (bf16:
    `GEMM_INVARIANT`; float32 always is), the fallback never: a row's outputs are the same bits
    whatever else shares the call. float_out: bf16 weights give float32 outputs, unrounded (the
    LM head of a batch-invariant forward: float32 logits)."""

    kind = "gemm"

    def __init__(
        self,
        lib: ctypes.CDLL,
        w: torch.Tensor,
        b: torch.Tensor | None,
        fallback: Callable[[torch.Tensor], torch.Tensor],
        max_rows: int,
        invariant: bool = False,
        float_out: bool = False,
    ) -> None:
        bf16 = w.dtype == torch.bfloat16
        odd_bf16 = bf16 and w.dim() == 2 and w.shape[1] % 2 == 1
        if (
            w.dtype not in (torch.float32, torch.bfloat16)
            or w.device.type != "cpu"
            or w.dim() != 2
            or odd_bf16
        ):
            got = f"{w.dtype} {tuple(w.shape)} on {w.device}"
            raise ValueError(f"small_gemm needs a 2-D float32 or bfloat16 (even K) CPU weight, got {got}")
        self.N, self.K = w.shape
        self.dtype = w.dtype
        self.packed = pack_small_gemm(lib, w)
        self.bias = None if b is None else b.to(w.dtype).contiguous()
        self.invariant = invariant
        self.out_dtype = torch.float32 if float_out else w.dtype
        # bf16: small_gemm_ex with its flags (the same call, the mode's flags appended); float32
        # rows are batch-invariant in small_gemm_f32 anyway
        self.fn = lib.small_gemm_ex if bf16 else lib.small_gemm_f32
        self.flags = (
            ((GEMM_INVARIANT if invariant else 0) | (GEMM_F32_OUT if float_out else 0),) if bf16 else ()
        )
        self.fallback, self.max_rows = fallback, (1 << 30) if invariant else max_rows
        # a small limit means the fallback wins early (oneDNN on AMX tiles): a small bucket
        self.bucket = FALLBACK_ROW_BUCKET if max_rows >= FALLBACK_ROW_BUCKET else 16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        if self.invariant and x.dim() == 2 and x.dtype == self.dtype and x.stride(-1) != 1:
            x = x.contiguous()  # the kernel, never the fallback's other order of sums
        if x.dtype != self.dtype or x.stride(-1) != 1 or x.dim() != 2:
            if self.invariant:
                got = f"{x.dtype} {tuple(x.shape)}"
                raise ValueError(f"a batch-invariant linear takes [rows, {self.K}] {self.dtype}, got {got}")
            return self.fallback(x)
        if M <= self.max_rows:
            y = x.new_empty(M, self.N, dtype=self.out_dtype)
            self._gemm(x, y)
            return y
        # The fallback sees a multiple of the bucket, the kernel the rest: oneDNN compiles and
        # caches kernels for every row count it is given (hundreds of KB each, up to its cache
        # of 1,024), and the row counts of a server's steps never stop varying, so a process
        # held more memory after every burst of traffic; bucketed, it sees a few dozen.
        bulk = M - M % self.bucket
        if bulk == M:
            return self.fallback(x).to(self.out_dtype)
        y = x.new_empty(M, self.N, dtype=self.out_dtype)
        if bulk:
            y[:bulk] = self.fallback(x[:bulk])
        self._gemm(x[bulk:], y[bulk:])
        return y

    def _gemm(self, x: torch.Tensor, y: torch.Tensor) -> None:  # x [M, K] -> y [M, N], y contiguous
        bias = 0 if self.bias is None else self.bias.data_ptr()
        M = x.shape[0]
        self.fn(
            x.data_ptr(),
            x.stride(0),
            self.packed.data_ptr(),
            bias,
            y.data_ptr(),
            M,
            self.N,
            self.K,
            *self.flags,
        )


class LayerProduct(Protocol):
    """A layer's product as the layer drivers take it: packed floats (`SmallGemmLinear`), or GGUF
    blocks (`ops.quant_kernels.QuantLinear`, the target's float32 steps)."""

    N: int
    K: int
    max_rows: int
    dtype: torch.dtype
    packed: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _segment_args(segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[int, ...]:
    """The attention's segments as the layer drivers take them: G, row0, n, start, the block
    table and its width."""
    row0, n, start, table = segments
    return (row0.numel(), row0.data_ptr(), n.data_ptr(), start.data_ptr(), table.data_ptr(), table.shape[1])


def _products(w: LayerProducts) -> list[int | None]:
    """The first six fields of both layer structs: qkv, its bias, o, its bias, gate_up, down."""
    return [
        _ptr(t) for t in (w.qkv.packed, w.qkv.bias, w.o.packed, w.o.bias, w.gate_up.packed, w.down.packed)
    ]


class _LayersInC:
    """What both layer drivers keep: the C function, the geometry, the first layer's input norm,
    the row limit of their products and the weights their structs point into. linears: each
    layer's (qkv, o, gate_up, down) in order."""

    def __init__(
        self,
        fn: Any,  # a ctypes function of the library
        layers: Sequence[object],
        linears: list[LayerProduct],
        first_norm: tuple[torch.Tensor, float],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        self.fn = fn
        self.H, self.Hkv, self.D = num_heads, num_kv_heads, head_dim
        self.d = linears[1].N  # o's outputs: the model width
        self.inter = linears[3].K  # down's inputs: the MLP width
        self.first = first_norm
        self.max_rows = min(lin.max_rows for lin in linears)
        self._keep = layers  # the packed weights the structs point into

    def _sizes(self, scale: float) -> tuple[int | float, ...]:
        """The last arguments both drivers take: d, H, Hkv, D, the MLP width, the attention scale."""
        return (self.d, self.H, self.Hkv, self.D, self.inter, scale)


class _DraftLayer(ctypes.Structure):
    """One layer's weights as `draft_layers_bf16` reads them (csrc/draft_layers.c)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "down")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("q_norm", "k_norm", "post_norm", "next_norm")]
    _fields_ += [(name, ctypes.c_float) for name in ("q_eps", "k_eps", "post_eps", "next_eps")]


@dataclass(frozen=True)
class LayerProducts:
    """A decoder layer's four products through the packed gemm (or, the target's, GGUF blocks),
    as the layer drivers take them."""

    qkv: LayerProduct
    o: LayerProduct
    gate_up: LayerProduct
    down: LayerProduct


@dataclass(frozen=True)
class DraftLayerWeights(LayerProducts):
    """What one drafter layer hands `DraftLayers`: its bf16 products through the packed small gemm
    (gate_up and down without bias) and its norms as (weight, eps); next_norm is the next layer's
    input norm, or the final norm after the last layer."""

    q_norm: tuple[torch.Tensor, float]
    k_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    next_norm: tuple[torch.Tensor, float]


class DraftLayers(_LayersInC):
    """The drafter's decoder layers over a block in one C call (`draft_layers_bf16`): the kernels
    of `FastDraftBackbone._layers` with the in-place attention, in its order, without a Python
    dispatch per kernel. bf16 only; every product's rows must stay within the packed gemm's
    `max_rows` (above it the Python loop's oneDNN fallback runs)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: list[DraftLayerWeights],
        first_norm: tuple[torch.Tensor, float],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        linears = [lin for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
        norms = [n for w in layers for n in (w.q_norm, w.k_norm, w.post_norm, w.next_norm)] + [first_norm]
        if any(lin.dtype != torch.bfloat16 for lin in linears) or any(
            n[0].dtype != torch.bfloat16 or not n[0].is_contiguous() for n in norms
        ):
            raise ValueError("draft_layers_bf16 needs bf16 products and contiguous bf16 norms")
        if any(w.gate_up.bias is not None or w.down.bias is not None for w in layers):
            raise ValueError("draft_layers_bf16 takes gate_up / down without bias")
        super().__init__(
            lib.draft_layers_bf16, layers, linears, first_norm, num_heads, num_kv_heads, head_dim
        )
        self.structs = (_DraftLayer * len(layers))(
            *[
                _DraftLayer(
                    *_products(w),
                    _ptr(w.q_norm[0]),
                    _ptr(w.k_norm[0]),
                    _ptr(w.post_norm[0]),
                    _ptr(w.next_norm[0]),
                    w.q_norm[1],
                    w.k_norm[1],
                    w.post_norm[1],
                    w.next_norm[1],
                )
                for w in layers
            ]
        )
        self.pools_t = ctypes.c_void_p * len(layers)

    def __call__(
        self,
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        h: torch.Tensor,
        rows: torch.Tensor,
        flat: torch.Tensor,
        cos_q: torch.Tensor,
        sin_q: torch.Tensor,
        cos_k: torch.Tensor,
        sin_k: torch.Tensor,
        segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        block_shift: int,
        scale: float,
    ) -> None:
        """h [n, d] (the embedded block, updated in place); rows [n + m, d] (context features in
        rows n..; rows 0 .. n - 1 get the output); flat [n + m] int64 pool rows; cos / sin of the
        queries [n, D] and keys [n + m, D]; segments: row0, n, start [G] and the block table
        [G, max_blocks], int32 (the attention's, every row seeing its whole block). All
        contiguous, on the CPU."""
        n, m = h.shape[0], rows.shape[0] - h.shape[0]
        rc = self.fn(
            ctypes.addressof(self.structs),
            len(self.structs),
            self.pools_t(*[p.data_ptr() for p in k_pools]),
            self.pools_t(*[p.data_ptr() for p in v_pools]),
            h.data_ptr(),
            rows.data_ptr(),
            self.first[0].data_ptr(),
            self.first[1],
            flat.data_ptr(),
            cos_q.data_ptr(),
            sin_q.data_ptr(),
            cos_k.data_ptr(),
            sin_k.data_ptr(),
            *_segment_args(segments),
            block_shift,
            n,
            m,
            *self._sizes(scale),
        )
        if rc != 0:
            raise MemoryError("draft_layers_bf16 could not allocate its work buffers")


class _TargetLayer(ctypes.Structure):
    """One layer's weights as `target_layers` reads them (csrc/target_layers.c)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "qkv",
            "qkv_bias",
            "o",
            "o_bias",
            "gate_up",
            "down",
            "down_bias",
            "post_norm",
            "next_norm",
        )
    ]
    _fields_ += [(name, ctypes.c_float) for name in ("post_eps", "next_eps")]
    _fields_ += [("types", ctypes.c_int * 4)]


def _block_types(w: TargetLayerWeights) -> Any:
    """The struct's `types`: each product's GGUF block type (0: packed floats)."""
    return (ctypes.c_int * 4)(*[getattr(p, "type_id", 0) for p in (w.qkv, w.o, w.gate_up, w.down)])


@dataclass(frozen=True)
class TargetLayerWeights(LayerProducts):
    """What one target layer hands `TargetLayers`: its products through the packed gemm or GGUF
    blocks (`QuantLinear`, float32 steps; gate_up without bias) and its norms as (weight, eps);
    next_norm is the next layer's input norm, or the final norm after the last layer."""

    post_norm: tuple[torch.Tensor, float]
    next_norm: tuple[torch.Tensor, float]


class TargetLayers(_LayersInC):
    """The target's decoder layers over one step in one C call (`target_layers`): the kernels of
    `verifier.forward_fast.FastForward._layers_fused` with the paged attention, in its order,
    without a Python dispatch, an allocation and the argument checks per kernel. float32 or bf16
    (the products' dtype); every product's rows must stay within the packed gemm's `max_rows` (above it the
    Python loop's fallback runs); no q/k head norms (the loop runs those too)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: list[TargetLayerWeights],
        first_norm: tuple[torch.Tensor, float],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        invariant: bool = False,
    ) -> None:
        """invariant: the products and the attention in their batch-invariant orders."""
        linears = [lin for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
        dtype = linears[0].dtype
        self.invariant = invariant
        norms = [n for w in layers for n in (w.post_norm, w.next_norm)] + [first_norm]
        if dtype not in (torch.float32, torch.bfloat16) or any(lin.dtype != dtype for lin in linears):
            raise ValueError(f"target_layers needs float32 or bf16 products of one dtype, got {dtype}")
        if any(n[0].dtype != dtype or not n[0].is_contiguous() for n in norms):
            raise ValueError("target_layers needs contiguous norms of the products' dtype")
        if any(w.gate_up.bias is not None for w in layers):
            raise ValueError("target_layers takes gate_up without bias")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size!r}")
        super().__init__(lib.target_layers, layers, linears, first_norm, num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.block_shift = block_size.bit_length() - 1
        self.structs = (_TargetLayer * len(layers))(
            *[
                _TargetLayer(
                    *_products(w),
                    _ptr(w.down.bias),
                    _ptr(w.post_norm[0]),
                    _ptr(w.next_norm[0]),
                    w.post_norm[1],
                    w.next_norm[1],
                    _block_types(w),
                )
                for w in layers
            ]
        )
        self._pools: tuple[int, int, object, object] | None = None

    def _pool_ptrs(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[object, object]:
        """Each layer's cache pointers, built once per pair of caches."""
        key = (k_cache.data_ptr(), v_cache.data_ptr())
        if self._pools is None or self._pools[:2] != key:
            arr = ctypes.c_void_p * len(self.structs)
            ks = arr(*[k_cache[i].data_ptr() for i in range(len(self.structs))])
            vs = arr(*[v_cache[i].data_ptr() for i in range(len(self.structs))])
            self._pools = (*key, ks, vs)
        return self._pools[2], self._pools[3]

    def __call__(
        self,
        h: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        scale: float,
        tap_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [T, d] (the embedded rows, contiguous; updated in place: the residual stream);
        k_cache / v_cache [L, Hkv, num_slots, D] (head-major, contiguous); cos / sin [T, D]
        contiguous (rotate_half's sign folded into sin); slots [T] int64; segments: row0, n,
        start [G] and the block table [G, max_blocks], int32 (the causal pieces). tap_layers:
        distinct layers whose states to copy out (-1: the embeddings; the last layer: the
        final-normed output). -> (the final-normed output [T, d], the tap states concatenated
        in tap_layers' order [T, len(tap_layers) * d] or None)."""
        T, L = h.shape[0], len(self.structs)
        cols = [-1] * (L + 1)
        for j, li in enumerate(tap_layers):
            cols[li + 1] = j
        taps = h.new_empty(T, len(tap_layers) * self.d) if tap_layers else None
        x = torch.empty_like(h)
        ks, vs = self._pool_ptrs(k_cache, v_cache)
        rc = self.fn(
            ctypes.addressof(self.structs),
            L,
            int(self.dtype == torch.bfloat16),
            ks,
            vs,
            k_cache.shape[2],
            h.data_ptr(),
            x.data_ptr(),
            self.first[0].data_ptr(),
            self.first[1],
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            *_segment_args(segments),
            self.block_shift,
            T,
            *self._sizes(scale),
            (ctypes.c_int32 * (L + 1))(*cols),
            None if taps is None else taps.data_ptr(),
            len(tap_layers),
            int(self.invariant),
        )
        if rc != 0:
            raise MemoryError("target_layers could not allocate its work buffers")
        return x, taps
