/* Attention of short query segments over a paged KV cache, read in place.
 *
 * The fast forward's decode/verify path: every segment g has n[g] query tokens at positions
 * start[g] .. start[g] + n[g] - 1 (rows row0[g] .. of q and out) and attends causally to its
 * keys 0 .. start[g] + i, which live in the blocks listed by its row of the block table. The
 * target's cache is [Hkv, num_slots, D] per layer (slot = block * block_size + offset), so each
 * key row is read where it lies: no gather of a request's context, no padding, no mask tensor.
 * The drafter's block (every query sees its whole block: causal 0) reads its context the same
 * way from a [requests, positions, Hkv, D] pool, one "block" per request.
 *
 * A work item is a segment (or a run of its query tokens) and the query heads that share one kv
 * head: scores for its queries in float32, a float32 softmax, then the weighted sum of value
 * rows, rounded once to the model dtype. Items run in parallel on the OpenMP pool torch already
 * uses (the same libgomp). Six bodies of the same maths: bfloat16 on a CPU with AVX512-BF16
 * (attend_item_bf16: products of the bf16 rows as they lie, 16 keys a tile, register
 * accumulators; the common case; attend_item_bf16_rows for items of many query rows: key tiles
 * transposed once, probabilities rounded to bf16 for the value products; attend_item_amx, the
 * same with both products on AMX tiles where the CPU has them), float32
 * on a CPU with AVX2 and FMA (attend_item_f32: the same shape, 8 keys a tile; one order of sums
 * whatever the number of rows, so a row's output does not depend on what shares the call), and
 * elsewhere one dot product per query and key for a few rows (attend_item) or 16-key tiles
 * transposed once for many (attend_item_tiled).
 *
 * dtype: 0 float32, 1 bfloat16 (round to nearest even on output). Built with -O3 and
 * -march=native by ops/cpu_kernels.py; no torch headers, called through ctypes. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "amx.h"
#include "common.h"
#include "kernels.h" /* the prototypes the layer drivers call: checked against the definitions here */

/* D elements starting at element `offset` of base, widened to float32 */
static inline void load_at(const void *base, int dtype, int64_t offset, int D, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + offset, (size_t)D * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
    }
}

/* D floats to `base` from element `offset` on, rounded to the model dtype */
static inline void store_at(void *base, int dtype, int64_t offset, int D, const float *src) {
    if (dtype == 0) {
        memcpy((float *)base + offset, src, (size_t)D * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d]);
    }
}

/* A row of scores [len] turned into probabilities in place: float32, max subtracted. The
 * reductions are marked `omp simd` so they vectorise (the build has no -ffast-math, which is
 * what lets a compiler reorder a float sum; OpenMP's pragma allows it for these loops alone). */
static inline void softmax_row(float *sr, int len) {
    float m = sr[0];
#pragma omp simd reduction(max : m)
    for (int j = 1; j < len; j++) m = sr[j] > m ? sr[j] : m;
    for (int j = 0; j < len; j++) sr[j] = exp_nonpos(sr[j] - m);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < len; j++) sum += sr[j];
    float inv = 1.0f / sum;
    for (int j = 0; j < len; j++) sr[j] *= inv;
}

/* softmax_row with its sums in an order set by len alone (not by the row's alignment, or by how
 * a compiler splits a loop): for batch-invariant attention; defined below */
static inline void softmax_row_fixed(float *sr, int len);

/* The item's query rows (heads h0.., tokens r0..), widened and scaled, to qf [nh * nq][D] */
static inline __attribute__((always_inline)) void load_queries(
    const void *q, int64_t q_stride, int64_t q_hstride, int dtype, int D, float scale, int r0,
    int nq, int h0, int nh, float *qf) {
    for (int hi = 0; hi < nh; hi++)
        for (int i = 0; i < nq; i++) {
            float *dst = qf + ((size_t)hi * nq + i) * D;
            load_at(q, dtype, (int64_t)(r0 + i) * q_stride + (int64_t)(h0 + hi) * q_hstride, D, dst);
            for (int d = 0; d < D; d++) dst[d] *= scale;
        }
}

/* One work item: query heads h0 .. h0 + nh - 1 (all reading kv head hk) of segment g. Key and
 * value rows are widened once and used by every query row of the item. Inlined with D a
 * constant where it is 64 or 128, so the compiler unrolls and vectorises the row loops. */
static inline __attribute__((always_inline)) void attend_item(
    const void *q, int64_t q_stride, int64_t q_hstride, const void *kh, const void *vh,
    int64_t kv_stride, void *out,
    int dtype, int H, int D, float scale, int causal, int r0, int nq, int s0,
    const int32_t *blocks, int block_shift, int h0, int nh, int64_t max_keys, float *scores,
    float *qf, float *acc, float *row, int fixed) {
    const int64_t sst = max_keys + 16; /* a score row, room for softmax_row_fixed's last 8 */
    int block_size = 1 << block_shift;
    int nkeys = s0 + nq;
    load_queries(q, q_stride, q_hstride, dtype, D, scale, r0, nq, h0, nh, qf);
    /* scores[row][j] = q_row . k_j for the keys the row's query may see (causal: j <= s0 + i;
     * else every key, j < s0 + nq) */
    int64_t slot = 0; /* the cache slot of key j, advanced key by key */
    for (int j = 0; j < nkeys; j++) {
        slot = (j & (block_size - 1)) ? slot + 1 : (int64_t)blocks[j >> block_shift] * block_size;
        load_at(kh, dtype, slot * kv_stride, D, row);
        int first = causal && j - s0 > 0 ? j - s0 : 0; /* the first query that sees key j */
        for (int hi = 0; hi < nh; hi++)
            for (int i = first; i < nq; i++) {
                const float *qi = qf + ((size_t)hi * nq + i) * D;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qi[d] * row[d];
                scores[((size_t)hi * nq + i) * sst + j] = s;
            }
    }
    for (int r = 0; r < nh * nq; r++) {
        int len = causal ? s0 + r % nq + 1 : nkeys;
        if (fixed)
            softmax_row_fixed(scores + (size_t)r * sst, len);
        else
            softmax_row(scores + (size_t)r * sst, len);
        memset(acc + (size_t)r * D, 0, sizeof(float) * (size_t)D);
    }
    for (int j = 0; j < nkeys; j++) {
        slot = (j & (block_size - 1)) ? slot + 1 : (int64_t)blocks[j >> block_shift] * block_size;
        load_at(vh, dtype, slot * kv_stride, D, row);
        int first = causal && j - s0 > 0 ? j - s0 : 0;
        for (int hi = 0; hi < nh; hi++)
            for (int i = first; i < nq; i++) {
                size_t r = (size_t)hi * nq + i;
                float p = scores[r * sst + j];
                float *ar = acc + r * D;
                for (int d = 0; d < D; d++) ar[d] += p * row[d];
            }
    }
    for (int hi = 0; hi < nh; hi++)
        for (int i = 0; i < nq; i++)
            store_at(out, dtype, ((int64_t)(r0 + i) * H + h0 + hi) * D, D,
                     acc + ((size_t)hi * nq + i) * D);
}

