"""The C small-row matmul (ops/csrc/small_gemm.c) against a float64 reference, its routing
(bf16 rows above the limit go to oneDNN), the float32 kernel's batch invariance and its
selection by `make_linear`. The paged attention kernel is held to a dense reference in
test_forward_fast.py."""

import pytest
import torch

import dspark_serve.ops.linear as ff
from dspark_serve.ops.cpu_kernels import (
    FALLBACK_ROW_BUCKET,
    SmallGemmLinear,
    argmax_allowed,
    argmax_rows,
    load_kernels,
    mask_rows_bits,
    sample_rows,
    unpack_bits,
)
from dspark_serve.ops.platform import cpu_flags
from dspark_serve.verifier.config import ModelConfig
from dspark_serve.verifier.model_runner import ModelRunner
from tests.helpers import tiny_model
from tests.kv_tables import Tables


@pytest.fixture(scope="module")
def lib():
    lib = load_kernels()
    if lib is None:
        pytest.skip("the CPU kernels need a C compiler")
    return lib


class Spy:
    """A fallback that records the row counts it was given."""

    def __init__(self, w, b):
        self.w, self.b, self.rows = w, b, []

    def __call__(self, x):
        self.rows.append(x.shape[0])
        return torch.nn.functional.linear(x, self.w, self.b)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(20, 6), (64, 64), (100, 576), (37, 1536)])  # N tails past 16-row blocks
def test_small_gemm_matches_float64_within_one_bf16_rounding(lib, n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    spy = Spy(w, b)
    lin = SmallGemmLinear(lib, w, b, spy, max_rows=100)
    # rows in passes of 16, tails, and (on AMX tiles, from 5 rows) one to five 16-row chunks a
    # pass over the weights, a zero-padded last chunk, and a second pass past 80
    for m in (1, 2, 4, 5, 8, 12, 16, 17, 33, 40, 48, 49, 64, 65, 80, 81, 96, 100, 101, 128, 150):
        x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, :k]  # rows at stride 2k: a view
        y = lin(x)
        ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # float32 accumulation, one rounding to bf16 (2^-8 relative); float32 sums add ~1e-6
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2**-8 + 1e-3 * k**0.5).all(), err.max()
    # only row counts above the limit left the kernel, and only in multiples of the bucket (the
    # kernel took the rest: 101 = 64 + 37, 150 = 128 + 22), so the fallback sees few shapes
    assert spy.rows == [64, 128, 128] and FALLBACK_ROW_BUCKET == 64


def test_small_gemm_catches_a_wrong_packing(lib):
    """The reference check above can fail: the same weights packed for a different K give
    different outputs (so a packing or indexing slip would not pass unnoticed)."""
    w = torch.randn(32, 64).bfloat16()
    lin = SmallGemmLinear(lib, w, None, Spy(w, None), max_rows=12)
    lin.K = 62  # read the packed blocks with the wrong stride
    x = torch.randn(1, 62).bfloat16()
    assert not torch.allclose(lin(x).float(), (x.float() @ w[:, :62].float().T), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(20, 6), (64, 63), (100, 576), (37, 1536)])  # N tails, odd K
