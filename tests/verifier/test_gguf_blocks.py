"""The target served from GGUF blocks (verifier/gguf_blocks.py, `--weights`): the embedded file's
products read in place and checked against the loaded weights, llama.cpp's q/k row order undone,
damaged files and mismatched blocks refused with the file named, the weights choice, and the
engine on blocks: speculative output equal to plain output, and plain output equal to the
float32 model's."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from dspark_serve.ops import cpu_kernels
from dspark_serve.ops.platform import cpu_flags
from dspark_serve.ops.quant_kernels import QuantLinear, QuantMatrix
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from dspark_serve.verifier.config import ModelConfig
from dspark_serve.verifier.forward import ModelParts
from dspark_serve.verifier.gguf_blocks import (
    GgufFile,
    LayerBlocks,
    ModelBlocks,
    check_blocks,
    read_gguf_blocks,
    rotary_row_order,
)
from dspark_serve.verifier.loader import choose_weights, embedded_gguf_path, load_target
from dspark_serve.verifier.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    cpu_kernels.find_compiler() is None, reason="the block kernels need a C compiler"
)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target():
    return load_target(None, "cpu", "float32")


@pytest.fixture(scope="module")
def blocks(target):
    return read_gguf_blocks(embedded_gguf_path(), ModelParts.of(target.model))


def test_rotary_row_order_undoes_llama_cpp_permutation():
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) stores q/k rows as
    w.reshape(heads, 2, rows // heads // 2, K).swapaxes(1, 2)."""
    for rows, heads in ((64, 4), (24, 3), (576, 9)):
        w = np.arange(rows * 5).reshape(rows, 5)
        stored = w.reshape(heads, 2, rows // heads // 2, 5).swapaxes(1, 2).reshape(rows, 5)
        assert np.array_equal(stored[rotary_row_order(rows, heads).numpy()], w)


def test_embedded_file_is_served_from_its_own_blocks(target, blocks):
    parts = ModelParts.of(target.model)
    assert len(blocks.layers) == parts.num_layers and not blocks.in_floats
    kinds = {m.type for m in blocks.matrices()}
    assert kinds == {"Q4_1", "Q8_0"} and blocks.head is not None and blocks.head.type == "Q8_0"
    d = parts.hidden_size
    assert blocks.layers[0].qkv is not None and blocks.layers[0].qkv.K == d
    assert "Q4_1 x120" in blocks.describe()


def test_blocks_that_do_not_match_the_model_are_refused(target, blocks):
    parts = ModelParts.of(target.model)
    qkv = blocks.layers[3].qkv
    assert qkv is not None
    swapped = qkv.take_rows(torch.cat([torch.tensor([1, 0]), torch.arange(2, qkv.N)]))
    bad = ModelBlocks(
        [
            *blocks.layers[:3],
            LayerBlocks(swapped, *[blocks.layers[3].get(p) for p in ("o", "gate_up", "down")]),
            *blocks.layers[4:],
        ],
        blocks.head,
        "test",
    )
    with pytest.raises(ValueError, match="layer 3 qkv"):
        check_blocks(bad, parts)


def test_damaged_files_are_errors_naming_the_file(tmp_path):
    src = embedded_gguf_path()
    cut = tmp_path / "cut.gguf"
    with src.open("rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="cut.gguf"):
        GgufFile(cut)
    short = tmp_path / "short.gguf"  # only the last tensor's end missing
    with src.open("rb") as f:
        short.write_bytes(f.read()[:-100])
    with pytest.raises(ValueError, match="short.gguf"):
        GgufFile(short)
    with pytest.raises(ValueError, match="short.gguf"):
        load_target(str(short), "cpu", "float32", cache_dir=tmp_path / "cache")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ValueError, match="junk.gguf"):
        GgufFile(junk)


def test_an_unsupported_architecture_is_an_error_naming_it(tmp_path):
    import gguf

    from dspark_serve.verifier.loader import check_gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="other.gguf: architecture 'gpt2' is not supported"):
        check_gguf(path)
    with pytest.raises(ValueError, match="other.gguf"):
        load_target(str(path), "cpu", "float32", cache_dir=tmp_path / "cache")


AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
ZEN4 = AVX2 | {"avx512f", "avx512_bf16"}