/* The same work item for many query rows (verify steps, prefill pieces): keys in tiles of KT,
 * each tile's rows widened once into a transposed [D][KT] buffer, so the scores of a query row
 * against the whole tile are KT-wide multiply-adds over d with no horizontal sum, four rows at a
 * time (four independent accumulators); values as [KT][D] rows added into each query's output
 * row. Same float32 maths as attend_item, summed in another order. */
#define KT 16
static inline __attribute__((always_inline)) void attend_item_tiled(
    const void *q, int64_t q_stride, int64_t q_hstride, const void *kh, const void *vh,
    int64_t kv_stride, void *out,
    int dtype, int H, int D, float scale, int causal, int r0, int nq, int s0,
    const int32_t *blocks, int block_shift, int h0, int nh, int64_t max_keys, float *scores,
    float *qf, float *acc, float *tile, int fixed) {
    (void)fixed; /* never run batch-invariant: its order of sums depends on the item's rows */
    int block_size = 1 << block_shift;
    int nkeys = s0 + nq;
    int rows = nh * nq;
    load_queries(q, q_stride, q_hstride, dtype, D, scale, r0, nq, h0, nh, qf);
    int64_t slots[KT];
    for (int j0 = 0; j0 < nkeys; j0 += KT) {
        int nt = nkeys - j0 < KT ? nkeys - j0 : KT;
        for (int t = 0; t < nt; t++) {
            int j = j0 + t;
            slots[t] = (int64_t)blocks[j >> block_shift] * block_size + (j & (block_size - 1));
        }
        /* kT[d][t]: key t of the tile, transposed (a short tile is zero-padded) */
        for (int t = 0; t < KT; t++) {
            float row[256];
            if (t < nt)
                load_at(kh, dtype, slots[t] * kv_stride, D, row);
            else
                memset(row, 0, sizeof(float) * (size_t)D);
            for (int d = 0; d < D; d++) tile[(size_t)d * KT + t] = row[d];
        }
        /* rows that see no key of this tile (causal: the tile starts past their last key) skip it */
        int r = 0;
        for (; r + 4 <= rows; r += 4) {
            float s0v[KT] = {0}, s1v[KT] = {0}, s2v[KT] = {0}, s3v[KT] = {0};
            const float *q0 = qf + (size_t)r * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
            for (int d = 0; d < D; d++) {
                const float *kd = tile + (size_t)d * KT;
                for (int t = 0; t < KT; t++) {
                    s0v[t] += q0[d] * kd[t];
                    s1v[t] += q1[d] * kd[t];
                    s2v[t] += q2[d] * kd[t];
                    s3v[t] += q3[d] * kd[t];
                }
            }
            for (int t = 0; t < nt; t++) {
                scores[(size_t)r * max_keys + j0 + t] = s0v[t];
                scores[(size_t)(r + 1) * max_keys + j0 + t] = s1v[t];
                scores[(size_t)(r + 2) * max_keys + j0 + t] = s2v[t];
                scores[(size_t)(r + 3) * max_keys + j0 + t] = s3v[t];
            }
        }
        for (; r < rows; r++) {
            float sv[KT] = {0};
            const float *qr = qf + (size_t)r * D;
            for (int d = 0; d < D; d++)
                for (int t = 0; t < KT; t++) sv[t] += qr[d] * tile[(size_t)d * KT + t];
            for (int t = 0; t < nt; t++) scores[(size_t)r * max_keys + j0 + t] = sv[t];
        }
    }
    for (int r = 0; r < rows; r++) {
        float *sr = scores + (size_t)r * max_keys;
        int len = causal ? s0 + r % nq + 1 : nkeys;
        softmax_row(sr, len);
        for (int j = len; j < nkeys; j++) sr[j] = 0.0f; /* keys the row may not see weigh 0 */
        memset(acc + (size_t)r * D, 0, sizeof(float) * (size_t)D);
    }
    for (int j0 = 0; j0 < nkeys; j0 += KT) {
        int nt = nkeys - j0 < KT ? nkeys - j0 : KT;
        for (int t = 0; t < nt; t++) {
            int j = j0 + t;
            int64_t slot = (int64_t)blocks[j >> block_shift] * block_size + (j & (block_size - 1));
            load_at(vh, dtype, slot * kv_stride, D, tile + (size_t)t * D);
        }
        for (int r = 0; r < rows; r++) {
            int len = causal ? s0 + r % nq + 1 : nkeys;
            if (len <= j0) continue;
            const float *restrict p = scores + (size_t)r * max_keys + j0;
            float *restrict ar = acc + (size_t)r * D;
            float a[256]; /* the output row stays in registers across the tile's keys */
            for (int d = 0; d < D; d++) a[d] = ar[d];
            for (int t = 0; t < nt; t++) {
                float pt = p[t];
                const float *restrict vt = tile + (size_t)t * D;
                for (int d = 0; d < D; d++) a[d] += pt * vt[d];
            }
            for (int d = 0; d < D; d++) ar[d] = a[d];
        }
    }
    for (int hi = 0; hi < nh; hi++)
        for (int i = 0; i < nq; i++)
            store_at(out, dtype, ((int64_t)(r0 + i) * H + h0 + hi) * D, D,
                     acc + ((size_t)hi * nq + i) * D);
}

/* The cache slots of keys j0 .. j0 + width - 1 (a tile); keys past nkeys take key j0's slot (any
 * valid row: their scores are never used) */
static inline void tile_slots(const int32_t *blocks, int block_shift, int j0, int nkeys, int width,
                              int64_t *slots) {
    const int block_size = 1 << block_shift;
    for (int t = 0; t < width; t++) {
        int j = j0 + (j0 + t < nkeys ? t : 0);
        slots[t] = (int64_t)blocks[j >> block_shift] * block_size + (j & (block_size - 1));
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp_nonpos's maths on 8 lanes, each multiply-add explicit (the same bits whatever the lane) */
static inline __m256 exp_nonpos8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* softmax_row in 8-lane steps from key 0, the last step's lanes past len zeroed (sr has room up
 * to len rounded up to 8): every sum in one order set by len alone, not by the buffer's
 * alignment or by how a compiler peels a loop. */
static inline void softmax_row8(float *sr, int len) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int full = len & ~7;
    for (int j = 0; j < full; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sr + j));
    __m256 tail_mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(len - full), iota));
    if (full < len)
        m8 = _mm256_max_ps(m8, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(sr + full), tail_mask));
    float mv[8], m;
    _mm256_storeu_ps(mv, m8);
    m = mv[0];
    for (int t = 1; t < 8; t++) m = mv[t] > m ? mv[t] : m;
    __m256 vm = _mm256_set1_ps(m), s8 = _mm256_setzero_ps();
    for (int j = 0; j < len; j += 8) {
        __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), vm));
        if (j == full) e = _mm256_and_ps(e, tail_mask);
        _mm256_storeu_ps(sr + j, e);
        s8 = _mm256_add_ps(s8, e);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    __m256 inv = _mm256_set1_ps(1.0f / _mm_cvtss_f32(h));
    for (int j = 0; j < len; j += 8) _mm256_storeu_ps(sr + j, _mm256_mul_ps(_mm256_loadu_ps(sr + j), inv));
}

#endif

static inline void softmax_row_fixed(float *sr, int len) {
#if defined(__AVX2__) && defined(__FMA__)
    softmax_row8(sr, len);
#else
    float m = sr[0]; /* one element at a time: volatile keeps the compiler from reordering sums */
    for (int j = 1; j < len; j++) m = sr[j] > m ? sr[j] : m;
    volatile float sum = 0.0f;
    for (int j = 0; j < len; j++) {
        sr[j] = exp_nonpos(sr[j] - m);
        sum = sum + sr[j];
    }
    float inv = 1.0f / sum;
    for (int j = 0; j < len; j++) sr[j] *= inv;
#endif
}

#ifdef __AVX512BF16__
/* o[t] = sum of the 16 lanes of v[t], t < 16: a transpose-and-add tree (45 instructions for all
 * 16, instead of a horizontal sum per vector) */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], u[4];
    for (int k = 0; k < 8; k++)
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

/* 16 bf16 at p widened to float32 */
static inline __m512 widen16(const uint16_t *p) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

/* The work item in bfloat16 on a CPU with AVX512-BF16 (D a multiple of 32, at most 256): the
 * scores of a query row against 16 keys are vdpbf16ps products of the bf16 rows as they lie
 * (exact products, float32 sums; no widening of keys or queries), summed by one sum16 tree; the
 * softmax as everywhere; the values widened once per key and added into float32 accumulators
 * held in registers for RB rows at a time. */
static inline __attribute__((always_inline)) void attend_item_bf16(
    const void *q, int64_t q_stride, int64_t q_hstride, const void *kh, const void *vh,
    int64_t kv_stride, void *out, int H, int D, float scale, int causal, int r0, int nq, int s0,
    const int32_t *blocks, int block_shift, int h0, int nh, int64_t max_keys, float *scores,
    int fixed_softmax) {
    const int block_size = 1 << block_shift;
    const int nkeys = s0 + nq, rows = nh * nq, C = D / 32; /* zmm of bf16 per row */
    const uint16_t *kb = (const uint16_t *)kh, *vb = (const uint16_t *)vh;
    const int64_t stride16 = max_keys + 16; /* a score row, room for a whole last tile */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < nkeys; j0 += 16) {
        int64_t slots[16];
        tile_slots(blocks, block_shift, j0, nkeys, 16, slots);
        const uint16_t *krow[16];
        for (int t = 0; t < 16; t++) krow[t] = kb + slots[t] * kv_stride;
        if (rows >= 3 && j0 + 16 < nkeys) { /* the next tile's rows: its block may lie anywhere */
            int j = j0 + 16;
            const char *nxt = (const char *)(kb + ((int64_t)blocks[j >> block_shift] * block_size +
                                                   (j & (block_size - 1))) * kv_stride);
            for (int b = 0; b < 16 * D * 2 && b < 4096; b += 64) _mm_prefetch(nxt + b, _MM_HINT_T0);
        }
        for (int r = 0; r < rows; r++) {
            int hi = r / nq, i = r % nq;
            if (causal && j0 > s0 + i) continue; /* the row sees no key of this tile */
            const uint16_t *qr = (const uint16_t *)q + (int64_t)(r0 + i) * q_stride + (int64_t)(h0 + hi) * q_hstride;
            __m512bh qv[8];
            for (int c = 0; c < C; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
            __m512 part[16];
            for (int t = 0; t < 16; t++) {
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < C; c++)
                    a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(krow[t] + 32 * c));
                part[t] = a;
            }
            _mm512_storeu_ps(scores + (size_t)r * stride16 + j0, _mm512_mul_ps(sum16(part), vscale));
        }
    }
    for (int r = 0; r < rows; r++) {
        float *sr = scores + (size_t)r * stride16;
        int len = causal ? s0 + r % nq + 1 : nkeys;
#if defined(__AVX2__) && defined(__FMA__)
        if (fixed_softmax) /* sums in an order set by len alone, not by the row's alignment */
            softmax_row8(sr, len);
        else
#endif
            softmax_row(sr, len);
        for (int j = len; j < nkeys; j++) sr[j] = 0.0f; /* keys the row may not see weigh 0 */
    }
    /* RB rows' accumulators (RB * D / 16 zmm) stay in registers across the keys */
    enum { RB = 4 };
    for (int rb = 0; rb < rows; rb += RB) {
        int nr = rows - rb < RB ? rows - rb : RB;
        int last = 0; /* keys past every row's last visible one are skipped */
        for (int r = rb; r < rb + nr; r++) {
            int len = causal ? s0 + r % nq + 1 : nkeys;
            last = len > last ? len : last;
        }
        __m512 acc[RB][16];
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < D / 16; c++) acc[r][c] = _mm512_setzero_ps();
        int64_t slot = 0;
        for (int j = 0; j < last; j++) {
            slot = (j & (block_size - 1)) ? slot + 1 : (int64_t)blocks[j >> block_shift] * block_size;
            const uint16_t *vr = vb + slot * kv_stride;
            if (nr >= 3 && !(j & (block_size - 1)) && j + block_size < last) { /* the next block's rows */
                int jn = j + block_size;
                const char *nxt = (const char *)(vb + (int64_t)blocks[jn >> block_shift] * block_size * kv_stride);
                for (int b = 0; b < block_size * D * 2 && b < 4096; b += 64) _mm_prefetch(nxt + b, _MM_HINT_T0);
            }
            __m512 v[16];
            for (int c = 0; c < D / 16; c++) v[c] = widen16(vr + 16 * c);
            for (int r = 0; r < nr; r++) {
                __m512 p = _mm512_set1_ps(scores[(size_t)(rb + r) * stride16 + j]);
                for (int c = 0; c < D / 16; c++) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
            }
        }
        for (int r = 0; r < nr; r++) {
            int hi = (rb + r) / nq, i = (rb + r) % nq;
            float buf[256];
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(buf + 16 * c, acc[r][c]);
            store_at(out, 1, ((int64_t)(r0 + i) * H + h0 + hi) * D, D, buf);
        }
    }
}

