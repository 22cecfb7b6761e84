/* Linear layers computed from GGUF's own weight blocks: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
 * x and y float32, W the file's blocks as llama.cpp writes them (ggml-common.h), read in place:
 *
 *   Q4_0  18 bytes / 32 weights: f16 d; u8 qs[16]           w[j] = d * (nibble_j - 8)
 *   Q4_1  20 bytes / 32 weights: f16 d; f16 m; u8 qs[16]    w[j] = d * nibble_j + m
 *   Q8_0  34 bytes / 32 weights: f16 d; i8 qs[32]           w[j] = d * qs[j]
 *
 * (nibble_j, j < 16: the low nibble of qs[j]; j >= 16: the high nibble of qs[j - 16]).
 *
 * Decoding reads every weight once per token, so the bytes read are the time: these blocks are
 * 5.0 (Q4_1) or 8.5 (Q8_0) bits a weight against float32's 32. As llama.cpp does, each row of
 * x is quantized once per call to int8 in blocks of 32 (scale amax / 127, rounded to nearest
 * even, so |q| <= 127), and a block's products are exact integer dot products:
 *
 *   y[m, n] = sum_b ( dw_b * da_b * sum_j wq_j * aq_j  +  mw_b * da_b * sum_j aq_j )
 *
 * with Q4_0 as Q4_1 whose minimum is -8 d. The float part has one order whatever M is, which
 * CPU path runs, or which other rows share the call: eight lanes per output, lane l holding the
 * integer sum of products 4l .. 4l + 3 of each block, accumulated block by block with one fused
 * multiply-add (scale dw * da); the minimum terms in a scalar in block order; at the end the
 * lanes summed in one tree, then the minimum terms, then the bias. So a row's outputs are the
 * same bits alone or in a batch of any size, on AVX2 (maddubs), AVX512-VNNI / AVX-VNNI (dpbusd,
 * the same integers) and plain C: speculation and batching stay exact by construction.
 *
 * A weight block is unpacked once per call for up to QM rows of x (a verification step reads
 * each weight byte once); the rows of W are split between threads in equal runs, each output
 * computed whole by one thread.
 *
 * Built with the other kernels into one library by ops/cpu_kernels.py. */
#if defined(__GNUC__) && !defined(__clang__)
/* the sums above in their written order, and a product never fused into a sum unless written so */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define QUANT_VNNI 1
#endif
#endif

#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__clang__)
#define IN_ORDER_HERE _Pragma("clang fp reassociate(off)")
#else
#define IN_ORDER_HERE
#endif

#define QK 32 /* weights per block */
#define QM 8  /* rows of x per pass over a weight row */
#ifndef QPF
#define QPF 8192 /* bytes of weights prefetched ahead into L2 */
#endif

/* One block of a quantized row of x: scale, scale * sum of q, and q. */
typedef struct {
    float d, s;
    int8_t q[QK];
} ActBlock;

int quant_block_bytes(int type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return 18;
    case GGML_TYPE_Q4_1: return 20;
    case GGML_TYPE_Q8_0: return 34;
    default: return 0;
    }
}

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef QUANT_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: exact in float */
        v.f = ldexpf((float)man, -24);
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
#endif
}

