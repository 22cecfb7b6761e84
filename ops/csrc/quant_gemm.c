/* Linear layers computed from GGUF's own weight blocks: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
 * x and y float32, W given as the file's blocks as llama.cpp writes them (ggml-common.h):
 *
 *   Q4_0  18 bytes / 32 weights: f16 d; u8 qs[16]           w[j] = d * (nibble_j - 8)
 *   Q4_1  20 bytes / 32 weights: f16 d; f16 m; u8 qs[16]    w[j] = d * nibble_j + m
 *   Q8_0  34 bytes / 32 weights: f16 d; i8 qs[32]           w[j] = d * qs[j]
 *
 * (nibble_j, j < 16: the low nibble of qs[j]; j >= 16: the high nibble of qs[j - 16]).
 *
 * Decoding reads every weight once per token, so the bytes read are the time: these blocks are
 * 5.0 (Q4_1) or 8.5 (Q8_0) bits a weight against float32's 32. quant_pack rearranges a matrix's
 * blocks once at load, losslessly and in as many bytes, into panels of 16 rows: per panel and
 * block the 16 rows' scales (and minimums), then per input k (two k a byte for 4-bit types) the
 * 16 rows' quants side by side. So one load and a few instructions dequantize weight k of 16
 * rows into one register (two of 8 lanes on AVX2) of exactly the float32 values above (a
 * product, then a sum: never fused, so they are the values llama.cpp's and gguf's dequantizers
 * give), and each row of x multiplies it with one fused multiply-add per k.
 *
 * The order of sums is small_gemm_f32's (csrc/small_gemm.c): each output is one chain of fused
 * multiply-adds over k = 0 .. K - 1 from zero, then the bias. So on CPUs with FMA the product is
 * bit for bit the float32 gemm of the dequantized weights: the blocks serve exactly the model
 * `--weights fp32` serves, in fewer bytes; and a row's outputs are the same bits alone or in a
 * batch of any size, on AVX512, AVX2 and plain C alike (speculation and batching stay exact).
 *
 * Several panels (or rows of x) are worked at once so that independent chains hide the
 * multiply-add latency; the panels are split between threads in equal runs, each output
 * computed whole by one thread; the panel stream is prefetched QPF bytes ahead.
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_512 1
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
#define PR 16 /* rows per panel */
#ifdef QUANT_512
#define QM 16 /* accumulators a tile holds: one register of 16 rows per panel and row of x */
#else
#define QM 6 /* ... two of 8 (AVX2; plain C alike) */
#endif
#ifndef QPF
#define QPF 16384 /* bytes of the panel stream prefetched ahead into L2 */
#endif

#ifndef QUANT_PANELS_OF
int quant_block_bytes(int type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return 18;
    case GGML_TYPE_Q4_1: return 20;
    case GGML_TYPE_Q8_0: return 34;
    default: return 0;
    }
}

#endif

/* A panel's bytes per block: scales (and minimums) of its 16 rows, then their quants. */
static inline int panel_block_bytes(int type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return 2 * PR + PR * QK / 2;
    case GGML_TYPE_Q4_1: return 4 * PR + PR * QK / 2;
    case GGML_TYPE_Q8_0: return 2 * PR + PR * QK;
    default: return 0;
    }
}

#ifndef QUANT_PANELS_OF
/* The bytes quant_pack writes for N rows of K (0 for a type without a kernel). */
int64_t quant_pack_bytes(int type, int N, int K) {
    return (int64_t)((N + PR - 1) / PR) * (K / QK) * panel_block_bytes(type);
}

#endif

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

/* quant j (0..31) of a GGUF block's quants `qs` (signed for Q8_0, 0..15 otherwise) */
static inline int block_quant(const uint8_t *qs, int type, int j) {
    if (type == GGML_TYPE_Q8_0) return (int8_t)qs[j];
    return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
}

/* the float32 weight of quant q with scale d and minimum m: a product, then a sum */
static inline float weight_value(int type, int q, float d, float m) {
    if (type == GGML_TYPE_Q4_1) return d * (float)q + m;
    return type == GGML_TYPE_Q4_0 ? d * (float)(q - 8) : d * (float)q;
}

#ifndef QUANT_PANELS_OF
/* w: N rows of K / 32 GGUF blocks of `type`, row_bytes apart -> out (quant_pack_bytes of it):
 * per panel of 16 rows (the last one padded with zero rows) and block: the rows' f16 scales
 * (Q4_1: then their f16 minimums), then per k the rows' quants (4-bit types: byte r of pair p
 * holds row r's quant 2p in its low nibble and 2p + 1 in its high one). Returns 0 or -1. */
int quant_pack(const void *w, int64_t row_bytes, int type, int N, int K, void *out) {
    const int ts = quant_block_bytes(type), pb = panel_block_bytes(type), nb = K / QK;
    if (ts == 0 || K % QK != 0) return -1;
    uint8_t *o = (uint8_t *)out;
    for (int g = 0; g < (N + PR - 1) / PR; g++)
        for (int b = 0; b < nb; b++, o += pb) {
            memset(o, 0, (size_t)pb);
            const int heads = type == GGML_TYPE_Q4_1 ? 2 : 1;
            uint8_t *quants = o + 2 * PR * heads;
            for (int r = 0; r < PR && g * PR + r < N; r++) {
                const uint8_t *blk = (const uint8_t *)w + (size_t)(g * PR + r) * row_bytes + (size_t)b * ts;
                memcpy(o + 2 * r, blk, 2);                                       /* d */
                if (heads == 2) memcpy(o + 2 * PR + 2 * r, blk + 2, 2);          /* m */
                const uint8_t *qs = blk + 2 * heads;
                for (int k = 0; k < QK; k++) {
                    const int q = block_quant(qs, type, k);
                    if (type == GGML_TYPE_Q8_0)
                        quants[k * PR + r] = (uint8_t)q;
                    else
                        quants[(k / 2) * PR + r] |= (uint8_t)(q << (4 * (k & 1)));
                }
            }
        }
    return 0;
}

#endif

#ifdef QUANT_512
/* A panel block's 16 scales and minimums as float32 */
static inline void panel_heads(const uint8_t *pb, int type, __m512 *d, __m512 *m) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pb));
    *m = type == GGML_TYPE_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pb + 2 * PR)))
                                : _mm512_setzero_ps();
}

/* quants of k (16 rows, as int32) -> the rows' weights k */
static inline __m512 weights_k(__m512i q, int type, __m512 d, __m512 m) {
    if (type == GGML_TYPE_Q4_0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
    return type == GGML_TYPE_Q4_1 ? _mm512_add_ps(f, m) : f;
}

/* y[m, panel r's rows] for R panels (pstride bytes apart) against MC rows of x (R * MC <= QM) */
static inline __attribute__((always_inline)) void tile(const uint8_t *p, int64_t pstride, int type, int nb,
                                                       const float *x, int64_t xs, const int R, const int MC,
                                                       __m512 acc[QM]) {
    const int pb = panel_block_bytes(type), heads = type == GGML_TYPE_Q4_1 ? 2 : 1;
    for (int i = 0; i < R * MC; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 d[4], m[4];
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = p + r * pstride + (size_t)b * pb;
            _mm_prefetch((const char *)blk + QPF, _MM_HINT_T1);
            _mm_prefetch((const char *)blk + QPF + 64, _MM_HINT_T1);
            panel_heads(blk, type, &d[r], &m[r]);
        }
        const float *xb = x + (size_t)b * QK;
        if (type == GGML_TYPE_Q8_0) {
            for (int k = 0; k < QK; k++)
                for (int r = 0; r < R; r++) {
                    const uint8_t *qk = p + r * pstride + (size_t)b * pb + 2 * PR + k * PR;
                    const __m512 wk = weights_k(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qk)), type,
                                                d[r], m[r]);
                    for (int j = 0; j < MC; j++)
                        acc[r * MC + j] = _mm512_fmadd_ps(wk, _mm512_set1_ps(xb[j * xs + k]), acc[r * MC + j]);
                }
        } else {
            for (int k = 0; k < QK; k += 2)
                for (int r = 0; r < R; r++) {
                    const uint8_t *qk = p + r * pstride + (size_t)b * pb + 2 * PR * heads + (k / 2) * PR;
                    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qk));
                    const __m512 w0 = weights_k(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), type, d[r], m[r]);
                    const __m512 w1 = weights_k(_mm512_srli_epi32(bytes, 4), type, d[r], m[r]);
                    for (int j = 0; j < MC; j++) {
                        acc[r * MC + j] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[j * xs + k]), acc[r * MC + j]);
                        acc[r * MC + j] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[j * xs + k + 1]), acc[r * MC + j]);
                    }
                }
        }
    }
}