def test_weights_choice(tmp_path):
    auto = choose_weights("auto", "auto", CPU, None, flags=AVX2)
    assert auto.kind == "gguf" and auto.dtype.dtype == torch.float32 and auto.gguf == embedded_gguf_path()
    # native bf16: dense bf16 stays the default, float32 asked for is served from the blocks
    native = choose_weights("auto", "auto", CPU, None, flags=ZEN4)
    assert (
        native.kind == "dense" and native.dtype.dtype == torch.bfloat16 and "--weights gguf" in native.reason
    )
    assert choose_weights("auto", "float32", CPU, None, flags=ZEN4).kind == "gguf"
    assert choose_weights("gguf", "auto", CPU, None, flags=ZEN4).kind == "gguf"
    assert choose_weights("auto", "bfloat16", CPU, None, flags=AVX2).kind == "dense"  # a dtype asked for
    assert choose_weights("auto", "auto", CPU, None, fast_forward=False, flags=AVX2).kind == "dense"
    assert choose_weights("auto", "auto", CPU, None, flags=frozenset({"sse4_2"})).kind == "dense"
    assert choose_weights("bf16", "auto", CPU, None).dtype.dtype == torch.bfloat16
    assert choose_weights("q8_0", "auto", CPU, str(tmp_path)).kind == "q8_0"
    with pytest.raises(ValueError, match="needs a .gguf model"):
        choose_weights("gguf", "auto", CPU, str(tmp_path))
    with pytest.raises(ValueError, match="for CPUs"):
        choose_weights("gguf", "auto", torch.device("cuda"), None)
    copy = tmp_path / "m.gguf"
    shutil.copy(embedded_gguf_path(), copy)
    assert choose_weights("auto", "auto", CPU, str(copy), flags=AVX2).gguf == copy


def test_without_a_compiler_auto_stays_dense_and_a_failed_build_leaves_the_products_dense(monkeypatch):
    """The weights choice asks for a compiler (a first start builds the kernels beside the model
    load and must not wait for them); where the build then fails, the products stay dense."""
    from types import SimpleNamespace

    from dspark_serve.ops import cpu_kernels
    from dspark_serve.scheduler import builder

    monkeypatch.setattr(cpu_kernels, "find_compiler", lambda: None)
    assert "no C compiler" in choose_weights("auto", "auto", CPU, None, flags=AVX2).reason
    monkeypatch.undo()
    chosen = choose_weights("auto", "auto", CPU, None, flags=AVX2)
    assert chosen.kind == "gguf"
    monkeypatch.setattr(builder, "load_kernels", lambda: None)
    assert builder.target_blocks(chosen, SimpleNamespace(model=None)) is None


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"weights": "int4"}, "weights must be"),
        ({"weights": "gguf", "dtype": "bfloat16"}, "float32 activations"),
        ({"weights": "bf16", "dtype": "float32"}, "contradicts"),
        ({"weights": "q8_0", "forward": "reference"}, "forward 'fast'"),
    ],
)
def test_weights_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Explain why the sky is blue.",
    "Write a haiku about the sea.",
]


def _greedy(runner, tok, ids, spec_block: int = 0):
    from dspark_serve.drafter.ngram import NgramConfig, NgramDrafter

    drafter = NgramDrafter(NgramConfig(block_size=spec_block)) if spec_block else None
    sched = SchedulerConfig(max_num_seqs=4, verify_policy=f"static:{spec_block}" if spec_block else "auto")
    eng = Engine(runner, tok, sched, max_model_len=512, drafter=drafter)
    reqs = [
        Request(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True)
        for i, p in enumerate(ids)
    ]
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    return [r.output_ids for r in reqs]


def test_engine_on_blocks_speculative_equals_plain_and_the_float_model(target, blocks):
    tok = target.tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    dense = _greedy(ModelRunner(target.model, num_blocks=64, block_size=16), tok, ids)
    fresh = load_target(None, "cpu", "float32").model
    runner = ModelRunner(fresh, num_blocks=64, block_size=16, blocks=blocks)
    assert "gguf" in runner.describe() and runner.released_bytes > 0
    assert all(isinstance(p, QuantLinear) for p in runner.forward_impl.weights.products())  # type: ignore[attr-defined]
    plain = _greedy(runner, tok, ids)
    assert _greedy(runner, tok, ids, spec_block=4) == plain  # exact by construction
    assert plain == dense
    if "fma" in cpu_flags():  # the float32 gemm's order of sums: the same logits, bit for bit
        from dspark_serve.verifier.forward import Segment

        seg = Segment("a", ids[1], 0, 0, list(range(4)))
        dense_runner = ModelRunner(target.model, num_blocks=64, block_size=16)
        assert torch.equal(runner.forward([seg]).logits, dense_runner.forward([seg]).logits)


def test_q8_0_made_at_load_serves_and_rounds_only_the_weights(target):
    from dspark_serve.verifier.gguf_blocks import quantize_blocks

    parts = ModelParts.of(target.model)
    made = quantize_blocks(parts, "Q8_0")
    assert {m.type for m in made.matrices()} == {"Q8_0"}
    layer0 = made.layers[0].o
    assert isinstance(layer0, QuantMatrix)
    w = parts.layers[0].self_attn.o_proj.weight
    step = w.abs().amax(dim=1, keepdim=True) / 127  # at most half a step per weight per block
    assert (layer0.dequantize() - w).abs().le(step).all()