/* One row of x [K] -> K / 32 blocks. */
static void quantize_row(const float *x, ActBlock *out, int nb) {
    for (int b = 0; b < nb; b++) {
        const float *xb = x + (size_t)b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            float v = nearbyintf(xb[j] * id);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            out[b].q[j] = (int8_t)v;
            sum += (int)v;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

/* A weight block's scale and minimum (Q8_0: no minimum), and where its quants start. */
static inline __attribute__((always_inline)) const uint8_t *block_head(const uint8_t *wb, int type, float *dw,
                                                                      float *mw) {
    *dw = half_to_float(wb);
    if (type == GGML_TYPE_Q4_1) {
        *mw = half_to_float(wb + 2);
        return wb + 4;
    }
    *mw = type == GGML_TYPE_Q4_0 ? -8.0f * *dw : 0.0f;
    return wb + 2;
}

/* lanes l = 0..7 -> one float: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
static inline float lanes_sum(const float l[8]) {
    IN_ORDER_HERE
    float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
    float b0 = a0 + a2, b1 = a1 + a3;
    return b0 + b1;
}

#ifdef QUANT_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l + l4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                       /* + l2/l6 */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                         /* + odd */
    return _mm_cvtss_f32(s);
}

/* int32 lanes l = sum of products 4l .. 4l + 3 of unsigned u and signed s */
static inline __m256i dot_lanes(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(QUANT_VNNI)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* out[r, m] (r < R, m < MC) for R weight rows (row_bytes apart) against MC rows of quantized
 * x, R * MC <= 8: several rows at once keep independent sums in flight (one output's sums are
 * a chain of dependent adds) and share each block of x; every output's order is the same. */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *w, int64_t row_bytes, int type, int ts,
                                                           const ActBlock *a, int nb, const int R, const int MC,
                                                           float *out, int64_t os) {
    __m256 acc[4][QM];
    float summ[4][QM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) {
            acc[r][m] = _mm256_setzero_ps();
            summ[r][m] = 0.0f;
        }
    for (int b = 0; b < nb; b++) {
        __m256i q[QM];
        for (int m = 0; m < MC; m++) q[m] = _mm256_loadu_si256((const __m256i *)a[(size_t)m * nb + b].q);
        for (int r = 0; r < R; r++) {
            float dw, mw;
            const uint8_t *wb = w + (size_t)r * row_bytes + (size_t)b * ts;
            _mm_prefetch((const char *)wb + QPF, _MM_HINT_T1);
            const uint8_t *qs = block_head(wb, type, &dw, &mw);
            __m256i wu, wsign = _mm256_setzero_si256();
            if (type == GGML_TYPE_Q8_0) {
                wsign = _mm256_loadu_si256((const __m256i *)qs);
                wu = _mm256_sign_epi8(wsign, wsign); /* |w| */
            } else {
                __m128i t = _mm_loadu_si128((const __m128i *)qs);
                wu = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
            }
            for (int m = 0; m < MC; m++) {
                const ActBlock *ab = a + (size_t)m * nb + b;
                __m256i qm = type == GGML_TYPE_Q8_0 ? _mm256_sign_epi8(q[m], wsign) : q[m];
                __m256 p = _mm256_cvtepi32_ps(dot_lanes(wu, qm));
                acc[r][m] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * ab->d), acc[r][m]);
                if (type != GGML_TYPE_Q8_0) summ[r][m] = fmaf(mw, ab->s, summ[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) out[m * os + r] = hsum8(acc[r][m]) + summ[r][m];
}
#else
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *w, int64_t row_bytes, int type, int ts,
                                                           const ActBlock *a, int nb, const int R, const int MC,
                                                           float *out, int64_t os) {
    IN_ORDER_HERE
    for (int r = 0; r < R; r++) {
        float acc[QM][8], summ[QM];
        memset(acc, 0, sizeof(acc));
        memset(summ, 0, sizeof(summ));
        for (int b = 0; b < nb; b++) {
            float dw, mw;
            const uint8_t *qs = block_head(w + (size_t)r * row_bytes + (size_t)b * ts, type, &dw, &mw);
            int wq[QK];
            for (int j = 0; j < QK; j++)
                wq[j] = type == GGML_TYPE_Q8_0 ? (int)(int8_t)qs[j] : (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4);
            for (int m = 0; m < MC; m++) {
                const ActBlock *ab = a + (size_t)m * nb + b;
                const float scale = dw * ab->d;
                for (int l = 0; l < 8; l++) {
                    int s = 0;
                    for (int j = 4 * l; j < 4 * l + 4; j++) s += wq[j] * ab->q[j];
                    acc[m][l] = fmaf((float)s, scale, acc[m][l]);
                }
                if (type != GGML_TYPE_Q8_0) summ[m] = fmaf(mw, ab->s, summ[m]);
            }
        }
        for (int m = 0; m < MC; m++) out[m * os + r] = lanes_sum(acc[m]) + summ[m];
    }
}
#endif

/* rows [n0, n1) of W against all M rows of quantized x, in tiles of R weight rows by MC rows
 * of x (R * MC <= 8; constants at each call, so the sums stay in registers); one body per type
 * so the type's branches fold away */
static inline __attribute__((always_inline)) void rows_range(const uint8_t *w, int64_t row_bytes, int type,
                                                             const ActBlock *a, const float *bias, float *y,
                                                             int M, int N, int nb, int n0, int n1) {
    const int ts = quant_block_bytes(type);
    for (int m0 = 0; m0 < M; m0 += QM) {
        const int mc = M - m0 < QM ? M - m0 : QM;
        const ActBlock *am = a + (size_t)m0 * nb;
        float *ym = y + (size_t)m0 * N;
        int n = n0;
#define TILES(R, MC)                                                                                    \
    for (; n + (R) <= n1; n += (R)) tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, R, MC, ym + n, N);
        switch (mc) {
        case 1: TILES(4, 1) break;
        case 2: TILES(4, 2) break;
        case 3: TILES(2, 3) break;
        case 4: TILES(2, 4) break;
        case 5: TILES(1, 5) break;
        case 6: TILES(1, 6) break;
        case 7: TILES(1, 7) break;
        default: TILES(1, 8) break;
        }
#undef TILES
        for (; n < n1; n++) { /* the last rows of an odd run, one at a time */
            switch (mc) {
            case 1: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 1, ym + n, N); break;
            case 2: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 2, ym + n, N); break;
            case 3: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 3, ym + n, N); break;
            case 4: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 4, ym + n, N); break;
            case 5: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 5, ym + n, N); break;
            case 6: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 6, ym + n, N); break;
            case 7: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 7, ym + n, N); break;
            default: tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, am, nb, 1, 8, ym + n, N); break;
            }
        }
    }
    if (bias)
        for (int m = 0; m < M; m++)
            for (int n = n0; n < n1; n++) y[(size_t)m * N + n] += bias[n];
}