static inline void store_rows(float *y, __m512 a, const float *bias, int nc) {
    float v[PR];
    _mm512_storeu_ps(v, a);
    for (int i = 0; i < nc; i++) y[i] = bias ? v[i] + bias[i] : v[i];
}
#elif defined(QUANT_AVX2)
/* as above with two registers of 8 rows per panel and row of x */
static inline void panel_heads(const uint8_t *pb, int type, __m256 d[2], __m256 m[2]) {
    d[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb));
    d[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16)));
    if (type == GGML_TYPE_Q4_1) {
        m[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 2 * PR)));
        m[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 2 * PR + 16)));
    } else {
        m[0] = m[1] = _mm256_setzero_ps();
    }
}

static inline __m256 weights_k(__m256i q, int type, __m256 d, __m256 m) {
    if (type == GGML_TYPE_Q4_0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    return type == GGML_TYPE_Q4_1 ? _mm256_add_ps(f, m) : f;
}

static inline __attribute__((always_inline)) void tile(const uint8_t *p, int64_t pstride, int type, int nb,
                                                       const float *x, int64_t xs, const int R, const int MC,
                                                       __m256 acc[2 * QM]) {
    const int pb = panel_block_bytes(type), heads = type == GGML_TYPE_Q4_1 ? 2 : 1;
    for (int i = 0; i < 2 * R * MC; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 d[4][2], m[4][2];
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = p + r * pstride + (size_t)b * pb;
            _mm_prefetch((const char *)blk + QPF, _MM_HINT_T1);
            _mm_prefetch((const char *)blk + QPF + 64, _MM_HINT_T1);
            panel_heads(blk, type, d[r], m[r]);
        }
        const float *xb = x + (size_t)b * QK;
        for (int k = 0; k < QK; k += 2)
            for (int r = 0; r < R; r++) {
                __m256 w[2][2]; /* [k, k + 1][rows 0-7, 8-15] */
                if (type == GGML_TYPE_Q8_0) {
                    const uint8_t *q0 = p + r * pstride + (size_t)b * pb + 2 * PR + k * PR;
                    for (int h = 0; h < 2; h++)
                        for (int s = 0; s < 2; s++)
                            w[h][s] = weights_k(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q0 + h * PR + 8 * s))),
                                                type, d[r][s], m[r][s]);
                } else {
                    const uint8_t *qk = p + r * pstride + (size_t)b * pb + 2 * PR * heads + (k / 2) * PR;
                    for (int s = 0; s < 2; s++) {
                        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qk + 8 * s)));
                        w[0][s] = weights_k(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), type, d[r][s], m[r][s]);
                        w[1][s] = weights_k(_mm256_srli_epi32(bytes, 4), type, d[r][s], m[r][s]);
                    }
                }
                for (int j = 0; j < MC; j++) {
                    __m256 *a = acc + 2 * (r * MC + j);
                    for (int h = 0; h < 2; h++) {
                        const __m256 xv = _mm256_broadcast_ss(xb + j * xs + k + h);
                        a[0] = _mm256_fmadd_ps(w[h][0], xv, a[0]);
                        a[1] = _mm256_fmadd_ps(w[h][1], xv, a[1]);
                    }
                }
            }
    }
}

static inline void store_rows(float *y, const __m256 *a, const float *bias, int nc) {
    float v[PR];
    _mm256_storeu_ps(v, a[0]);
    _mm256_storeu_ps(v + 8, a[1]);
    for (int i = 0; i < nc; i++) y[i] = bias ? v[i] + bias[i] : v[i];
}
#endif

#ifdef QUANT_AVX2
/* rows of y for panels [g0, g1) against all M rows of x, in tiles of R panels by MC rows of x
 * (constants at each call, so the sums stay in registers) */
static inline __attribute__((always_inline)) void panels(const uint8_t *packed, int type, int nb, const float *x,
                                                         int64_t xs, const float *bias, float *y, int M, int N,
                                                         int g0, int g1) {
    const int64_t pstride = (int64_t)nb * panel_block_bytes(type);
    for (int m0 = 0; m0 < M; m0 += QM) {
        const int mc = M - m0 < QM ? M - m0 : QM;
        int g = g0;
#ifdef QUANT_512
        __m512 acc[QM];
#define ACC(i) acc[i]
#else
        __m256 acc[2 * QM];
#define ACC(i) (acc + 2 * (i))
#endif
#define RUN(R, MC)                                                                                      \
    for (; g + (R) <= g1; g += (R)) {                                                                    \
        tile(packed + g * pstride, pstride, type, nb, x + (size_t)m0 * xs, xs, R, MC, acc);              \
        for (int r = 0; r < (R); r++)                                                                    \
            for (int j = 0; j < (MC); j++) {                                                             \
                const int n0 = (g + r) * PR, nc = N - n0 < PR ? N - n0 : PR;                            \
                store_rows(y + (size_t)(m0 + j) * N + n0, ACC(r * (MC) + j), bias ? bias + n0 : NULL, nc);    \
            }                                                                                            \
    }
#define TILES(R, MC) RUN(R, MC) RUN(1, MC) break;
        switch (mc) {
        case 1: TILES(4, 1)
#if QM > 6
        case 2: TILES(4, 2)
#else
        case 2: TILES(3, 2)
#endif
        case 3: TILES(2, 3)
#if QM > 6
        case 4: TILES(4, 4)
        case 5: TILES(2, 5)
        case 6: TILES(2, 6)
        case 7: TILES(2, 7)
        case 8: TILES(2, 8)
        case 9: TILES(1, 9)
        case 10: TILES(1, 10)
        case 11: TILES(1, 11)
        case 12: TILES(1, 12)
        case 13: TILES(1, 13)
        case 14: TILES(1, 14)
        case 15: TILES(1, 15)
#else
        case 4: TILES(1, 4)
        case 5: TILES(1, 5)
#endif
        default: TILES(1, QM)
        }
#undef TILES
#undef RUN
#undef ACC
    }
}
#else
/* plain C: one chain of fused multiply-adds per output, in k order */
static void panels(const uint8_t *packed, int type, int nb, const float *x, int64_t xs, const float *bias,
                   float *y, int M, int N, int g0, int g1) {
    IN_ORDER_HERE
    const int pb = panel_block_bytes(type), heads = type == GGML_TYPE_Q4_1 ? 2 : 1;
    const int64_t pstride = (int64_t)nb * pb;
    for (int g = g0; g < g1; g++)
        for (int m = 0; m < M; m++) {
            float acc[PR] = {0};
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = packed + g * pstride + (size_t)b * pb;
                const uint8_t *quants = blk + 2 * PR * heads;
                for (int k = 0; k < QK; k++) {
                    const float xv = x[(size_t)m * xs + b * QK + k];
                    for (int r = 0; r < PR; r++) {
                        const int q = type == GGML_TYPE_Q8_0 ? (int)(int8_t)quants[k * PR + r]
                                                             : (quants[(k / 2) * PR + r] >> (4 * (k & 1))) & 15;
                        const float d = half_to_float(blk + 2 * r);
                        const float mn = heads == 2 ? half_to_float(blk + 2 * PR + 2 * r) : 0.0f;
                        acc[r] = fmaf(weight_value(type, q, d, mn), xv, acc[r]);
                    }
                }
            }
            const int n0 = g * PR, nc = N - n0 < PR ? N - n0 : PR;
            for (int r = 0; r < nc; r++) y[(size_t)m * N + n0 + r] = bias ? acc[r] + bias[n0 + r] : acc[r];
        }
}
#endif

/* The panels of one block type as a function of its own, compiled in a translation unit of its
 * own (quant_panels_*.c define QUANT_PANELS_OF and include this file): the three types' tiles
 * are most of the library's compile time, and a first start builds them in parallel. */
#define PANELS_FN(name)                                                                                   \
    void name(const uint8_t *packed, int nb, const float *x, int64_t xs, const float *bias, float *y, int M, \
              int N, int g0, int g1)
#ifdef QUANT_PANELS_OF
PANELS_FN(QUANT_PANELS_NAME) { panels(packed, QUANT_PANELS_OF, nb, x, xs, bias, y, M, N, g0, g1); }
#else
PANELS_FN(quant_panels_q4_0);
PANELS_FN(quant_panels_q4_1);
PANELS_FN(quant_panels_q8_0);

/* x [M, K] (row stride xs, float32); packed: quant_pack's panels of N rows of `type`; bias [N]
 * or NULL; y [M, N] contiguous float32. Returns 0, or -1 for a type without a kernel or K not
 * a multiple of 32. */
int quant_gemm(const float *x, int64_t xs, const void *packed, int type, const float *bias, float *y, int M,
               int N, int K) {
    if (quant_block_bytes(type) == 0 || K % QK != 0) return -1;
    const int nb = K / QK, groups = (N + PR - 1) / PR;
    const uint8_t *p = (const uint8_t *)packed;
#pragma omp parallel
    {
        int nth = 1, me = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        const int per = (groups + nth - 1) / nth, g0 = me * per, g1 = g0 + per < groups ? g0 + per : groups;
        if (g0 < g1) {
            switch (type) {
            case GGML_TYPE_Q4_0: quant_panels_q4_0(p, nb, x, xs, bias, y, M, N, g0, g1); break;
            case GGML_TYPE_Q4_1: quant_panels_q4_1(p, nb, x, xs, bias, y, M, N, g0, g1); break;
            default: quant_panels_q8_0(p, nb, x, xs, bias, y, M, N, g0, g1); break;
            }
        }
    }
    return 0;
}

/* rows `ids` [n] of a GGUF block matrix (row_bytes apart; the file's layout, not the panels)
 * -> out [n, K] float32, exactly the blocks' values (an embedding lookup, a check against
 * dequantized weights). Returns 0 or -1. */
int quant_rows(const void *w, int64_t row_bytes, int type, const int64_t *ids, int n, int K, float *out) {
    const int ts = quant_block_bytes(type);
    if (ts == 0 || K % QK != 0) return -1;
    const int heads = type == GGML_TYPE_Q4_1 ? 2 : 1;
    for (int i = 0; i < n; i++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)ids[i] * row_bytes;
        for (int b = 0; b < K / QK; b++) {
            const uint8_t *blk = wr + (size_t)b * ts;
            const float d = half_to_float(blk), m = heads == 2 ? half_to_float(blk + 2) : 0.0f;
            for (int j = 0; j < QK; j++)
                out[(size_t)i * K + b * QK + j] = weight_value(type, block_quant(blk + 2 * heads, type, j), d, m);
        }
    }
    return 0;
}

/* Which vector path the build uses: 0 plain C, 1 AVX2, 2 AVX512. */
int quant_gemm_path(void) {
#if defined(QUANT_512)
    return 2;
#elif defined(QUANT_AVX2)
    return 1;
#else
    return 0;
#endif
}
#endif