def test_small_gemm_f32_matches_float64(lib, n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    spy = Spy(w, b)
    lin = SmallGemmLinear(lib, w, b, spy, max_rows=1 << 30)
    for m in (1, 2, 5, 6, 7, 12, 13, 40, 130):  # passes of 6 (AVX2) or 12 (AVX512) rows, tails
        x = torch.randn(m, 2 * k, generator=g)[:, :k]  # rows at stride 2k: a view
        y = lin(x)
        ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert ((y.double() - ref).abs() <= 1e-5 * k**0.5 * (1 + ref.abs())).all()
    assert spy.rows == []


def test_small_gemm_f32_is_batch_invariant(lib):
    """A row's output is the same bits whether it is alone in the call or one of many (so a
    token's float32 logits do not depend on how many tokens share the forward); oneDNN's own
    kernel, for contrast, is not held to this."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 576, generator=g)
    lin = SmallGemmLinear(lib, w, None, Spy(w, None), max_rows=1 << 30)
    x = torch.randn(77, 576, generator=g)
    together = lin(x)
    for i in (0, 5, 6, 40, 76):
        assert torch.equal(lin(x[i : i + 1]), together[i : i + 1])
        assert torch.equal(lin(x[i : i + 3]), together[i : i + 3])


def test_make_linear_picks_gemm_on_cpu_only(lib, monkeypatch):
    w = torch.randn(48, 32)
    assert ff.make_linear(w.bfloat16(), None, "auto", "none").kind == "gemm"
    assert ff.make_linear(w.bfloat16(), None, "gemm", "none").kind == "gemm"
    f32 = ff.make_linear(w, None, "auto", "none")
    assert f32.kind == "gemm" and f32.max_rows >= 1 << 20  # float32: every row count, batch-invariant
    assert ff.make_linear(w[:, :31].bfloat16(), None, "auto", "none").kind != "gemm"  # odd K in bf16
    assert ff.make_linear(w[:, :31], None, "auto", "none").kind == "gemm"  # any K in float32
    with pytest.raises(ValueError, match="gemm"):
        ff.make_linear(w.half(), None, "gemm", "none")
    # rows above the kernel's limit go to oneDNN, or to torch where oneDNN cannot run bf16
    above = "mkldnn" if ff.mkldnn_linear_works(torch.bfloat16, torch.device("cpu")) else "torch"
    assert ff.make_linear(w.bfloat16(), None, "auto", "none").fallback.kind == above
    # without a compiler auto falls back to the same (and gemm asked for is an error)
    monkeypatch.setattr("dspark_serve.ops.cpu_kernels.load_kernels", lambda: None)
    assert ff.make_linear(w.bfloat16(), None, "auto", "none").kind == above
    with pytest.raises(ValueError, match="gemm"):
        ff.make_linear(w.bfloat16(), None, "gemm", "none")


def test_bf16_rows_leave_the_c_kernel_where_onednn_wins_on_this_cpu(lib):
    """Where oneDNN runs bf16 on AMX tiles it beats the C kernel's AVX512 path from ~10 rows,
    elsewhere only past 128, as its own tile path does: the crossover follows the CPU and the
    build, and an explicit limit overrides it."""
    assert ff.default_gemm_rows(cpu_amx=True, kernel_tiles=True) == 128  # the kernel on the tiles too
    assert ff.default_gemm_rows(cpu_amx=True, kernel_tiles=False) == 8  # oneDNN alone on them
    assert ff.default_gemm_rows(cpu_amx=False, kernel_tiles=False) == 128
    w = torch.randn(48, 32).bfloat16()
    here = ff.default_gemm_rows("amx_bf16" in cpu_flags(), bool(lib.small_gemm_tiles()))
    assert ff.make_linear(w, None, "auto", "none").max_rows == here
    lin = ff.make_linear(w, None, "gemm", "none", gemm_rows=5)
    assert lin.max_rows == 5
    x = torch.randn(40, 32).bfloat16()
    lin.fallback = spy = Spy(w, None)
    lin(x[:5])
    lin(x[:9])
    assert spy.rows == []  # five rows, and nine (under one bucket of 16): the C kernel
    lin(x[:16])
    lin(x[:40])
    assert spy.rows == [16, 32]  # oneDNN (the spy standing in for it) in 16-row buckets
    runner = ModelRunner(tiny_model("llama", dtype=torch.bfloat16), 32, 4, gemm_rows=12)
    assert runner.forward_impl.weights.gemm_max_rows == 12 and "up to 12 rows" in runner.describe()
    assert (
        ModelRunner(tiny_model("llama"), 32, 4).forward_impl.weights.gemm_max_rows is None
    )  # float32: no limit
    with pytest.raises(ValueError, match="-1"):
        ModelConfig(gemm_rows=-1)


def test_bf16_decode_and_verify_steps_through_gemm_track_the_reference(lib):
    """Decode (1 token) and verify (6 tokens) steps run the C kernels end to end in bf16; they
    are not bit-equal to the reference (bf16 is not batch-invariant) but agree closely."""
    ref = ModelRunner(tiny_model("qwen3", dtype=torch.bfloat16), 64, 4, impl="reference")
    fast = ModelRunner(tiny_model("qwen3", dtype=torch.bfloat16), 64, 4, impl="fast")
    assert fast.forward_impl.weights.linear_kind == "gemm" and fast.forward_impl.attention == "paged"
    assert (
        fast.forward_impl.rope_store is not None and fast.forward_impl.fused is not None
    )  # the fused bf16 layer loop
    outs, hidden = [], []
    taps = (-1, 0, fast.num_layers - 1)  # embedding, a middle layer (h updated in place), final norm
    for r in (ref, fast):
        Tables.of(r).blocks.append("a", 20)
        r.forward([Tables.of(r).segment("a", list(range(20)), 0, 0)])
        steps = []
        for start, toks in ((20, [7]), (21, [3, 9, 4, 1, 5, 2])):
            Tables.of(r).blocks.append("a", len(toks))
            out = r.forward([Tables.of(r).segment("a", toks, start, 0)], tap_layers=taps)
            steps.append(out.logits.float())  # the fast forward leaves them in bf16
        outs.append(torch.cat(steps))
        hidden.append(out.hidden.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 6 / 7
    torch.testing.assert_close(hidden[1], hidden[0], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_and_silu_mul_match_torch(lib, dtype):
    from dspark_serve.ops.cpu_kernels import FusedElementwise

    g = torch.Generator().manual_seed(3)
    E = FusedElementwise(lib)
    # one rounding to the dtype's precision (bf16), or float32 sums in another order
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-6
    h = torch.randn(11, 48, generator=g).to(dtype)  # 11 rows: past the OpenMP threshold
    delta = torch.randn(11, 96, generator=g).to(dtype)[:, :48]  # rows at a stride
    w = torch.randn(48, generator=g).to(dtype)
    want_h = h + delta  # torch's add: the fused sum must be bit-identical
    ref = torch.nn.functional.rms_norm(want_h.double(), (48,), w.double(), 1e-6)
    out = E.add_rmsnorm(h, delta, w, 1e-6)
    assert torch.equal(h, want_h)
    assert ((out.double() - ref).abs() <= ref.abs() * tol + 1e-6).all()
    out2 = E.add_rmsnorm(h, None, w, 1e-6)  # no add: h unchanged
    assert torch.equal(h, want_h) and torch.equal(out2, out)
    # each row alone: the same bits as among the others (float32 stays batch-invariant)
    assert torch.equal(E.add_rmsnorm(h[3:4].clone(), None, w, 1e-6), out[3:4])
    gu = (torch.randn(4, 64, generator=g) * 6).to(dtype)  # large |x|: both silu branches
    gate, up = gu.double().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    got = E.silu_mul(gu).double()
    assert ((got - ref).abs() <= ref.abs() * tol + 1e-6).all()
    with pytest.raises(ValueError, match="float32"):
        E.silu_mul(gu.half())


def test_norm_rope_matches_the_norm_then_rotary_in_float64(lib):
    """The drafter's q/k head norm and rotary in one pass: heads read at token and head strides
    (a view into fused qkv rows), against float64 maths; other dtypes are declined (None)."""
    from dspark_serve.ops.cpu_kernels import FusedElementwise

    g = torch.Generator().manual_seed(4)
    E = FusedElementwise(lib)
    T, nh, D = 13, 5, 32
    qkv = torch.randn(T, nh * D + 40, generator=g)
    x = qkv[:, 8 : 8 + nh * D].view(T, nh, D)  # token stride nh * D + 40, head stride D
    w = torch.randn(D, generator=g)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    got = E.norm_rope(x, w, 1e-6, cos, sin)
    assert got is not None and got.shape == (T, nh, D) and got.is_contiguous()
    y = torch.nn.functional.rms_norm(x.double(), (D,), w.double(), 1e-6)
    rolled = torch.roll(y, D // 2, dims=-1)  # rotate_half with its sign folded into sin
    ref = y * cos.double()[:, None] + rolled * sin.double()[:, None]
    assert (got.double() - ref).abs().max() < 1e-5
    assert torch.equal(E.norm_rope(x[4:5], w, 1e-6, cos[4:5].clone(), sin[4:5].clone()), got[4:5])
    assert E.norm_rope(x.double(), w, 1e-6, cos, sin) is None
    with pytest.raises(ValueError, match="shape"):
        E.norm_rope(x, w, 1e-6, cos[:3], sin[:3])
    # bf16: the same maths in float32 on the bf16 inputs, one rounding per output
    xb, wb, cb, sb = x.bfloat16(), w.bfloat16(), cos.bfloat16(), sin.bfloat16()
    half = E.norm_rope(xb, wb, 1e-6, cb, sb)
    assert half is not None and half.dtype == torch.bfloat16 and half.shape == (T, nh, D)
    y = torch.nn.functional.rms_norm(xb.double(), (D,), wb.double(), 1e-6)
    ref = y * cb.double()[:, None] + torch.roll(y, D // 2, dims=-1) * sb.double()[:, None]
    assert ((half.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-6).all()  # one bf16 rounding
    with pytest.raises(ValueError, match="dtype"):
        E.norm_rope(xb, w, 1e-6, cb, sb)  # a float32 weight with bf16 rows


def test_float32_steps_run_the_fused_layer_loop_and_track_the_reference(lib):
    """float32 on a CPU with the C kernels takes the fused layer loop (rotary + K/V write, add +
    norm, SwiGLU in C) and stays within float32 rounding of the reference forward."""
    ref = ModelRunner(tiny_model("qwen3"), 64, 4, impl="reference")
    fast = ModelRunner(tiny_model("qwen3"), 64, 4, impl="fast")
    assert (
        fast.forward_impl.attention == "paged"
        and fast.forward_impl.rope_store is not None
        and fast.forward_impl.fused is not None
    )
    taps = (-1, 0, fast.num_layers - 1)
    outs, hidden = [], []
    for r in (ref, fast):
        Tables.of(r).blocks.append("a", 20)
        r.forward([Tables.of(r).segment("a", list(range(20)), 0, 0)])
        Tables.of(r).blocks.append("a", 6)
        out = r.forward([Tables.of(r).segment("a", [3, 9, 4, 1, 5, 2], 20, 0)], tap_layers=taps)
        outs.append(out.logits)
        hidden.append(out.hidden)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden[1], hidden[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_q_in_place_and_writes_k_v_at_their_slots(lib, dtype):
    """The fused rotary + K/V write against the fast forward's torch maths (float64 reference,
    one rounding), on views into a fused qkv row, with slots in any order; other slots untouched."""
    from dspark_serve.ops.cpu_kernels import RopeStore

    H, Hkv, D, T, slots_total = 6, 2, 32, 5, 40
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    ang = torch.rand(T, D // 2, generator=g, dtype=torch.float64) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([-ang.sin(), ang.sin()], -1)  # rotate_half's sign folded in
    slots = torch.randperm(slots_total, generator=g)[:T]
    kc = torch.zeros(Hkv, slots_total, D, dtype=dtype)
    vc = torch.zeros(Hkv, slots_total, D, dtype=dtype)
    q0, k0, v0 = q.double().clone(), k.double().clone(), v.clone()
    c, s = cos.to(dtype), sin.to(dtype)
    RopeStore(lib, H, Hkv, D)(q, k, v, c, s, slots, kc, vc)

    def rope(x):
        return x * c.double()[:, None] + torch.roll(x, D // 2, dims=-1) * s.double()[:, None]

    tol = 1e-6 if dtype == torch.float32 else 2**-8
    for got, want in ((q, rope(q0)), (kc[:, slots].transpose(0, 1), rope(k0))):
        err = (got.double() - want).abs()
        assert (err <= want.abs() * tol + 1e-6).all(), err.max()
    assert torch.equal(vc[:, slots].transpose(0, 1), v0)
    others = torch.ones(slots_total, dtype=torch.bool)
    others[slots] = False
    assert not kc[:, others].any() and not vc[:, others].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,v", [(8, 49152), (5, 17), (6, 7696), (5, 1)])  # vector tails, one column
def test_argmax_rows_picks_torchs_index(lib, dtype, t, v):
    g = torch.Generator().manual_seed(t * v)
    x = torch.randn(t, v, generator=g).to(dtype)
    if v > 16:
        x[0, 5] = x[0, 13] = 100.0  # a tie: the first wins
        x[1, 3] = x[1, 14] = float("nan")  # a NaN counts as the maximum, the first one wins
        x[3] = 0.0
        x[3, 2] = -0.0  # equal zeros: the first
        x[4, v - 1] = 1e4  # the maximum in the last (tail) element
    x[2] = float("-inf")  # nothing above -inf: index 0
    got = argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(-1))
    wide = torch.randn(t, v + 9, generator=g).to(dtype)
    strided = wide[:, 4 : 4 + v]  # rows of a wider tensor
    assert torch.equal(argmax_rows(strided), strided.argmax(-1))


def test_argmax_rows_leaves_other_tensors_to_torch(lib):
    x = torch.randn(4, 10, dtype=torch.float64)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    cols = torch.randn(10, 4).t()  # elements not contiguous
    assert torch.equal(argmax_rows(cols), cols.argmax(-1))


@pytest.mark.parametrize("v,w", [(70, 3), (64, 2), (100, 2), (33, 2)])  # ragged tail, exact, words short
def test_packed_masks_set_exactly_the_disallowed_tokens_to_minus_inf(lib, v, w):
    g = torch.Generator().manual_seed(v)
    bits = torch.randint(-(2**31), 2**31 - 1, (5, w), dtype=torch.int32, generator=g)
    bits[1] = 0  # nothing allowed
    bits[2] = -1  # everything the words cover
    bits[3, 0] = 1  # token 0 alone in its word
    x = torch.randn(5, v + 3, generator=g)[:, :v]  # rows of a wider tensor
    want = x.clone()
    allowed = torch.zeros(5, v, dtype=torch.bool)
    for t in range(5):
        for tok in range(min(v, 32 * w)):
            allowed[t, tok] = bool((int(bits[t, tok // 32]) >> (tok % 32)) & 1)
    want[~allowed] = float("-inf")
    assert torch.equal(unpack_bits(bits, v), allowed)
    got = x.clone()
    mask_rows_bits(got, bits)  # the C kernel
    assert torch.equal(got, want)
    fallback = x.double()
    mask_rows_bits(fallback, bits)  # another dtype: torch
    assert torch.equal(fallback, want.double())


def _masked_argmax(row: torch.Tensor, bits: torch.Tensor, d2t: torch.Tensor | None) -> int:
    """What argmax_allowed promises, entry by entry: the first allowed NaN, else the first
    allowed entry equal to the allowed maximum, else -1."""
    x = row.double().tolist()
    tokens = range(len(x)) if d2t is None else d2t.tolist()
    ok = [
        j for j, t in enumerate(tokens) if 0 <= t < 32 * bits.numel() and (int(bits[t // 32]) >> (t % 32)) & 1
    ]
    if not ok:
        return -1
    nan = [j for j in ok if x[j] != x[j]]
    if nan:
        return nan[0]
    best = max(x[j] for j in ok)
    return next(j for j in ok if x[j] == best)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,mapped", [(49152, False), (70, False), (33, False), (7696, True), (40, True)])
def test_argmax_allowed_is_the_argmax_of_the_masked_row(lib, dtype, v, mapped):
    """The argmax over the entries a packed mask allows, with and without a draft vocabulary's
    map (entry j is token d2t[j]), on masks of whole words, ragged tails, single tokens,
    nothing allowed, ties, NaN and -inf entries; other dtypes through torch give the same."""
    g = torch.Generator().manual_seed(v + mapped)
    target = 49152 if mapped else v
    w = (target + 31) // 32
    d2t = torch.randperm(target, generator=g)[:v].sort().values if mapped else None
    cases = []
    for case in range(12):
        row = (torch.randn(v, generator=g) * 4).to(dtype)
        bits = torch.randint(-(2**31), 2**31 - 1, (w,), dtype=torch.int32, generator=g)
        tokens = torch.arange(v) if d2t is None else d2t
        if case == 1:
            bits.zero_()  # nothing allowed
        elif case == 2:
            bits.fill_(-1)  # everything: the plain argmax
        elif case == 3:  # one allowed token, far from the best
            bits.zero_()
            t = int(tokens[v // 2])
            bits[t // 32] = 1 << (t % 32) if t % 32 < 31 else -(2**31)
        elif case == 4:
            row[:] = float("-inf")  # every entry -inf: the first allowed one
        elif case == 5:
            row[[1, 3, 5]] = 1e4  # a tie: the first allowed of them wins
        elif case == 6:
            row[[2, 4]] = float("nan")  # a NaN counts as the maximum where allowed
        elif case == 7:
            row[v - 1] = 1e5  # the best in the last (tail) entry
        elif case == 8:
            bits[: w // 2] = 0  # a long stretch of nothing
        cases.append((row, bits))
        want = _masked_argmax(row, bits, d2t)
        assert argmax_allowed(row, bits, d2t) == want, case
        assert argmax_allowed(row.double(), bits, d2t) == want, case  # torch's path
    assert any(_masked_argmax(r, b, d2t) != int(r.float().argmax()) for r, b in cases)  # masks mattered


@pytest.mark.parametrize("v", [49152, 7696, 130, 64, 1])
def test_sample_rows_draws_what_the_cumulative_sum_draws(lib, v):
    """The C draw is the inverse-CDF draw of a float64 cumulative sum and a search (the rule
    `sample_from_uniforms` keeps for other devices): the same token for every uniform, on rows
    with zero-mass entries, unnormalised rows, ragged block tails and uniforms at 0 and just
    below 1; zero-mass tokens are never drawn; a row without mass draws its last index; rows of
    a wider tensor are read where they lie."""
    g = torch.Generator().manual_seed(v)
    wide = torch.softmax(torch.randn(6, v + 5, generator=g) * 4, -1)
    probs = wide[:, :v]  # rows with a stride, unnormalised
    probs[1, ::2] = 0.0
    probs[2] = 0.0
    probs[2, v // 2] = 3.0  # one token with all the mass
    probs[3] = 0.0  # no mass at all
    probs[4, : v // 2] = 0.0
    edges = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)

    def reference(p, u):
        cdf = torch.cumsum(p, dim=-1, dtype=torch.float64)
        total = cdf[:, -1]
        x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, x.unsqueeze(1), right=True).squeeze(1).clamp_(max=p.shape[1] - 1)

    seen = set()
    for trial in range(300):
        u = torch.rand(6, generator=g, dtype=torch.float64)
        if trial < 2:
            u[:] = edges[trial]
        got = sample_rows(probs, u)
        assert got is not None and torch.equal(got, reference(probs, u)), trial
        assert int(got[3]) == v - 1
        rows = [r for r in (0, 1, 2, 4, 5) if bool(probs[r].sum() > 0)]
        assert bool((probs[rows, got[rows]] > 0).all())
        seen.add(int(got[0]))
    assert len(seen) >= min(v, 5)  # the draws spread over the row
    assert sample_rows(probs.double(), torch.rand(6, dtype=torch.float64)) is None  # torch's dtype: not here


def test_attention_runs_on_the_tiles_where_the_matmul_does(lib):
    """Both kernels ask for the tile state the same way, so a build for a CPU with AMX runs bf16
    attention of many query rows on the tiles exactly where the matmul runs on them (the dense
    checks of tests/verifier/test_forward_fast.py then test that path here, and the no-AMX build
    of tests/ops/test_kernel_builds.py the AVX512 one)."""
    assert lib.paged_attention_tiles() == lib.small_gemm_tiles()
    if "amx_bf16" not in cpu_flags() or "amx_tile" not in cpu_flags():
        assert lib.paged_attention_tiles() == 0


def test_a_build_started_early_is_waited_for_not_repeated(tmp_path, monkeypatch):
    """`prepare_kernels` builds on a thread of its own while a start reads the model; whoever asks
    for the library meanwhile waits for that build instead of starting a second one (the build
    stands in here: a copy of this process's library after a pause). A real build compiles each
    source to an object and links them, and an error names the source."""
    import shutil
    import subprocess
    import threading
    import time

    from dspark_serve.ops import cpu_kernels as ck

    built = ck.load_kernels()
    if built is None:
        pytest.skip("no C compiler here")
    library = ck.default_cache_dir() / "kernels" / f"cpu_kernels-{ck.kernels_key()}.so"  # load_kernels' own
    monkeypatch.setattr(ck, "_loaded", {})
    builds = []
    started = threading.Event()

    def standing_in(compiler, out):
        builds.append(out)
        started.set()
        time.sleep(0.3)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(library, out)

    real = ck._build
    monkeypatch.setattr(ck, "_build", standing_in)
    thread = ck.prepare_kernels(tmp_path)
    assert started.wait(30)
    lib = ck.load_kernels(tmp_path)  # arrives mid-build: waits for it
    thread.join(60)
    assert lib is not None and len(builds) == 1 and builds[0].exists()
    assert ck.kernel_paths(lib) == ck.kernel_paths(ck.load_kernels(tmp_path)) == ck.kernel_paths(built)
    (tmp_path / "broken.c").write_text("int f( {")
    (tmp_path / "fine.c").write_text("int g(void) { return 1; }")
    monkeypatch.setattr(ck, "SOURCES", (tmp_path / "fine.c", tmp_path / "broken.c"))
    with pytest.raises(subprocess.CalledProcessError) as failed:
        real(ck.find_compiler(), tmp_path / "other.so")
    assert "broken.c" in failed.value.stderr and "fine.c" not in failed.value.stderr
    assert not (tmp_path / "other.so").exists()
    monkeypatch.setattr(ck, "SOURCES", (tmp_path / "fine.c",))
    real(ck.find_compiler(), tmp_path / "fine.so")
    assert (tmp_path / "fine.so").exists()
