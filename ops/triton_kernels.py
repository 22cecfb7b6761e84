"""Triton kernels (device code, in Triton's language; imported only when a kernel is first
launched, by `ops/triton_attention.py`, which documents them and their layouts)."""

import triton
import triton.language as tl


@triton.jit
def _segment_of(cu_q_ptr, tile, num_segments, BLOCK_Q: tl.constexpr):
    """The segment of a tile: the last s whose first tile, cu_q[s] // BLOCK_Q + s, is <= tile
    (a binary search; every segment has at least one tile, so first tiles strictly increase)."""
    lo = tile * 0
    hi = lo + num_segments
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid)
    return lo


@triton.jit
def _attend(
    q,
    pos,
    kv_len,
    k_head,
    v_head,
    table_row,
    stride_ks,
    stride_vs,
    scale,
    d,
    dmask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of q [BLOCK_M, D] (rows at positions `pos`) over keys [0, kv_len) of one
    kv head, read BLOCK_N at a time through the block table -> [BLOCK_M, D] float32."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for j in range(tl.cdiv(kv_len, BLOCK_N)):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < kv_len
        blk = tl.load(table_row + n // BLOCK_SIZE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        k = tl.load(
            k_head + slot[None, :] * stride_ks + d[:, None], mask=nmask[None, :] & dmask[:, None], other=0.0
        )  # [D, BLOCK_N]
        s = tl.dot(q, k, input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N], float32
        s = tl.where((n[None, :] <= pos[:, None]) & nmask[None, :], s, float("-inf"))
        # every row sees key 0 (positions are >= 0), so after the first tile m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + slot[:, None] * stride_vs + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0
        )  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc / l_i[:, None]


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, starts_ptr, table_ptr, scale, num_segments,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_ks, stride_vh, stride_vs, stride_table,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr = True,
):  # fmt: skip
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # the segment of this tile: the last s whose first tile cu_q[s] // BLOCK_Q + s <= tile
    seg = _segment_of(cu_q_ptr, tile, num_segments, BLOCK_Q)
    seg_row0 = tl.load(cu_q_ptr + seg)
    seg_end = tl.load(cu_q_ptr + seg + 1)
    row0 = seg_row0 + (tile - (seg_row0 // BLOCK_Q + seg)) * BLOCK_Q
    if row0 >= seg_end:  # past this segment's queries (or a segment with none)
        return
    start = tl.load(starts_ptr + seg)

    m = tl.arange(0, BLOCK_M)
    qi = m // GROUP  # query token of the row within the tile
    row = row0 + qi
    valid = (qi < BLOCK_Q) & (row < seg_end)
    head = kvh * GROUP + m % GROUP
    if CAUSAL:
        pos = (start + (row - seg_row0)).to(tl.int32)  # each row's position in its sequence
    else:  # every query sees the segment's every key (the drafter's block)
        pos = (start + (seg_end - seg_row0) - 1 + 0 * row).to(tl.int32)
    d = tl.arange(0, HEAD_DIM_P)
    dmask = d < HEAD_DIM
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_M, D]

    # keys this tile needs: up to its last valid query's position
    last_row = tl.minimum(row0 + BLOCK_Q, seg_end) - 1
    if not CAUSAL:
        last_row = seg_end - 1
    kv_len = (start + (last_row - seg_row0) + 1).to(tl.int32)
    out = _attend(
        q,
        pos,
        kv_len,
        k_ptr + kvh * stride_kh,
        v_ptr + kvh * stride_vh,
        table_ptr + seg * stride_table,
        stride_ks,
        stride_vs,
        scale,
        d,
        dmask,
        BLOCK_SIZE,
        BLOCK_M,
        HEAD_DIM_P,
        BLOCK_N,
        PRECISION,
    )
    tl.store(
        o_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=valid[:, None] & dmask[None, :],
    )


@triton.jit
def add_rmsnorm_kernel(
    h_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    d,
    eps,
    stride_h,
    stride_delta,
    stride_out,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: h += delta (stored rounded to h's dtype, as torch's add rounds), then
    out = RMSNorm(h) * w, statistics in float32, one rounding."""
    t = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    cmask = c < d
    h = tl.load(h_ptr + t * stride_h + c, mask=cmask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + t * stride_delta + c, mask=cmask, other=0.0)
        h = (h.to(tl.float32) + delta.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + t * stride_h + c, h, mask=cmask)
    x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / d + eps)
    w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + c, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_out, BLOCK: tl.constexpr):
    """silu(gate) * up of one row's columns [j * BLOCK, (j + 1) * BLOCK); gu = gate | up."""
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = c < n
    g = tl.load(gu_ptr + t * stride_gu + c, mask=cmask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + n + c, mask=cmask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * stride_out + c, y.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One token, all its heads: rotary on q (in place), and on k with k and v written to the
    token's cache slot. x * cos + roll(x, D / 2) * sin, rotate_half's sign folded into sin."""
    t = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    r = (d + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + t * HEAD_DIM + d).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * HEAD_DIM + d).to(tl.float32)[None, :]
    h = tl.arange(0, HEADS_P)[:, None]
    hm = h < NUM_HEADS
    row = q_ptr + t * stride_qt + h * stride_qh
    x = tl.load(row + d[None, :], mask=hm, other=0.0).to(tl.float32)
    xr = tl.load(row + r[None, :], mask=hm, other=0.0).to(tl.float32)
    tl.store(row + d[None, :], (x * cos + xr * sin).to(q_ptr.dtype.element_ty), mask=hm)
    kh = tl.arange(0, KV_HEADS_P)[:, None]
    km = kh < NUM_KV_HEADS
    row = k_ptr + t * stride_kt + kh * stride_kh
    x = tl.load(row + d[None, :], mask=km, other=0.0).to(tl.float32)
    xr = tl.load(row + r[None, :], mask=km, other=0.0).to(tl.float32)
    at = kh * stride_ch + tl.load(slots_ptr + t) * stride_cs + d[None, :]
    tl.store(kc_ptr + at, (x * cos + xr * sin).to(kc_ptr.dtype.element_ty), mask=km)
    tl.store(vc_ptr + at, tl.load(v_ptr + t * stride_vt + kh * stride_vh + d[None, :], mask=km), mask=km)


@triton.jit
def matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """y[M, N] = x[M, K] @ w[N, K]^T (+ b): one BLOCK_M x BLOCK_N tile of y a program, its sums
    over K in BLOCK_K steps from k = 0, in float32, rounded once to y's dtype. The tile sizes are
    the same for every M and there is no split over K, so an element's sums run in one order
    whatever the row count: batch-invariant."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )
