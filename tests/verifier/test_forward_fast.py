"""The fast forward against the reference forward and transformers (greedy, float32), its paged
attention against a dense reference on random block layouts, its fallbacks and int8 option."""

import random

import pytest
import torch

import dspark_serve.ops.cpu_kernels as kernels
import dspark_serve.ops.linear as ops_linear
from dspark_serve.ops.cpu_kernels import PagedAttention, float32_attention_row_invariant, load_kernels
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from dspark_serve.verifier.attention import matmul_attention
from dspark_serve.verifier.config import ModelConfig
from dspark_serve.verifier.model_runner import ModelRunner
from tests.helpers import ByteTokenizer, dense_attention, hf_greedy, paged_segments_runner, tiny_model
from tests.kv_tables import Tables
from tests.triton_interpreter import needs_triton

GREEDY = SamplingParams(temperature=0.0)


def engine_outputs(model, prompts, max_tokens, **runner_kw):
    runner = ModelRunner(model, num_blocks=128, block_size=4, **runner_kw)
    eng = Engine(
        runner, ByteTokenizer(), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40), max_model_len=512
    )
    reqs = [
        Request(f"r{i}", p, GREEDY, max_tokens=max_tokens, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    for r in reqs[:2]:
        eng.add_request(r)
    steps = 0
    while eng.has_work() or steps < 3:
        if steps == 2:  # late arrivals join running decodes
            for r in reqs[2:]:
                eng.add_request(r)
        eng.step()
        steps += 1
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    return [r.output_ids for r in reqs]


def needs_paged_kernel():
    if load_kernels() is None:
        pytest.skip("the paged attention kernel needs a C compiler")


FORWARD_CASES = [
    (kind, linear, attention)
    for kind in ("llama", "qwen2", "qwen3")
    for linear, attention in (("torch", "sdpa"), ("auto", "sdpa"), ("auto", "auto"))
] + [pytest.param(kind, "torch", "triton", marks=pytest.mark.slow) for kind in ("llama", "qwen3")]
# (interpreted: the full suite; the quick loop's CUDA-path engine checks are test_host_syncs' and
# test_cuda_graphs'; qwen2 adds only biases)


@pytest.mark.parametrize("kind,linear,attention", FORWARD_CASES)
def test_fast_forward_greedy_equals_reference_and_generate(kind, linear, attention):
    """attention auto is the paged C kernel where a compiler is found (as on a user's CPU);
    triton runs the CUDA path's kernels (attention, fused elementwise) under Triton's
    interpreter, on a Llama and a Qwen3 (q/k norms) target."""
    if attention == "triton":
        needs_triton()
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(3)
    # no token 0: hf_greedy passes pad_token_id=0, and generate would mask it out of the prompt
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 45, 17, 70)]
    ref = engine_outputs(tiny_model(kind), prompts, 14, impl="reference")
    fast = engine_outputs(model, prompts, 14, impl="fast", linear=linear, attention=attention)
    assert fast == ref
    for p, out in zip(prompts, fast):
        assert out == hf_greedy(model, p, 14)


def test_fast_logits_close_to_reference_with_taps():
    model = tiny_model("qwen3", layers=3)
    runners = [
        ModelRunner(tiny_model("qwen3", layers=3), 64, 4, impl="reference"),
        ModelRunner(model, 64, 4, impl="fast"),
    ]
    outs = []
    for r in runners:
        Tables.of(r).blocks.append("a", 37)
        Tables.of(r).blocks.append("b", 5)
        segs = [
            Tables.of(r).segment("a", list(range(37)), 0, 30),
            Tables.of(r).segment("b", [7, 8, 9, 10, 11], 0, 4),
        ]
        first = r.forward(segs, tap_layers=(-1, 1, 2))
        Tables.of(r).blocks.append("a", 3)
        Tables.of(r).blocks.append("b", 1)
        second = r.forward(
            [Tables.of(r).segment("a", [1, 2, 3], 37, 0), Tables.of(r).segment("b", [4], 5, 0)],
            tap_layers=(0, 2),
        )
        outs.append((first, second))
    for a, b in zip(*outs):
        assert a.logits_offsets == b.logits_offsets and a.token_offsets == b.token_offsets
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ordered", [False, True], ids=["shuffled-pool", "ordered-pool"])
# (triton interpreted: the full suite; the quick loop checks the kernel in tests/ops)
@pytest.mark.parametrize(
    "attention", ["sdpa", "matmul", "paged", pytest.param("triton", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense_reference_on_random_layouts(block_size, attention, ordered):
    """Shuffled pool: block tables are not contiguous (every segment gathers its blocks).
    Ordered pool with one segment a step now and then: a lone segment on consecutive blocks
    is read in place, with exactly its keys (no mask for one query). The paged C kernel reads
    every segment in place, whatever its layout and length (prefill chunks in pieces)."""
    if attention == "paged":
        needs_paged_kernel()
    if attention == "triton":
        needs_triton()
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    model = tiny_model("llama")
    runner = ModelRunner(model, num_blocks=512 // block_size + 8, block_size=block_size, attention=attention)
    assert runner.forward_impl.attention == attention
    if not ordered:
        rng.shuffle(Tables.of(runner).blocks._free)  # block tables are not contiguous
    in_place = 0
    H, Hkv, D = runner.parts.num_heads, runner.parts.num_kv_heads, runner.parts.head_dim
    li = 1
    runner.kv.k.normal_()  # stale garbage in every slot
    runner.kv.v.normal_()
    hist = {f"q{i}": (torch.empty(0, Hkv, D), torch.empty(0, Hkv, D)) for i in range(5)}
    for step in range(14):
        segs = []
        alone = ordered and step % 2 == 1
        for rid in rng.sample(sorted(hist), 1 if alone else rng.randint(1, len(hist))):
            have = hist[rid][0].shape[0]
            n = rng.choice([1, 1, 2, 5, 8, 33, 40]) if have else rng.choice([3, 35, 50])
            Tables.of(runner).blocks.append(rid, n)
            segs.append(Tables.of(runner).segment(rid, [0] * n, have, 0))
        T = sum(len(s.token_ids) for s in segs)
        q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
        plan = runner.forward_impl.plan(segs)
        in_place += plan.g_first >= 0
        if attention == "triton":  # every segment in one launch
            assert not plan.big and plan.g_count == 0 and plan.varlen is not None
        if attention == "paged":  # prefill chunks (33-50 tokens, at 0 or mid-sequence) too
            assert not plan.big and plan.p_segments is not None
            assert int(plan.p_segments[1].sum()) == sum(len(s.token_ids) for s in segs)
        out = runner.forward_impl.attend(li, q, k, v, plan)
        r0 = 0
        for s in segs:
            n = len(s.token_ids)
            kh = torch.cat([hist[s.request_id][0], k[r0 : r0 + n]])
            vh = torch.cat([hist[s.request_id][1], v[r0 : r0 + n]])
            want = dense_attention(q[r0 : r0 + n], kh, vh, s.start_pos, runner.parts.scaling)
            torch.testing.assert_close(out[r0 : r0 + n].double(), want, rtol=1e-4, atol=1e-4)
            hist[s.request_id] = (kh, vh)
            r0 += n
        # roll back part of some requests (rejected drafts), sometimes across a block boundary
        for rid in rng.sample(sorted(hist), 2):
            have = hist[rid][0].shape[0]
            if have > 2:
                keep = rng.randint(1, have - 1)
                Tables.of(runner).blocks.truncate(rid, keep)
                hist[rid] = (hist[rid][0][:keep], hist[rid][1][:keep])
        # and, now and then, a finished request frees its blocks and a new one reuses them
        if step % 5 == 4:
            victim = rng.choice(sorted(hist))
            Tables.of(runner).blocks.free(victim)
            hist[victim] = (torch.empty(0, Hkv, D), torch.empty(0, Hkv, D))
    tables = [Tables.of(runner).blocks.table(r).blocks for r in hist if Tables.of(runner).blocks.has(r)]
    if ordered and attention not in ("paged", "triton"):
        assert in_place > 0
    else:
        assert any(any(b - a != 1 for a, b in zip(t, t[1:])) for t in tables if len(t) > 1)


def test_torch_linear_fallback_when_onednn_is_unavailable(monkeypatch):
    monkeypatch.setattr("dspark_serve.ops.linear.mkldnn_linear_works", lambda dtype, device: False)
    monkeypatch.setattr("dspark_serve.ops.cpu_kernels.load_kernels", lambda: None)  # no C kernel
    model = tiny_model("qwen2")
    runner = ModelRunner(model, 64, 4, impl="fast", linear="auto")
    assert runner.forward_impl.weights.linear_kind == "torch" and "torch" in runner.describe()
    with pytest.raises(ValueError, match="mkldnn"):
        ModelRunner(tiny_model("qwen2"), 64, 4, impl="fast", linear="mkldnn")
    prompt = list(range(40, 60))
    eng = Engine(runner, ByteTokenizer(), SchedulerConfig(), max_model_len=256)
    r = Request("x", prompt, GREEDY, 10, ignore_eos=True)
    eng.add_request(r)
    while eng.has_work():
        eng.step()
    assert r.output_ids == hf_greedy(model, prompt, 10)


@pytest.mark.skipif(
    not ops_linear.mkldnn_linear_works(torch.float32, torch.device("cpu")), reason="no oneDNN"
)
def test_auto_picks_onednn_on_cpu_and_reference_uses_modules(monkeypatch):
    from dspark_serve.ops.cpu_kernels import load_kernels

    # the C kernel where it builds, oneDNN where it does not
    assert ModelRunner(tiny_model("llama"), 64, 4).forward_impl.weights.linear_kind == (
        "gemm" if load_kernels() else "mkldnn"
    )
    monkeypatch.setattr("dspark_serve.ops.cpu_kernels.load_kernels", lambda: None)
    assert ModelRunner(tiny_model("llama"), 64, 4).forward_impl.weights.linear_kind == "mkldnn"
    assert ModelRunner(tiny_model("llama"), 64, 4, impl="reference").describe() == "reference"


def test_bfloat16_fast_forward_runs_and_tracks_reference():
    ref = ModelRunner(tiny_model("qwen3", dtype=torch.bfloat16), 64, 4, impl="reference")
    fast = ModelRunner(tiny_model("qwen3", dtype=torch.bfloat16), 64, 4, impl="fast")
    outs = []
    for r in (ref, fast):
        Tables.of(r).blocks.append("a", 20)
        outs.append(r.forward([Tables.of(r).segment("a", list(range(20)), 0, 0)]).logits)
    assert outs[1].dtype == torch.bfloat16  # left in the model's dtype: a greedy verdict is the argmax
    # bf16 is not batch-invariant: close, and the same argmax nearly everywhere
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 0.9


def test_int8_weights_change_little_and_are_opt_in():
    model = tiny_model("llama")
    float_runner = ModelRunner(tiny_model("llama"), 64, 4)
    q_runner = ModelRunner(model, 64, 4, quantize="int8")
    assert "int8" in q_runner.describe() and "int8" not in float_runner.describe()
    outs = []
    for r in (float_runner, q_runner):
        Tables.of(r).blocks.append("a", 30)
        outs.append(r.forward([Tables.of(r).segment("a", list(range(30)), 0, 0)]).logits)
    assert not torch.equal(outs[0], outs[1])  # the target did change ...
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1)
    assert cos.min() > 0.98  # ... but only a little
    with pytest.raises(ValueError, match="int8"):
        ModelRunner(tiny_model("llama"), 64, 4, impl="reference", quantize="int8")


@pytest.mark.parametrize("field,value", [("forward", "fastest"), ("linear", "blas"), ("quantize", "int4")])
def test_model_config_rejects_bad_kernel_choices(field, value):
    with pytest.raises(ValueError, match=repr(value)):
        ModelConfig(**{field: value})
    with pytest.raises(ValueError, match="'reference'"):
        ModelConfig(forward="reference", quantize="int8")


def test_attention_auto_picks_the_paged_kernel_on_cpu_and_falls_back_without_it(monkeypatch):
    if load_kernels() is not None:
        for dtype in (torch.float32, torch.bfloat16):
            r = ModelRunner(tiny_model("qwen3", dtype=dtype), 64, 4)
            assert r.forward_impl.attention == "paged" and "attention paged" in r.describe()
        assert not ModelRunner(tiny_model("llama"), 64, 4, impl="reference").forward_impl.uses_c_kernels()
        assert ModelRunner(tiny_model("qwen3", dtype=torch.float16), 64, 4).forward_impl.attention == "matmul"
        assert (
            ModelRunner(tiny_model("llama"), 64, 3).forward_impl.attention == "sdpa"
        )  # block size not a power of two
        with pytest.raises(ValueError, match="power-of-two"):
            ModelRunner(tiny_model("llama"), 64, 3, attention="paged")
    # a machine without a C compiler keeps torch's kernels (and refuses an explicit "paged")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.setattr(kernels, "_loaded", {})
    assert ModelRunner(tiny_model("llama"), 64, 4).forward_impl.attention == "sdpa"
    bf16 = ModelRunner(tiny_model("qwen3", dtype=torch.bfloat16), 64, 4)
    assert bf16.forward_impl.attention == "matmul" and "attention matmul" in bf16.describe()
    with pytest.raises(ValueError, match="no compiler"):
        ModelRunner(tiny_model("llama"), 64, 4, attention="paged")
    with pytest.raises(ValueError, match="'flash'"):
        ModelRunner(tiny_model("llama"), 64, 4, attention="flash")
    with pytest.raises(ValueError, match="'flash'"):
        ModelConfig(attention="flash")


def test_triton_attention_is_refused_where_it_cannot_run(monkeypatch):
    """Never chosen by auto; asked for on a CPU without Triton's interpreter, an error that says
    what it needs (no silent fallback to another kernel)."""
    assert ModelRunner(tiny_model("llama"), 64, 4).forward_impl.attention != "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton' needs Triton .* and a CUDA device, got cpu"):
        ModelRunner(tiny_model("llama"), 64, 4, attention="triton")


def test_matmul_attention_greedy_matches_sdpa_in_bf16_closely():
    """bf16 is not batch-invariant, so the two kernels are compared on logits, not held to bit
    equality: the decode logits agree within bf16 rounding."""
    outs = []
    for attention in ("sdpa", "matmul"):
        r = ModelRunner(tiny_model("qwen3", dtype=torch.bfloat16), 64, 4, attention=attention)
        Tables.of(r).blocks.append("a", 9)
        Tables.of(r).blocks.append("b", 4)
        r.forward(
            [
                Tables.of(r).segment("a", list(range(1, 10)), 0, 9),
                Tables.of(r).segment("b", [5, 6, 7, 8], 0, 4),
            ]
        )
        Tables.of(r).blocks.append("a", 3)
        Tables.of(r).blocks.append("b", 1)
        outs.append(
            r.forward(
                [Tables.of(r).segment("a", [1, 2, 3], 9, 0), Tables.of(r).segment("b", [4], 4, 0)]
            ).logits
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24])  # scale 1/4 (exact, folded into q) and 1/sqrt(24)
def test_matmul_attention_matches_dense_on_cache_views(head_dim, dtype):
    """k/v are views into a head-major pool (batch stride = the whole pool, as a lone segment
    read in place gives), queries padded and masked by an additive bias; the folded power-of-two scale and the
    float32 scaling path both agree with a dense float64 softmax attention."""
    torch.manual_seed(head_dim)
    G, Q, H, Hkv, C = 2, 3, 6, 2, 13
    scale = head_dim**-0.5
    pool_k = torch.randn(Hkv, 200, head_dim).to(dtype)
    pool_v = torch.randn(Hkv, 200, head_dim).to(dtype)
    k = pool_k[:, 50 : 50 + G * C].view(Hkv, G, C, head_dim)
    v = pool_v[:, 50 : 50 + G * C].view(Hkv, G, C, head_dim)
    q = torch.randn(G, Q, H, head_dim).to(dtype)
    mask = torch.rand(G, 1, Q, C) < 0.7
    mask[..., 0] = True
    bias = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    out = matmul_attention(q, k, v, bias, scale)
    assert out.shape == (G, Q, H, head_dim) and out.dtype == dtype
    kd, vd = k.double(), v.double()
    for g in range(G):
        for h in range(H):
            s = q[g, :, h].double() @ kd[h // (H // Hkv), g].T * scale
            s = s.masked_fill(~mask[g, 0], float("-inf"))
            want = s.softmax(-1) @ vd[h // (H // Hkv), g]
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out[g, :, h].double(), want, rtol=tol, atol=tol)
    everything = torch.zeros(G, 1, Q, C, dtype=dtype)
    assert torch.equal(matmul_attention(q, k, v, None, scale), matmul_attention(q, k, v, everything, scale))


def test_rms_norm_float32_is_functional_rms_norm_and_bf16_mirrors_layer_norm():
    torch.manual_seed(0)
    w = torch.rand(48) + 0.5
    x = torch.randn(5, 48) * 3
    f32 = ops_linear.FastRMSNorm(w, 1e-6)
    assert f32.w2 is None and torch.equal(f32(x), torch.nn.functional.rms_norm(x, (48,), w, 1e-6))
    bf = ops_linear.FastRMSNorm(w.bfloat16(), 1e-6)
    assert bf.w2 is not None  # LayerNorm over [x, -x]: one fused kernel on CPU
    got = bf(x.bfloat16())
    assert got.shape == (5, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), f32(x.bfloat16().float()), rtol=1e-2, atol=1e-2)


def test_cuda_attention_leaves_out_cudnn_and_cpu_changes_nothing():
    """cuDNN's SDPA plans per input shape; serving shapes change every step (see
    ModelRunner.attention_backends). The switch is torch's global backend flags, so it can be
    checked without a GPU: only the flags inside the context change, and they are restored."""
    runner = ModelRunner(tiny_model("llama"), num_blocks=8, block_size=4)
    flags = torch.backends.cuda
    before = (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled())
    with runner.attention_backends():  # CPU: nothing changes
        assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled()) == before[:2]
    runner.device = torch.device("cuda")
    with runner.attention_backends():
        assert not flags.cudnn_sdp_enabled()
        assert flags.flash_sdp_enabled() and flags.mem_efficient_sdp_enabled() and flags.math_sdp_enabled()
    assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled()) == before