/* A 16x16 block of dwords transposed in registers: r[t] = row t in, r[p] = column p out (lane
 * t = row t's dword p): pairs of dwords, then of qwords, interleaved within 128-bit lanes, then
 * the lanes themselves moved (64 shuffles). */
static inline __attribute__((always_inline)) void transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    /* u[4m + c], 128-bit lane L: column 4L + c of rows 4m .. 4m + 3 */
    for (int m = 0; m < 4; m++) {
        u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) { /* a 4x4 transpose of the 128-bit lanes of u[c], u[4 + c], .. */
        __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
}

/* Keys j0 .. j0 + 15 (a tile; past nkeys, key j0 again) as dword pairs in columns: kt [P2][16],
 * kt[p][t] = dword p of key t's row (P2 = D / 2 dword pairs a row, a multiple of 16) */
static inline __attribute__((always_inline)) void transpose_key_tile(const uint16_t *kb, int64_t kv_stride,
                                                                     const int32_t *blocks, int block_shift,
                                                                     int j0, int nkeys, int P2, uint32_t *kt) {
    int64_t slots[16];
    tile_slots(blocks, block_shift, j0, nkeys, 16, slots);
    for (int b = 0; b < P2 / 16; b++) {
        __m512i t[16];
        for (int k = 0; k < 16; k++) t[k] = _mm512_loadu_si512(kb + slots[k] * kv_stride + 32 * b);
        transpose16x16(t);
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(kt + 16 * (16 * b + p), t[p]);
    }
}

/* acc[r] (16 keys) = q_r . k over D/2 dword pairs: kt [D/2][16] (the tile transposed), each q
 * pair broadcast; NR rows at once, so NR independent sums hide the product's latency */
static inline __attribute__((always_inline)) void tile_scores(const uint32_t *kt, const uint32_t *const *qp,
                                                              int P2, const int NR, __m512 acc[8]) {
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < P2; p++) {
        __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + 16 * p);
        for (int r = 0; r < NR; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], kv, (__m512bh)_mm512_set1_epi32((int)qp[r][p]));
    }
}

/* acc[r][c] += the value rows weighted by probabilities, two keys a product: vp [pairs][D] dwords
 * (keys 2j and 2j + 1 interleaved), pb[r] row r's probabilities as bf16 pairs */
static inline __attribute__((always_inline)) void pairs_values(const uint32_t *vp, const uint32_t *const *pb,
                                                               int npairs, const int NR, const int CH,
                                                               __m512 (*acc)[8]) {
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < CH; c++) acc[r][c] = _mm512_setzero_ps();
    for (int jp = 0; jp < npairs; jp++) {
        const uint32_t *v = vp + (size_t)jp * CH * 16;
        __m512bh vv[8];
        for (int c = 0; c < CH; c++) vv[c] = (__m512bh)_mm512_loadu_si512(v + 16 * c);
        for (int r = 0; r < NR; r++) {
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)pb[r][jp]);
            for (int c = 0; c < CH; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], p);
        }
    }
}

/* The work item in bfloat16 for many query rows (verify blocks, prefill pieces; D 64 or 128,
 * CH = D / 16): the same maths as attend_item_bf16 in fewer instructions where rows share keys.
 * Scores: each 16-key tile is transposed once (dword pairs of its rows as columns) and every
 * query row's scores against it are D / 2 vdpbf16ps with the row's pairs broadcast, no
 * horizontal sums. Softmax in float32 as everywhere. Values: the probabilities are rounded to
 * bf16 (as FlashAttention rounds them for its second product) and multiplied two keys a
 * product against value rows interleaved in pairs once per item, so each output element is
 * float32 sums of exact products. kt: D * 32 bytes; vbuf: (nkeys + 1) / 2 * D dwords. */
