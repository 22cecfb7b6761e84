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
 * 5.0 (Q4_1) or 8.5 (Q8_0) bits a weight against float32's 32. Each block is dequantized in
 * registers to exactly the float32 values above (a product, then a sum: never fused, so they
 * are the values llama.cpp's and gguf's dequantizers give) and multiplied with the float32 rows
 * of x: the model as published, computed in float32, with no rounding of the activations.
 *
 * One order of sums per output, whatever M is, which CPU path runs, or which other rows share
 * the call: sixteen float32 lanes per output, lane l (< 8) accumulating elements l and l + 16 of
 * every block and lane 8 + l elements 8 + l and 24 + l, one fused multiply-add each, block by
 * block; at the end lane l plus lane 8 + l, those eight summed in one tree, then the bias. So a
 * row's outputs are the same bits alone or in a batch of any size, on AVX512 (one register of
 * sixteen lanes), AVX2 (two of eight) and plain C alike: speculation and batching stay exact by
 * construction.
 *
 * A weight block is dequantized once per call for up to QM rows of x (a verification step reads
 * each weight byte once, and dequantizes it once); the rows of W are split between threads in
 * equal runs of whole groups of 8, each output computed whole by one thread; weights are
 * prefetched QPF bytes ahead (the hardware prefetcher alone left half the bandwidth unused).
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
#ifdef QUANT_512
#define QM 8 /* rows of x per pass over a weight row: one register of sums each (16 spilled) ... */
#else
#define QM 4 /* ... or two, of sixteen */
#endif
#ifndef QPF
#define QPF 8192 /* bytes of weights prefetched ahead into L2 */
#endif

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

/* sums l = 0..7 -> one float: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
static inline float lanes_sum(const float l[8]) {
    IN_ORDER_HERE
    float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
    float b0 = a0 + a2, b1 = a1 + a3;
    return b0 + b1;
}

/* A block's 32 weights as float32, exactly (scalar path and quant_rows). */
static inline __attribute__((always_inline)) void block_values(const uint8_t *wb, int type, float *w) {
    float dw, mw;
    const uint8_t *qs = block_head(wb, type, &dw, &mw);
    for (int j = 0; j < QK; j++) {
        if (type == GGML_TYPE_Q8_0) {
            w[j] = dw * (float)(int8_t)qs[j];
        } else {
            const int q = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
            w[j] = type == GGML_TYPE_Q4_1 ? dw * (float)q + mw : dw * (float)(q - 8);
        }
    }
}

#ifdef QUANT_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l + l4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                       /* + l2/l6 */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                         /* + odd */
    return _mm_cvtss_f32(s);
}

/* 8 int32 -> the block's float32 weights (scale, minimum; Q4_0: the -8 offset already in q) */
static inline __m256 dq8(__m256i q, int type, __m256 d, __m256 m) {
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    return type == GGML_TYPE_Q4_1 ? _mm256_add_ps(f, m) : f;
}

/* A block's 32 quants as 4 x 8 int32 (elements 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void block_ints(const uint8_t *qs, int type, __m256i q[4]) {
    if (type == GGML_TYPE_Q8_0) {
        __m128i a = _mm_loadu_si128((const __m128i *)qs), b = _mm_loadu_si128((const __m128i *)(qs + 16));
        q[0] = _mm256_cvtepi8_epi32(a);
        q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8));
        q[2] = _mm256_cvtepi8_epi32(b);
        q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
        return;
    }
    const __m128i t = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(t, low), hi = _mm_and_si128(_mm_srli_epi16(t, 4), low);
    if (type == GGML_TYPE_Q4_0) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
        hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
        q[0] = _mm256_cvtepi8_epi32(lo);
        q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
        q[2] = _mm256_cvtepi8_epi32(hi);
        q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
    } else {
        q[0] = _mm256_cvtepu8_epi32(lo);
        q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        q[2] = _mm256_cvtepu8_epi32(hi);
        q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
    }
}

#ifdef QUANT_512
/* A block's weights as float32, elements 0-15 and 16-31, exactly as block_values gives them: for
 * 4-bit blocks the block's 16 possible values (d q + m, a product then a sum) looked up by
 * nibble, for Q8_0 d q. */
static inline __attribute__((always_inline)) void block_values16(const uint8_t *qs, int type, float dw, float mw,
                                                                 __m512 *w01, __m512 *w23) {
    if (type == GGML_TYPE_Q8_0) {
        const __m512 d = _mm512_set1_ps(dw);
        *w01 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), d);
        *w23 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))), d);
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = type == GGML_TYPE_Q4_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)) : iota;
    table = _mm512_mul_ps(table, _mm512_set1_ps(dw));
    if (type == GGML_TYPE_Q4_1) table = _mm512_add_ps(table, _mm512_set1_ps(mw));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *w01 = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), table);
    *w23 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

/* out[r, m] (r < R, m < MC) for R weight rows (row_bytes apart) against MC rows of x: several at
 * once keep independent sums in flight and share each dequantized block; every output's order
 * is the one above (lanes 0-7 of its register: elements l, l + 16; lanes 8-15: 8 + l, 24 + l). */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *w, int64_t row_bytes, int type, int ts,
                                                           const float *x, int64_t xs, int nb, const int R,
                                                           const int MC, float *out, int64_t os) {
    __m512 acc[4][QM]; /* R <= 4 */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) acc[r][m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *wb = w + (size_t)r * row_bytes + (size_t)b * ts;
            _mm_prefetch((const char *)wb + QPF, _MM_HINT_T1);
            float dw, mw;
            const uint8_t *qs = block_head(wb, type, &dw, &mw);
            __m512 w01, w23;
            block_values16(qs, type, dw, mw, &w01, &w23);
            for (int m = 0; m < MC; m++) {
                const float *xb = x + (size_t)m * xs + (size_t)b * QK;
                acc[r][m] = _mm512_fmadd_ps(w01, _mm512_loadu_ps(xb), acc[r][m]);
                acc[r][m] = _mm512_fmadd_ps(w23, _mm512_loadu_ps(xb + 16), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) {
            __m256 s = _mm256_add_ps(_mm512_castps512_ps256(acc[r][m]), _mm512_extractf32x8_ps(acc[r][m], 1));
            out[m * os + r] = hsum8(s);
        }
}
#else
/* as above with two registers of eight lanes per output: lo (elements l, l + 16), hi (8 + l, 24 + l) */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *w, int64_t row_bytes, int type, int ts,
                                                           const float *x, int64_t xs, int nb, const int R,
                                                           const int MC, float *out, int64_t os) {
    __m256 lo[4][QM], hi[4][QM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) lo[r][m] = hi[r][m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *wb = w + (size_t)r * row_bytes + (size_t)b * ts;
            _mm_prefetch((const char *)wb + QPF, _MM_HINT_T1);
            float dw, mw;
            const uint8_t *qs = block_head(wb, type, &dw, &mw);
            __m256i q[4];
            block_ints(qs, type, q);
            const __m256 d = _mm256_set1_ps(dw), mm = _mm256_set1_ps(mw);
            const __m256 w0 = dq8(q[0], type, d, mm), w1 = dq8(q[1], type, d, mm);
            const __m256 w2 = dq8(q[2], type, d, mm), w3 = dq8(q[3], type, d, mm);
            for (int m = 0; m < MC; m++) {
                const float *xb = x + (size_t)m * xs + (size_t)b * QK;
                lo[r][m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), lo[r][m]);
                hi[r][m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), hi[r][m]);
                lo[r][m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), lo[r][m]);
                hi[r][m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), hi[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) out[m * os + r] = hsum8(_mm256_add_ps(lo[r][m], hi[r][m]));
}
#endif
#else
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *w, int64_t row_bytes, int type, int ts,
                                                           const float *x, int64_t xs, int nb, const int R,
                                                           const int MC, float *out, int64_t os) {
    IN_ORDER_HERE
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) {
            float acc[16] = {0};
            const float *xm = x + (size_t)m * xs;
            for (int b = 0; b < nb; b++) {
                float wv[QK];
                block_values(w + (size_t)r * row_bytes + (size_t)b * ts, type, wv);
                const float *xb = xm + (size_t)b * QK;
                for (int l = 0; l < 16; l++) acc[l] = fmaf(wv[l], xb[l], acc[l]);
                for (int l = 0; l < 16; l++) acc[l] = fmaf(wv[16 + l], xb[16 + l], acc[l]);
            }
            float s[8];
            for (int l = 0; l < 8; l++) s[l] = acc[l] + acc[8 + l];
            out[m * os + r] = lanes_sum(s);
        }
}
#endif

/* rows [n0, n1) of W against all M rows of x, in tiles of R weight rows by MC rows of x
 * (constants at each call, so the sums stay in registers); one body per type so the type's
 * branches fold away */
static inline __attribute__((always_inline)) void rows_range(const uint8_t *w, int64_t row_bytes, int type,
                                                             const float *x, int64_t xs, const float *bias,
                                                             float *y, int M, int N, int nb, int n0, int n1) {
    const int ts = quant_block_bytes(type);
    for (int m0 = 0; m0 < M; m0 += QM) {
        const int mc = M - m0 < QM ? M - m0 : QM;
        const float *xm = x + (size_t)m0 * xs;
        float *ym = y + (size_t)m0 * N;
        int n = n0;
#define TILE(R, MC) tile_dot(w + (size_t)n * row_bytes, row_bytes, type, ts, xm, xs, nb, R, MC, ym + n, N)
#define TILES(R, MC)                                                                                    \
    for (; n + (R) <= n1; n += (R)) TILE(R, MC);                                                          \
    for (; n < n1; n++) TILE(1, MC);                                                                      \
    break;
        switch (mc) {
        case 1: TILES(4, 1)
        case 2: TILES(2, 2)
        case 3: TILES(1, 3)
#if QM > 4
        case 4: TILES(2, 4)
        case 5: TILES(1, 5)
        case 6: TILES(1, 6)
        case 7: TILES(1, 7)
#endif
        default: TILES(1, QM)
        }
#undef TILES
#undef TILE
    }
    if (bias)
        for (int m = 0; m < M; m++)
            for (int n = n0; n < n1; n++) y[(size_t)m * N + n] += bias[n];
}

/* x [M, K] (row stride xs, float32); w: N rows of K / 32 blocks of `type`, row_bytes apart;
 * bias [N] or NULL; y [M, N] contiguous float32. Returns 0, or -1 for a type without a kernel
 * or K not a multiple of 32. */
int quant_gemm(const float *x, int64_t xs, const void *w, int64_t row_bytes, int type, const float *bias,
               float *y, int M, int N, int K) {
    if (quant_block_bytes(type) == 0 || K % QK != 0) return -1;
    const int nb = K / QK;
    const uint8_t *wb = (const uint8_t *)w;
#pragma omp parallel
    {
        int nth = 1, me = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        const int groups = (N + 7) / 8, per = (groups + nth - 1) / nth;
        int n0 = me * per * 8, n1 = (me + 1) * per * 8;
        n1 = n1 > N ? N : n1;
        if (n0 < n1) {
            switch (type) {
            case GGML_TYPE_Q4_0: rows_range(wb, row_bytes, GGML_TYPE_Q4_0, x, xs, bias, y, M, N, nb, n0, n1); break;
            case GGML_TYPE_Q4_1: rows_range(wb, row_bytes, GGML_TYPE_Q4_1, x, xs, bias, y, M, N, nb, n0, n1); break;
            default: rows_range(wb, row_bytes, GGML_TYPE_Q8_0, x, xs, bias, y, M, N, nb, n0, n1); break;
            }
        }
    }
    return 0;
}

/* rows `ids` [n] of a quantized matrix (row_bytes apart) -> out [n, K] float32, exactly the
 * blocks' values (an embedding lookup, a check against dequantized weights). Returns 0 or -1. */
int quant_rows(const void *w, int64_t row_bytes, int type, const int64_t *ids, int n, int K, float *out) {
    const int ts = quant_block_bytes(type);
    if (ts == 0 || K % QK != 0) return -1;
    for (int i = 0; i < n; i++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)ids[i] * row_bytes;
        for (int b = 0; b < K / QK; b++) block_values(wr + (size_t)b * ts, type, out + (size_t)i * K + b * QK);
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