def test_paged_kernel_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    """A compiler that fails (or a broken cache entry) leaves the kernel out with a warning."""
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "find_compiler", lambda: "false")  # exits 1, compiles nothing
    assert load_kernels(tmp_path) is None
    assert "unavailable" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # 64 unrolled, 128 runtime D, 24 generic
@pytest.mark.parametrize("heads", [(4, 4), (12, 2)])  # per-head items and whole-group items
def test_paged_kernel_on_strided_queries_matches_dense(dtype, head_dim, heads):
    """The kernel alone: queries read through a token stride (a view of a fused qkv row), many or
    few segments, outputs rounded once to the dtype (bf16: within one rounding of float64)."""
    needs_paged_kernel()
    H, Hkv = heads
    bs, nblocks = 8, 64
    kern = PagedAttention(load_kernels(), H, Hkv, head_dim, bs)
    g = torch.Generator().manual_seed(head_dim + H)
    kc = torch.randn(Hkv, nblocks * bs, head_dim, generator=g).to(dtype)
    vc = torch.randn(Hkv, nblocks * bs, head_dim, generator=g).to(dtype)
    for segs in ([(0, 1), (13, 5), (40, 32), (7, 1)], [(s, 1) for s in range(0, 90, 7)]):
        T = sum(n for _, n in segs)
        fused = torch.randn(T, (H + 3) * head_dim, generator=g).to(dtype)
        q = fused[:, : H * head_dim].view(T, H, head_dim)  # token stride (H + 3) * head_dim
        nbs = [-(-(st + n) // bs) for st, n in segs]
        # any blocks of the pool, in any order (segments may even share one: reads only)
        table = torch.randint(0, nblocks, (len(segs), max(nbs)), generator=g, dtype=torch.int32)
        row0 = [sum(n for _, n in segs[:i]) for i in range(len(segs))]
        out = torch.full((T, H, head_dim), float("nan"), dtype=dtype)
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
        kern(q, kc, vc, out, i32(row0), i32([n for _, n in segs]), i32([s for s, _ in segs]), table, 0.3)
        for i, (st, n) in enumerate(segs):
            keys = torch.arange(st + n)
            slots = table[i, keys // bs].long() * bs + keys % bs
            keys_v = kc[:, slots].transpose(0, 1), vc[:, slots].transpose(0, 1)
            want = dense_attention(q[row0[i] : row0[i] + n], *keys_v, st, 0.3)
            got = out[row0[i] : row0[i] + n].reshape(n, -1).double()
            tol = 1e-5 if dtype == torch.float32 else 2**-7 * want.abs().clamp(min=1).max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("geometry", [(9, 3, 64), (8, 2, 128)])
def test_bf16_long_segments_alone_or_few_match_dense(geometry, causal):
    """bf16 segments of many query rows (a verify block, a prefill piece) when they are few:
    every query head of a kv head shares one pass over the keys, and a lone segment's tokens
    are split between items (each a later start with fewer tokens). Key counts odd and even, a
    partial last tile; the output within one bf16 rounding of float64 (the probabilities are
    rounded to bf16 for the value products)."""
    needs_paged_kernel()
    lib = load_kernels()
    H, Hkv, D = geometry
    bs, nblocks = 16, 48
    kern = PagedAttention(lib, H, Hkv, D, bs)
    g = torch.Generator().manual_seed(D + int(causal))
    kc = torch.randn(Hkv, nblocks * bs, D, generator=g).bfloat16()
    vc = torch.randn(Hkv, nblocks * bs, D, generator=g).bfloat16()
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    for segs in ([(181, 8)], [(0, 33)], [(40, 5), (7, 4)], [(100, 7)], [(3, 64)]):
        T = sum(n for _, n in segs)
        q = torch.randn(T, H, D, generator=g).bfloat16()
        nbs = [-(-(st + n) // bs) for st, n in segs]
        table = torch.stack([torch.randperm(nblocks, generator=g)[: max(nbs)] for _ in segs]).to(torch.int32)
        row0 = [sum(n for _, n in segs[:i]) for i in range(len(segs))]
        out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16)
        lens, starts = i32([n for _, n in segs]), i32([s for s, _ in segs])
        kern(q, kc, vc, out, i32(row0), lens, starts, table, 0.125, causal)
        for i, (st, n) in enumerate(segs):
            keys = torch.arange(st + n)
            slots = table[i, keys // bs].long() * bs + keys % bs
            k, v = kc[:, slots].transpose(0, 1), vc[:, slots].transpose(0, 1)
            qi = q[row0[i] : row0[i] + n]
            if causal:
                want = dense_attention(qi, k, v, st, 0.125)
            else:  # every query sees all st + n keys (the drafter's block)
                want = dense_attention(qi, k, v, st + n, 0.125)
            got = out[row0[i] : row0[i] + n].reshape(n, -1).double()
            tol = 2**-7 * want.abs().clamp(min=1).max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_float32_attention_rows_do_not_depend_on_what_shares_the_call():
    """Where the build says so (AVX2 + FMA), a float32 query row's output is the same bits alone
    (a decode segment of one token at its position), as one row of a verify block, and among
    other segments of other lengths: what makes float32 speculation bit-exact with plain
    decoding in the attention too."""
    needs_paged_kernel()
    lib = load_kernels()
    if not float32_attention_row_invariant(lib):
        pytest.skip("this CPU runs the generic float32 attention bodies")
    H, Hkv, D, bs, nblocks = 9, 3, 64, 16, 64
    kern = PagedAttention(lib, H, Hkv, D, bs)
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(Hkv, nblocks * bs, D, generator=g)
    vc = torch.randn(Hkv, nblocks * bs, D, generator=g)
    run = paged_segments_runner(kern, kc, vc, 0.125)

    blocks = torch.randperm(nblocks, generator=g)[:20].tolist()  # one request's blocks, anywhere
    s0, n = 181, 7  # a verify block of 7 rows at positions 181..187
    q = torch.randn(n, H, D, generator=g)
    block = run([(s0, n, blocks)], q)
    for i in range(n):  # each row alone, as the decode step at its position
        assert torch.equal(run([(s0 + i, 1, blocks)], q[i : i + 1].clone()), block[i : i + 1])
    others = [(37, 1, blocks[:3]), (90, 4, blocks[5:12]), (250, 1, blocks[1:18])]
    q_others = torch.randn(6, H, D, generator=g)
    mixed = run([others[0], (s0, n, blocks), *others[1:]], torch.cat([q_others[:1], q, q_others[1:]]))
    assert torch.equal(mixed[1 : 1 + n], block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a bias on q/k/v
def test_layers_in_one_c_call_equal_the_python_loop(kind, dtype):
    needs_paged_kernel()
    # gemm_rows 64: every step below in one C call, whatever the CPU's default limit
    runners = [
        ModelRunner(tiny_model(kind, layers=3, dtype=dtype), 64, 4, impl="fast", gemm_rows=64)
        for _ in range(2)
    ]
    drv = runners[0].forward_impl.target_driver
    assert drv is not None and runners[0].forward_impl.attention == "paged"
    runners[1].forward_impl.target_driver = None  # the Python loop over the same kernels
    calls = []
    fn = drv.fn
    drv.fn = lambda *a: calls.append(a[20]) or fn(*a)  # the step's rows
    outs = []
    for r in runners:
        Tables.of(r).blocks.append("a", 37)
        Tables.of(r).blocks.append("b", 5)
        segs = [
            Tables.of(r).segment("a", list(range(37)), 0, 30),
            Tables.of(r).segment("b", [7, 8, 9, 10, 11], 0, 4),
        ]
        first = r.forward(segs, tap_layers=(-1, 1, 2))  # the embeddings, a middle and the last layer
        Tables.of(r).blocks.append("a", 3)
        Tables.of(r).blocks.append("b", 1)
        second = r.forward(
            [Tables.of(r).segment("a", [1, 2, 3], 37, 0), Tables.of(r).segment("b", [4], 5, 0)],
            tap_layers=(2, 0),
        )
        third = r.forward([Tables.of(r).segment("b", [5], 6, 0)])  # no taps
        outs.append((first, second, third))
    assert calls == [42, 4, 1]
    for a, b in zip(*outs):
        assert a.logits_offsets == b.logits_offsets and a.token_offsets == b.token_offsets
        assert torch.equal(a.logits, b.logits)
        assert (a.hidden is None) == (b.hidden is None)
        if a.hidden is not None:
            assert torch.equal(a.hidden, b.hidden)
    assert outs[0][1].hidden.shape == (4, 2 * 64)
    assert torch.equal(runners[0].kv.k, runners[1].kv.k)
    assert torch.equal(runners[0].kv.v, runners[1].kv.v)
    # more rows than the packed gemm takes in bf16: the loop runs
    drv.max_rows = 3
    Tables.of(runners[0]).blocks.append("a", 4)
    runners[0].forward([Tables.of(runners[0]).segment("a", [6, 7, 8, 9], 40, 0)])
    assert calls == [42, 4, 1]


def test_no_layers_in_one_c_call_with_head_norms():
    needs_paged_kernel()
    assert (
        ModelRunner(tiny_model("qwen3"), 64, 4, impl="fast").forward_impl.target_driver is None
    )  # q/k norms: the loop