static inline __attribute__((always_inline)) void attend_item_bf16_rows(
    const void *q, int64_t q_stride, int64_t q_hstride, const void *kh, const void *vh,
    int64_t kv_stride, void *out, int H, const int D, float scale, int causal, int r0, int nq, int s0,
    const int32_t *blocks, int block_shift, int h0, int nh, int64_t max_keys, float *scores,
    uint32_t *kt, uint32_t *vbuf, int fixed) {
    const int block_size = 1 << block_shift;
    const int nkeys = s0 + nq, rows = nh * nq, P2 = D / 2, CH = D / 16;
    const uint16_t *kb = (const uint16_t *)kh, *vb = (const uint16_t *)vh;
    const int64_t stride16 = max_keys + 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < nkeys; j0 += 16) {
        transpose_key_tile(kb, kv_stride, blocks, block_shift, j0, nkeys, P2, kt);
        for (int rb = 0; rb < rows; rb += 8) {
            int nr = rows - rb < 8 ? rows - rb : 8;
            const uint32_t *qp[8];
            for (int r = 0; r < nr; r++) {
                int hi = (rb + r) / nq, i = (rb + r) % nq;
                qp[r] = (const uint32_t *)((const uint16_t *)q + (int64_t)(r0 + i) * q_stride +
                                           (int64_t)(h0 + hi) * q_hstride);
            }
            __m512 acc[8];
            switch (nr) { /* a constant row count per call, so the sums stay in registers */
            case 1: tile_scores(kt, qp, P2, 1, acc); break;
            case 2: tile_scores(kt, qp, P2, 2, acc); break;
            case 3: tile_scores(kt, qp, P2, 3, acc); break;
            case 4: tile_scores(kt, qp, P2, 4, acc); break;
            case 5: tile_scores(kt, qp, P2, 5, acc); break;
            case 6: tile_scores(kt, qp, P2, 6, acc); break;
            case 7: tile_scores(kt, qp, P2, 7, acc); break;
            default: tile_scores(kt, qp, P2, 8, acc); break;
            }
            for (int r = 0; r < nr; r++)
                _mm512_storeu_ps(scores + (size_t)(rb + r) * stride16 + j0, _mm512_mul_ps(acc[r], vscale));
        }
    }
    /* value rows of keys 2j, 2j + 1 interleaved: dword d of pair j = (v[2j+1][d] << 16) | v[2j][d] */
    const int npairs_all = (nkeys + 1) / 2;
    int64_t slot = 0;
    for (int j = 0; j < 2 * npairs_all; j++) {
        if (j < nkeys)
            slot = (j & (block_size - 1)) ? slot + 1 : (int64_t)blocks[j >> block_shift] * block_size;
        uint32_t *dst = vbuf + (size_t)(j >> 1) * D;
        for (int c = 0; c < CH; c++) {
            __m512i w = j < nkeys ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + slot * kv_stride + 16 * c)))
                                  : _mm512_setzero_si512();
            if (j & 1)
                _mm512_storeu_si512(dst + 16 * c, _mm512_or_si512(_mm512_loadu_si512(dst + 16 * c), _mm512_slli_epi32(w, 16)));
            else
                _mm512_storeu_si512(dst + 16 * c, w);
        }
    }
    /* softmax, then each row's probabilities as bf16 in place (pairs of keys per dword; keys the
     * row may not see, and a last odd key's partner, weigh 0) */
    for (int r = 0; r < rows; r++) {
        float *sr = scores + (size_t)r * stride16;
        int len = causal ? s0 + r % nq + 1 : nkeys;
        if (fixed)
            softmax_row_fixed(sr, len);
        else
            softmax_row(sr, len);
        for (int j = len; j < 2 * npairs_all; j++) sr[j] = 0.0f;
        for (int j = 0; j < 2 * npairs_all; j += 16) { /* reads floats j.., writes bf16 over floats < j */
            __m512 x = _mm512_loadu_ps(sr + j);
            _mm256_storeu_si256((__m256i *)((uint16_t *)sr + j), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
    enum { RB = 6 };
    for (int rb = 0; rb < rows; rb += RB) {
        int nr = rows - rb < RB ? rows - rb : RB;
        int last = 0; /* key pairs past every row's last visible key are skipped */
        const uint32_t *pb[RB];
        for (int r = 0; r < nr; r++) {
            int len = causal ? s0 + (rb + r) % nq + 1 : nkeys;
            last = len > last ? len : last;
            pb[r] = (const uint32_t *)(scores + (size_t)(rb + r) * stride16);
        }
        int np = (last + 1) / 2;
        __m512 acc[6][8];
        if (CH == 4) {
            switch (nr) {
            case 1: pairs_values(vbuf, pb, np, 1, 4, acc); break;
            case 2: pairs_values(vbuf, pb, np, 2, 4, acc); break;
            case 3: pairs_values(vbuf, pb, np, 3, 4, acc); break;
            case 4: pairs_values(vbuf, pb, np, 4, 4, acc); break;
            case 5: pairs_values(vbuf, pb, np, 5, 4, acc); break;
            default: pairs_values(vbuf, pb, np, 6, 4, acc); break;
            }
        } else { /* CH 8: three rows a pass keep 24 sums and 8 value vectors in registers */
            for (int r3 = 0; r3 < nr; r3 += 3) {
                int n3 = nr - r3 < 3 ? nr - r3 : 3;
                if (n3 == 1) pairs_values(vbuf, pb + r3, np, 1, 8, acc + r3);
                else if (n3 == 2) pairs_values(vbuf, pb + r3, np, 2, 8, acc + r3);
                else pairs_values(vbuf, pb + r3, np, 3, 8, acc + r3);
            }
        }
        for (int r = 0; r < nr; r++) {
            int hi = (rb + r) / nq, i = (rb + r) % nq;
            float buf[128];
            for (int c = 0; c < CH; c++) _mm512_storeu_ps(buf + 16 * c, acc[r][c]);
            store_at(out, 1, ((int64_t)(r0 + i) * H + h0 + hi) * D, D, buf);
        }
    }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* The work item on AMX tiles (D 64 or 128; where the build targets AMX and Linux grants the
 * tile state): the maths of attend_item_bf16_rows with both products on the tiles, so a query
 * row costs little beyond the keys' and values' one pass (on the AVX512 path every row adds
 * its own products: a verify block of 4 tokens cost ~2.5x a lone token's attention at 32
 * requests). The item's query rows are copied into qbuf in groups of 16 (a group's last rows
 * zero); each 16-key tile is transposed once into kt (the B tile of Q K^T: dword pairs of its
 * rows as columns) and every group's scores against it are D / 32 tile products, stored as
 * rows of `scores`. Softmax in float32 as everywhere, the probabilities rounded to bf16 in
 * place (zero past each row's last visible key, up to a multiple of 32 keys); values
 * interleaved in pairs of keys into vbuf (the B tiles of P V) and summed four 16-column tiles
 * a pass. Every product exact, float32 sums; the output rounded once. Tiles: 0 scores, 1 and 2
 * A, 2 and 3 B, 4-7 the output's columns; all configured 16 rows of 64 bytes. */
static inline __attribute__((always_inline)) void attend_item_amx(
    const void *q, int64_t q_stride, int64_t q_hstride, const void *kh, const void *vh,
    int64_t kv_stride, void *out, int H, const int D, float scale, int causal, int r0, int nq, int s0,
    const int32_t *blocks, int block_shift, int h0, int nh, int64_t max_keys, float *scores,
    uint32_t *kt, uint32_t *vbuf, uint16_t *qbuf, float *obuf, int fixed) {
    const int block_size = 1 << block_shift;
    const int nkeys = s0 + nq, rows = nh * nq, P2 = D / 2, groups = (rows + 15) / 16;
    const int kpad = (nkeys + 31) & ~31; /* keys rounded up to a P tile's 32 */
    const uint16_t *kb = (const uint16_t *)kh, *vb = (const uint16_t *)vh;
    const int64_t stride16 = max_keys + 16;
    for (int r = 0; r < 16 * groups; r++) {
        uint16_t *dst = qbuf + (size_t)r * D;
        if (r < rows)
            memcpy(dst, (const uint16_t *)q + (int64_t)(r0 + r % nq) * q_stride + (int64_t)(h0 + r / nq) * q_hstride,
                   sizeof(uint16_t) * D);
        else
            memset(dst, 0, sizeof(uint16_t) * D);
    }
    for (int j0 = 0; j0 < nkeys; j0 += 16) {
        transpose_key_tile(kb, kv_stride, blocks, block_shift, j0, nkeys, P2, kt);
        for (int gr = 0; gr < groups; gr++) {
            _tile_zero(0);
            for (int b = 0; b < P2 / 16; b++) {
                _tile_loadd(1, qbuf + (size_t)gr * 16 * D + 32 * b, D * 2);
                _tile_loadd(2, kt + 256 * b, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, scores + (size_t)gr * 16 * stride16 + j0, stride16 * 4);
        }
    }
    /* softmax, then the probabilities as bf16 over the row's first floats (a 16-float read
     * comes before the write that reaches it) */
    for (int r = 0; r < rows; r++) {
        float *sr = scores + (size_t)r * stride16;
        int len = causal ? s0 + r % nq + 1 : nkeys;
        for (int j = 0; j < len; j++) sr[j] *= scale;
        if (fixed)
            softmax_row_fixed(sr, len);
        else
            softmax_row(sr, len);
        uint16_t *pr = (uint16_t *)sr;
        for (int j = 0; j < kpad; j += 16) {
            __mmask16 m = len - j >= 16 ? (__mmask16)0xFFFF : len > j ? (__mmask16)((1u << (len - j)) - 1) : 0;
            __m512 x = _mm512_maskz_loadu_ps(m, sr + j);
            _mm256_storeu_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
    /* value rows of keys 2p, 2p + 1 interleaved: dword d of pair p = (v[2p+1][d] << 16) | v[2p][d] */
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    {
        uint16_t il[32], ih[32];
        for (int k = 0; k < 16; k++) {
            il[2 * k] = (uint16_t)k, il[2 * k + 1] = (uint16_t)(32 + k);
            ih[2 * k] = (uint16_t)(16 + k), ih[2 * k + 1] = (uint16_t)(48 + k);
        }
        lo = _mm512_loadu_si512(il), hi = _mm512_loadu_si512(ih);
    }
    int64_t slot = 0;
    for (int p = 0; p < kpad / 2; p++) {
        __m512i a[4], b[4];
        for (int e = 0; e < 2; e++) {
            int j = 2 * p + e;
            __m512i *dst = e ? b : a;
            if (j < nkeys) {
                slot = (j & (block_size - 1)) ? slot + 1 : (int64_t)blocks[j >> block_shift] * block_size;
                for (int c = 0; c < D / 32; c++) dst[c] = _mm512_loadu_si512(vb + slot * kv_stride + 32 * c);
            } else {
                for (int c = 0; c < D / 32; c++) dst[c] = _mm512_setzero_si512();
            }
        }
        uint32_t *dst = vbuf + (size_t)p * D;
        for (int c = 0; c < D / 32; c++) {
            _mm512_storeu_si512(dst + 32 * c, _mm512_permutex2var_epi16(a[c], lo, b[c]));
            _mm512_storeu_si512(dst + 32 * c + 16, _mm512_permutex2var_epi16(a[c], hi, b[c]));
        }
    }
    for (int gr = 0; gr < groups; gr++) {
        int last = 0; /* key pairs past every row's last visible key are skipped */
        for (int r = 16 * gr; r < rows && r < 16 * gr + 16; r++) {
            int len = causal ? s0 + r % nq + 1 : nkeys;
            last = len > last ? len : last;
        }
        int kend = (last + 31) & ~31;
        const uint16_t *pg = (const uint16_t *)(scores + (size_t)gr * 16 * stride16);
        for (int c0 = 0; c0 < D / 16; c0 += 4) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int k0 = 0; k0 < kend; k0 += 32) {
                const uint32_t *vp = vbuf + (size_t)(k0 / 2) * D + 16 * c0;
                _tile_loadd(1, pg + k0, stride16 * 4);
                _tile_loadd(2, vp, D * 4);
                _tile_dpbf16ps(4, 1, 2);
                _tile_loadd(3, vp + 16, D * 4);
                _tile_dpbf16ps(5, 1, 3);
                _tile_loadd(2, vp + 32, D * 4);
                _tile_dpbf16ps(6, 1, 2);
                _tile_loadd(3, vp + 48, D * 4);
                _tile_dpbf16ps(7, 1, 3);
            }
            _tile_stored(4, obuf + 16 * c0, D * 4);
            _tile_stored(5, obuf + 16 * c0 + 16, D * 4);
            _tile_stored(6, obuf + 16 * c0 + 32, D * 4);
            _tile_stored(7, obuf + 16 * c0 + 48, D * 4);
        }
        for (int r = 16 * gr; r < rows && r < 16 * gr + 16; r++)
            store_at(out, 1, ((int64_t)(r0 + r % nq) * H + h0 + r / nq) * D, D, obuf + (size_t)(r - 16 * gr) * D);
    }
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* o[t] = sum of the 8 lanes of v[t], t < 8: a transpose-and-add tree of hadds */
static inline __m256 sum8(const __m256 v[8]) {
    __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* lanes: keys 0-3 | 4-7 halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* The work item in float32 on a CPU with AVX2 and FMA (D a multiple of 8, at most 256): the
 * scores of a query row against 8 keys are 8 dot products over D in register accumulators (four
 * keys in flight), summed by one sum8 tree and scaled; the softmax as everywhere; each output row
 * accumulated in registers over the value rows. Every row is computed alone in a fixed order:
 * how many rows or segments share the call changes nothing in it. */
static inline __attribute__((always_inline)) void attend_item_f32(
    const void *q, int64_t q_stride, int64_t q_hstride, const void *kh, const void *vh,
    int64_t kv_stride, void *out, int H, int D, float scale, int causal, int r0, int nq, int s0,
    const int32_t *blocks, int block_shift, int h0, int nh, int64_t max_keys, float *scores) {
    const int block_size = 1 << block_shift;
    const int nkeys = s0 + nq, rows = nh * nq, C = D / 8; /* ymm per row */
    const float *kf = (const float *)kh, *vf = (const float *)vh;
    const int64_t stride8 = max_keys + 16; /* a score row, room for a whole last tile */
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < nkeys; j0 += 8) {
        int64_t slots[8];
        tile_slots(blocks, block_shift, j0, nkeys, 8, slots);
        const float *krow[8];
        for (int t = 0; t < 8; t++) krow[t] = kf + slots[t] * kv_stride;
        for (int r = 0; r < rows; r++) {
            int hi = r / nq, i = r % nq;
            if (causal && j0 > s0 + i) continue; /* the row sees no key of this tile */
            const float *qr = (const float *)q + (int64_t)(r0 + i) * q_stride + (int64_t)(h0 + hi) * q_hstride;
            __m256 part[8];
            for (int t0 = 0; t0 < 8; t0 += 4) {
                __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int c = 0; c < C; c++) {
                    __m256 qc = _mm256_loadu_ps(qr + 8 * c);
                    for (int t = 0; t < 4; t++) a[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(krow[t0 + t] + 8 * c), a[t]);
                }
                for (int t = 0; t < 4; t++) part[t0 + t] = a[t];
            }
            _mm256_storeu_ps(scores + (size_t)r * stride8 + j0, _mm256_mul_ps(sum8(part), vscale));
        }
    }
    for (int r = 0; r < rows; r++) softmax_row8(scores + (size_t)r * stride8, causal ? s0 + r % nq + 1 : nkeys);
    for (int r = 0; r < rows; r++) {
        int hi = r / nq, i = r % nq;
        int len = causal ? s0 + i + 1 : nkeys;
        const float *sr = scores + (size_t)r * stride8;
        __m256 acc[32];
        for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
        int64_t slot = 0;
        for (int j = 0; j < len; j++) {
            slot = (j & (block_size - 1)) ? slot + 1 : (int64_t)blocks[j >> block_shift] * block_size;
            const float *vr = vf + slot * kv_stride;
            __m256 p = _mm256_set1_ps(sr[j]);
            for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[c]);
        }
        float *o = (float *)out + ((int64_t)(r0 + i) * H + h0 + hi) * D;
        for (int c = 0; c < C; c++) _mm256_storeu_ps(o + 8 * c, acc[c]);
    }
}
#endif

/* attend_item or, from TILED_ROWS query rows on, attend_item_tiled, with D a constant where it is
 * 64 or 128 (the compiler unrolls and vectorises the row loops) */
#define TILED_ROWS 8
/* bf16 items of this many query rows on take attend_item_bf16_rows */
#define BF16_ROWS 4
/* and, where the tiles may be used, attend_item_amx */
#ifndef AMX_ATTN_ROWS
#define AMX_ATTN_ROWS 4
#endif
static void attend(const void *q, int64_t q_stride, int64_t q_hstride, const void *kh, const void *vh,
                   int64_t kv_stride, void *out, int dtype, int H, int D, float scale, int causal,
                   int r0, int nq, int s0, const int32_t *blocks, int block_shift, int h0, int nh,
                   int64_t max_keys, float *scores, float *qf, float *acc, float *row, uint32_t *vbuf,
                   int amx, uint16_t *qbuf, int invariant) {
#define ATTEND_WITH(FN, DD)                                                                        \
    FN(q, q_stride, q_hstride, kh, vh, kv_stride, out, dtype, H, DD, scale, causal, r0, nq, s0,  \
       blocks, block_shift, h0, nh, max_keys, scores, qf, acc, row, invariant)
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    /* batch-invariant: one body for every row count (the tiles', or the many-row AVX512 one) */
    if (amx && (nh * nq >= AMX_ATTN_ROWS || invariant)) { /* amx: the caller checked dtype, D, the tiles */
        if (D == 64)
            attend_item_amx(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, 64, scale, causal, r0, nq, s0,
                            blocks, block_shift, h0, nh, max_keys, scores, (uint32_t *)row, vbuf, qbuf, acc,
                            invariant);
        else
            attend_item_amx(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, 128, scale, causal, r0, nq, s0,
                            blocks, block_shift, h0, nh, max_keys, scores, (uint32_t *)row, vbuf, qbuf, acc,
                            invariant);
        return;
    }
#else
    (void)amx;
    (void)qbuf;
#endif
#ifdef __AVX512BF16__
    if (dtype == 1 && D % 32 == 0 && D <= 256) {
        if ((nh * nq >= BF16_ROWS || invariant) && (D == 64 || D == 128)) {
            if (D == 64)
                attend_item_bf16_rows(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, 64, scale, causal, r0,
                                      nq, s0, blocks, block_shift, h0, nh, max_keys, scores, (uint32_t *)row, vbuf,
                                      invariant);
            else
                attend_item_bf16_rows(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, 128, scale, causal, r0,
                                      nq, s0, blocks, block_shift, h0, nh, max_keys, scores, (uint32_t *)row, vbuf,
                                      invariant);
            return;
        }
        if (D == 64)
            attend_item_bf16(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, 64, scale, causal, r0,
                             nq, s0, blocks, block_shift, h0, nh, max_keys, scores, invariant);
        else
            attend_item_bf16(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, D, scale, causal, r0,
                             nq, s0, blocks, block_shift, h0, nh, max_keys, scores, invariant);
        return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (dtype == 0 && D % 8 == 0 && D <= 256) {
        if (D == 64)
            attend_item_f32(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, 64, scale, causal, r0, nq,
                            s0, blocks, block_shift, h0, nh, max_keys, scores);
        else
            attend_item_f32(q, q_stride, q_hstride, kh, vh, kv_stride, out, H, D, scale, causal, r0, nq,
                            s0, blocks, block_shift, h0, nh, max_keys, scores);
        return;
    }
#endif
    if (nh * nq >= TILED_ROWS && !invariant) {
        if (D == 64) ATTEND_WITH(attend_item_tiled, 64);
        else if (D == 128) ATTEND_WITH(attend_item_tiled, 128);
        else ATTEND_WITH(attend_item_tiled, D);
    } else {
        if (D == 64) ATTEND_WITH(attend_item, 64);
        else if (D == 128) ATTEND_WITH(attend_item, 128);
        else ATTEND_WITH(attend_item, D);
    }
#undef ATTEND_WITH
}

/* 1 where bf16 items of AMX_ATTN_ROWS query rows or more (D 64 or 128) run on AMX tiles
 * (attend_item_amx: built for a CPU with them, and this process allowed to use them), 0 where
 * they run the AVX512 (or plain) paths. */
int paged_attention_tiles(void) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return amx_allowed();
#else
    return 0;
#endif
}

/* 1 where float32 attention runs attend_item_f32 (each row's output independent of what
 * shares the call), 0 where it runs the generic bodies (whose order of sums depends on the
 * number of rows in a work item). */
int paged_attention_f32_row_invariant(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* q: [T, H, D] with token and head strides q_stride, q_hstride (elements; each head's D
 * elements contiguous), out:
 * [T, H, D] contiguous; k_cache, v_cache: key/value row of cache slot s and kv head h at
 * element s * kv_token_stride + h * kv_head_stride (the target's head-major pool: D and
 * num_slots * D; a [slots, positions, Hkv, D] pool: Hkv * D and D); block_table: [G, max_blocks];
 * row0, n, start: [G]; block_shift: log2 of the block size; causal: 1 query i sees keys up to
 * start + i, 0 every query sees all start + n keys. Work items are (segment, kv head) with all
 * its query heads, or (segment, query head) when that is too few items to share between the
 * threads. Returns 0, or -1 when a work buffer could not be allocated. */
int paged_attention_ex(const void *q, int64_t q_stride, int64_t q_hstride, const void *k_cache,
                       const void *v_cache, void *out, int dtype, int G, const int32_t *row0, const int32_t *n,
                       const int32_t *start, const int32_t *block_table, int max_blocks, int block_shift,
                       int64_t kv_token_stride, int64_t kv_head_stride, int causal, int H, int Hkv, int D,
                       float scale, int flags) {
    const int invariant = (flags & ATTN_INVARIANT) != 0;
    int failed = 0;
    int threads = omp_get_max_threads();
    int group = H / Hkv;
    int nh = G * Hkv >= 4 * threads ? group : 1; /* query heads per item */
    int max_q = 0;
    int64_t max_keys = 0;
    for (int g = 0; g < G; g++) {
        if (n[g] > max_q) max_q = n[g];
        if (start[g] + n[g] > max_keys) max_keys = start[g] + n[g];
    }
    int chunk = max_q; /* query tokens per item */
#ifdef __AVX512BF16__
    if (dtype == 1 && (D == 64 || D == 128) && (max_q >= 4 || invariant)) {
        /* many rows a segment (verify blocks, prefill pieces, the drafter's block): every query
         * head of a kv head in one item, so its key tiles are transposed and its value rows
         * paired once (attend_item_bf16_rows), and the segment's tokens split into chunks so
         * that each thread has two items or more. A chunk of tokens i0 .. i0 + nc - 1 is a
         * segment of nc tokens with more keys before it: i0 more (causal: those tokens see no
         * further), or all but nc (not causal: every token sees every key). */
        nh = group;
        if (G * Hkv < 2 * threads) {
            int split = (2 * threads + G * Hkv - 1) / (G * Hkv);
            chunk = (max_q + split - 1) / split;
            if (chunk < 2) chunk = 2;
        }
    }
#endif
    int nchunks = (max_q + chunk - 1) / chunk;
    int items = G * (H / nh) * nchunks;
    size_t head_bytes = (size_t)kv_head_stride * (dtype == 0 ? 4 : 2);
    int amx = 0; /* items of AMX_ATTN_ROWS rows or more on the tiles */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    amx = dtype == 1 && (D == 64 || D == 128) &&
          (nh * (chunk < max_q ? chunk : max_q) >= AMX_ATTN_ROWS || invariant) && amx_allowed();
#endif
#pragma omp parallel
    {
        /* query rows of an item (on the tiles rounded up to their groups of 16) */
        size_t rows = (size_t)nh * (size_t)chunk;
        if (amx) rows = (rows + 15) / 16 * 16;
        /* scores: a row per query row, room for a whole last tile (and slack for the bf16
         * rounding pass's last 16-wide read) */
        float *scores = malloc(sizeof(float) * (rows * (size_t)(max_keys + 16) + 32));
        /* value pairs up to a multiple of 32 keys (the tiles' last pairs zero) */
        uint32_t *vbuf = malloc(sizeof(uint32_t) * (size_t)D * (size_t)((max_keys + 32) / 2));
        float *qf = malloc(sizeof(float) * rows * (size_t)D);
        float *acc = malloc(sizeof(float) * rows * (size_t)D);
        float *row = malloc(sizeof(float) * (size_t)D * KT); /* a key row, or a tile */
        uint16_t *qbuf = amx ? malloc(sizeof(uint16_t) * rows * (size_t)D) : NULL; /* the tiles' query rows */
        if (!scores || !qf || !acc || !row || !vbuf || (amx && !qbuf)) {
#pragma omp atomic write
            failed = 1;
        }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (amx) {
            const uint8_t tile_rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
            amx_load_config(tile_rows);
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            if (failed) continue;
            int per_seg = H / nh * nchunks;
            int g = item / per_seg, h0 = (item % per_seg) / nchunks * nh, hk = h0 / group;
            int i0 = (item % nchunks) * chunk;
            if (i0 >= n[g]) continue;
            int nc = n[g] - i0 < chunk ? n[g] - i0 : chunk;
            const void *kh = (const char *)k_cache + (size_t)hk * head_bytes;
            const void *vh = (const char *)v_cache + (size_t)hk * head_bytes;
            const int32_t *blocks = block_table + (int64_t)g * max_blocks;
            attend(q, q_stride, q_hstride, kh, vh, kv_token_stride, out, dtype, H, D, scale, causal,
                   row0[g] + i0, nc, causal ? start[g] + i0 : start[g] + n[g] - nc, blocks, block_shift,
                   h0, nh, max_keys, scores, qf, acc, row, vbuf, amx, qbuf, invariant);
        }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (amx) _tile_release();
#endif
        free(qbuf);
        free(scores);
        free(qf);
        free(acc);
        free(row);
        free(vbuf);
    }
    return failed ? -1 : 0;
}

int paged_attention(const void *q, int64_t q_stride, int64_t q_hstride, const void *k_cache,
                    const void *v_cache, void *out, int dtype, int G, const int32_t *row0, const int32_t *n,
                    const int32_t *start, const int32_t *block_table, int max_blocks, int block_shift,
                    int64_t kv_token_stride, int64_t kv_head_stride, int causal, int H, int Hkv, int D,
                    float scale) {
    return paged_attention_ex(q, q_stride, q_hstride, k_cache, v_cache, out, dtype, G, row0, n, start,
                              block_table, max_blocks, block_shift, kv_token_stride, kv_head_stride, causal, H,
                              Hkv, D, scale, 0);
}

/* Rotary embedding of a step's new tokens and their K/V written to the paged cache, in one pass
 * (in place of ~8 small torch kernels a layer). q [T, H, D] (token and head strides q_stride,
 * q_hstride; each head's D elements contiguous) is rotated in place; k [T, Hkv, D] (strides
 * k_stride, k_hstride) is rotated into the cache and v (token stride v_stride, heads at D)
 * copied there, at slots[t] of the head-major cache [Hkv, num_slots, D].
 * cos / sin: [T, D] with the sign of rotate_half folded into sin, so
 * rotated[d] = x[d] * cos[d] + x[(d + D/2) % D] * sin[d], computed in float32 and rounded once. */
void rope_store(void *q, int64_t q_stride, int64_t q_hstride, const void *k, int64_t k_stride,
                int64_t k_hstride, const void *v, int64_t v_stride, const void *cos,
                const void *sin, const int64_t *slots, void *k_cache, void *v_cache,
                int64_t num_slots, int dtype, int T, int H, int Hkv, int D) {
    int half = D / 2;
#pragma omp parallel for schedule(static) if (T * (H + Hkv) > 64)
    for (int t = 0; t < T; t++) {
        float c[256], s[256], x[256], r[256]; /* D <= 256 (checked by the caller) */
        load_at(cos, dtype, (int64_t)t * D, D, c);
        load_at(sin, dtype, (int64_t)t * D, D, s);
        for (int h = 0; h < H + Hkv; h++) {
            int is_q = h < H;
            const void *src = is_q ? q : k;
            int64_t off = is_q ? (int64_t)t * q_stride + (int64_t)h * q_hstride
                               : (int64_t)t * k_stride + (int64_t)(h - H) * k_hstride;
            load_at(src, dtype, off, D, x);
            for (int d = 0; d < half; d++) r[d] = x[d] * c[d] + x[d + half] * s[d];
            for (int d = half; d < D; d++) r[d] = x[d] * c[d] + x[d - half] * s[d];
            if (is_q)
                store_at(q, dtype, off, D, r);
            else
                store_at(k_cache, dtype, ((int64_t)(h - H) * num_slots + slots[t]) * D, D, r);
        }
        for (int hk = 0; hk < Hkv; hk++) {
            load_at(v, dtype, (int64_t)t * v_stride + (int64_t)hk * D, D, x);
            store_at(v_cache, dtype, ((int64_t)hk * num_slots + slots[t]) * D, D, x);
        }
    }
}