/* x [M, K] (row stride xs, float32); w: N rows of K / 32 blocks of `type`, row_bytes apart;
 * bias [N] or NULL; y [M, N] contiguous float32. Returns 0, -1 for a type without a kernel or
 * K not a multiple of 32, -2 when the work buffer could not be allocated. */
int quant_gemm(const float *x, int64_t xs, const void *w, int64_t row_bytes, int type, const float *bias,
               float *y, int M, int N, int K) {
    if (quant_block_bytes(type) == 0 || K % QK != 0) return -1;
    const int nb = K / QK;
    ActBlock *a = malloc(sizeof(ActBlock) * (size_t)M * nb);
    if (!a) return -2;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) quantize_row(x + (size_t)m * xs, a + (size_t)m * nb, nb);
        /* equal runs of rows, whole groups of 8 (a cache line of outputs rarely shared) */
        int nth = 1, me = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        const int groups = (N + 7) / 8, per = (groups + nth - 1) / nth;
        int n0 = me * per * 8, n1 = (me + 1) * per * 8;
        n1 = n1 > N ? N : n1;
        if (n0 < n1) {
            const uint8_t *wb = (const uint8_t *)w;
            switch (type) {
            case GGML_TYPE_Q4_0: rows_range(wb, row_bytes, GGML_TYPE_Q4_0, a, bias, y, M, N, nb, n0, n1); break;
            case GGML_TYPE_Q4_1: rows_range(wb, row_bytes, GGML_TYPE_Q4_1, a, bias, y, M, N, nb, n0, n1); break;
            default: rows_range(wb, row_bytes, GGML_TYPE_Q8_0, a, bias, y, M, N, nb, n0, n1); break;
            }
        }
    }
    free(a);
    return 0;
}

/* rows `ids` [n] of a quantized matrix (row_bytes apart) -> out [n, K] float32, exactly the
 * blocks' values (an embedding lookup from the file's blocks). Returns 0 or -1 (type). */
int quant_rows(const void *w, int64_t row_bytes, int type, const int64_t *ids, int n, int K, float *out) {
    const int ts = quant_block_bytes(type);
    if (ts == 0 || K % QK != 0) return -1;
    for (int i = 0; i < n; i++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)ids[i] * row_bytes;
        float *o = out + (size_t)i * K;
        for (int b = 0; b < K / QK; b++) {
            float dw, mw;
            const uint8_t *qs = block_head(wr + (size_t)b * ts, type, &dw, &mw);
            for (int j = 0; j < QK; j++) {
                int q = type == GGML_TYPE_Q8_0 ? (int)(int8_t)qs[j] : (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4);
                if (type == GGML_TYPE_Q4_0) q -= 8;
                o[b * QK + j] = type == GGML_TYPE_Q4_1 ? dw * (float)q + mw : dw * (float)q;
            }
        }
    }
    return 0;
}

/* Which integer dot the build uses: 0 plain C, 1 AVX2 maddubs, 2 VNNI dpbusd. */
int quant_gemm_path(void) {
#if defined(QUANT_VNNI)
    return 2;
#elif defined(QUANT_AVX2)
    return 1;
#else
    return 0;
#endif
}
