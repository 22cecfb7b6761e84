"""The batch-invariant forward (`ModelConfig.batch_invariant`): a row's logits are the same bits
whatever shares its forward, in bf16 too: its kernels (the gemm at every row count, each query
row's attention) and the whole target over decode, verify, chunked prefill, a recompute and
other requests' segments of other lengths."""

from __future__ import annotations

import pytest
import torch

from dspark_serve.ops.cpu_kernels import PagedAttention, load_kernels
from dspark_serve.ops.linear import make_linear
from dspark_serve.ops.triton_linear import InvariantTritonLinear
from dspark_serve.verifier.config import ModelConfig
from dspark_serve.verifier.model_runner import ModelRunner
from tests.helpers import paged_segments_runner, tiny_model
from tests.kv_tables import Tables
from tests.triton_interpreter import each_dtype, needs_triton


def needs_kernels():
    if load_kernels() is None:
        pytest.skip("the batch-invariant forward needs the C kernels (a C compiler)")


@pytest.mark.parametrize("K", [64, 576, 200])  # 200: not a multiple of 32 (no AMX tiles)
def test_gemm_rows_do_not_depend_on_the_row_count(K):
    """Every row count, through every path the default takes by size (the AVX512 path, AMX tiles
    of 1-5 chunks, oneDNN past 128 rows), gives each row the bits it has alone."""
    needs_kernels()
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(200, K, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(200, generator=g).to(torch.bfloat16)
    x = torch.randn(300, K, generator=g).to(torch.bfloat16)
    lin = make_linear(w, b, "auto", "none", invariant=True)
    wide = make_linear(w, b, "auto", "none", invariant=True, float_out=True)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(40)])
    alone_wide = torch.cat([wide(x[i : i + 1]) for i in range(40)])
    assert alone_wide.dtype == torch.float32
    assert torch.equal(alone_wide.to(torch.bfloat16), alone)  # the same sums, rounded once
    for M in (2, 4, 5, 8, 15, 16, 17, 33, 80, 81, 129, 300):
        n = min(M, 40)
        assert torch.equal(lin(x[:M])[:n], alone[:n]), M
        assert torch.equal(wide(x[:M])[:n], alone_wide[:n]), M
    # a strided input (a view of a wider buffer) takes the kernel too
    assert torch.equal(lin(torch.cat([x[:9], x[:9]], dim=1)[:, :K]), lin(x[:9]))
    y = lin(x[:3])
    ref = torch.nn.functional.linear(x[:3].float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("D", [64, 128, 16])  # 16: the generic body (no AVX512 tile shapes)
def test_bf16_attention_rows_do_not_depend_on_what_shares_the_call(D):
    """A bf16 query row's output is the same bits as the decode step at its position, as a row
    of a verify block, of a long prefill chunk, and among other segments of other lengths."""
    needs_kernels()
    lib = load_kernels()
    H, Hkv, bs, nblocks = 8, 2, 16, 64
    kern = PagedAttention(lib, H, Hkv, D, bs, invariant=True)
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(Hkv, nblocks * bs, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(Hkv, nblocks * bs, D, generator=g).to(torch.bfloat16)
    run = paged_segments_runner(kern, kc, vc, D**-0.5)

    blocks = torch.randperm(nblocks, generator=g)[:40].tolist()
    for s0, n in ((181, 7), (0, 48), (300, 40)):  # a verify block; prefill chunks from 0 and later
        q = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
        block = run([(s0, n, blocks)], q)
        assert not block.isnan().any()
        for i in range(n):  # each row alone, as the decode step at its position
            assert torch.equal(run([(s0 + i, 1, blocks)], q[i : i + 1].clone()), block[i : i + 1]), (s0, i)
        others = [(37, 1, blocks[:3]), (90, 4, blocks[5:12]), (250, 33, blocks[1:22])]
        q_others = torch.randn(38, H, D, generator=g).to(torch.bfloat16)
        mixed = run([others[0], (s0, n, blocks), *others[1:]], torch.cat([q_others[:1], q, q_others[1:]]))
        assert torch.equal(mixed[1 : 1 + n], block)
    # the default is another order of sums for many rows (bf16 probabilities for the values)
    default = PagedAttention(lib, H, Hkv, D, bs)
    assert default.flags == 0 and kern.flags != 0


def invariant_runner(kind: str, head_dim: int, dtype=torch.bfloat16, attention: str = "auto") -> ModelRunner:
    model = tiny_model(kind, layers=2, dtype=dtype, head_dim=head_dim)
    return ModelRunner(
        model, num_blocks=96, block_size=4, impl="fast", attention=attention, batch_invariant=True
    )


def forward_rows(
    runner: ModelRunner, plan: list[list[tuple[str, list[int], int]]]
) -> dict[tuple[str, int], torch.Tensor]:
    """Runs `plan` (a list of steps, each a list of (request, tokens, start position)) and returns
    every position's logits row by (request, position)."""
    tables = Tables.of(runner)
    rows: dict[tuple[str, int], torch.Tensor] = {}
    for step in plan:
        segs = []
        for rid, toks, start in step:
            tables.blocks.append(rid, start + len(toks) - tables.blocks.num_tokens(rid))
            segs.append(tables.segment(rid, toks, start, 0))
        out = runner.forward(segs)
        for i, (rid, toks, start) in enumerate(step):
            for j in range(len(toks)):
                rows[(rid, start + j)] = out.logits[out.logits_offsets[i] + j].clone()
    return rows


def plans() -> list[list[list[tuple[str, list[int], int]]]]:
    """One request's 49 positions computed five ways: decode, verified blocks, chunked prefill,
    one whole prefill (a recompute after preemption), and steps shared with another request."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (37,), generator=g).tolist()
    cont = torch.randint(0, 256, (12,), generator=g).tolist()
    other = torch.randint(0, 256, (29,), generator=g).tolist()
    seq = prompt + cont
    decode = [[("a", prompt, 0)]] + [[("a", [t], 37 + i)] for i, t in enumerate(cont)]
    verify = [[("a", prompt, 0)], [("a", cont[:5], 37)], [("a", cont[5:], 42)]]
    chunked = [[("a", seq[i : i + 5], i)] for i in range(0, len(seq), 5)]
    whole = [[("a", seq, 0)]]
    shared = [  # beside another request's prefill, decodes and a verify block of other lengths
        [("b", other[:20], 0), ("a", prompt[:16], 0)],
        [("a", prompt[16:], 16), ("b", other[20:], 20)],
        [("b", [3], 29), ("a", cont[:7], 37)],
        [("a", cont[7:], 44), ("b", [4, 5, 6], 30)],
    ]
    return [decode, verify, chunked, whole, shared]


def same_logits_every_way(make_runner) -> None:
    results = []
    for plan in plans():
        rows = forward_rows(make_runner(), plan)
        results.append(torch.stack([rows[("a", p)] for p in range(49)]))
    assert results[0].dtype == torch.float32  # float32 logits from the LM head
    for r in results[1:]:
        assert torch.equal(r, results[0])


@pytest.mark.parametrize("kind,head_dim", [("llama", 64), ("qwen2", 64), ("qwen3", 64), ("llama", 16)])
def test_bf16_logits_are_the_same_bits_however_a_position_is_computed(kind, head_dim):
    """Decode, a verified block, chunked prefill, one whole prefill (a recompute after
    preemption) and a step shared with other requests give every position the same logits."""
    needs_kernels()
    same_logits_every_way(lambda: invariant_runner(kind, head_dim))


@pytest.mark.slow  # interpreted: the full suite
@each_dtype
def test_triton_forward_logits_are_the_same_bits_however_a_position_is_computed(dtype):
    """The CUDA path's batch-invariant forward (Triton attention in one tile shape, the Triton
    matmul for every product), here under Triton's interpreter."""
    needs_triton()
    runner = invariant_runner("llama", 16, dtype=dtype, attention="triton")
    assert isinstance(runner.forward_impl.weights.lm_head, InvariantTritonLinear)
    same_logits_every_way(lambda: invariant_runner("llama", 16, dtype=dtype, attention="triton"))


def test_the_mode_is_described_and_its_logits_are_float32():
    needs_kernels()
    runner = invariant_runner("llama", 64)
    assert "batch-invariant" in runner.describe()
    assert runner.forward_impl.weights.lm_head.out_dtype == torch.float32


def test_batch_invariant_is_refused_where_it_cannot_hold():
    for bad in (
        dict(forward="reference"),
        dict(quantize="int8"),
        dict(linear="mkldnn"),
        dict(attention="sdpa"),
    ):
        with pytest.raises(ValueError, match="batch_invariant"):
            ModelConfig(batch_invariant=True, **bad)
    with pytest.raises(ValueError, match="batch-invariant"):
        make_linear(torch.zeros(4, 4), None, "torch", "none", invariant=True)
