/* bfloat16 linear layers for a few rows at a time: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Decoding one token (or verifying a short block) multiplies a handful of rows by every weight
 * of the model, so the time is the time to stream the weights from memory. The weights are
 * packed once at load into blocks of 16 output rows with their K inputs in pairs
 * ([N/16][K/2][16][2]), so one 64-byte load feeds 16 outputs and each step of the inner loop is
 * one bf16 pair dot product per output (AVX512-BF16's vdpbf16ps where the CPU has it, plain
 * float32 arithmetic the compiler vectorises elsewhere): no horizontal sums, every weight byte
 * read once per call. Rows of x are taken 16 at a time, so the weights of a block are read
 * again (from cache) only past 16 rows. Accumulation is float32, the output rounded once.
 *
 * Built with ops/csrc/paged_attention.c into one library by ops/cpu_kernels.py. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) || defined(__AVX2__) || defined(__AVX512F__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "common.h"
#include "kernels.h" /* the prototypes the layer drivers call: checked against the definitions here */

#define NB 16 /* output rows per packed block */
#define MB 16 /* rows of x per pass over a block */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 3 /* from this many rows the tile path runs, where the CPU has one */
#endif
#define PF 128 /* weight lines prefetched ahead into L2 (8 KiB): the hardware prefetcher alone left
                 a third of the bandwidth unused at 8-16 rows, and a prefetch only 2 KiB ahead
                 into L1 still let the weights' streaming and the products take turns at 8-32
                 rows: 1.1-1.25x there in bf16, 1.1-1.5x in float32 (AVX512 and AVX2 builds),
                 on a 2-core Zen 4; one row unchanged */

/* nc (<= 16) outputs of a row from its float32 sums (+ bias), rounded once to bf16: one
 * conversion and one masked store where the CPU converts 16 at a time (a scalar rounding per
 * element was most of a call's time at 64-128 rows on AMX tiles, whose products are fast) */
static inline void store_outputs(uint16_t *y, const float acc[NB], const uint16_t *bias, int nc) {
#ifdef __AVX512BF16__
    __mmask16 k = nc >= NB ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    __m512 v = _mm512_loadu_ps(acc);
    if (bias) {
        __m512i b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, bias));
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
    }
    _mm256_mask_storeu_epi16(y, k, (__m256i)_mm512_cvtneps_pbh(v));
#else
    for (int j = 0; j < nc; j++) y[j] = f32_to_bf16(acc[j] + (bias ? bf16_to_f32(bias[j]) : 0.0f));
#endif
}

/* the same outputs unrounded (float32 logits: the LM head of a batch-invariant forward) */
static inline void store_outputs_f32(float *y, const float acc[NB], const uint16_t *bias, int nc) {
    for (int j = 0; j < nc; j++) y[j] = acc[j] + (bias ? bf16_to_f32(bias[j]) : 0.0f);
}

/* a row's nc outputs, rounded to bf16 or (f32) left float32: y is the [M, N] output's row */
static inline void store_row(void *y, int f32, size_t offset, const float acc[NB], const uint16_t *bias, int nc) {
    if (f32)
        store_outputs_f32((float *)y + offset, acc, bias, nc);
    else
        store_outputs((uint16_t *)y + offset, acc, bias, nc);
}

/* W [N, K] (row stride K) -> packed [ceil(N/16)][K/2][16][2]; rows past N are zero. K even. */
void small_gemm_pack(const uint16_t *W, uint16_t *packed, int N, int K) {
    int blocks = (N + NB - 1) / NB;
    for (int b = 0; b < blocks; b++)
        for (int kp = 0; kp < K / 2; kp++)
            for (int j = 0; j < NB; j++) {
                int n = b * NB + j;
                uint16_t *dst = packed + (((size_t)b * (K / 2) + kp) * NB + j) * 2;
                dst[0] = n < N ? W[(size_t)n * K + 2 * kp] : 0;
                dst[1] = n < N ? W[(size_t)n * K + 2 * kp + 1] : 0;
            }
}

/* Without AVX512-BF16 the bf16 products are plain C, and -fassociative-math would let the
 * compiler sum a row's products in one order when the call has one row and in another for
 * several (as the float32 kernel's plain path below notes): there the sums stay in k order, so
 * a row's outputs do not depend on the row count (the batch-invariant mode relies on it). */
#ifndef __AVX512BF16__
#if defined(__clang__)
#define BF16_IN_ORDER
#define BF16_IN_ORDER_HERE _Pragma("clang fp reassociate(off)")
#else
#define BF16_IN_ORDER __attribute__((optimize("no-associative-math")))
#define BF16_IN_ORDER_HERE
#endif
#else
#define BF16_IN_ORDER
#define BF16_IN_ORDER_HERE
#endif

/* acc[mc][16] over one block: the weights of the block against mc (<= MB) rows of x */
static inline __attribute__((always_inline)) BF16_IN_ORDER void block_dot(
    const uint16_t *wb, const uint16_t *x, int64_t x_stride, int K, int mc, float acc[MB][NB]) {
#ifdef __AVX512BF16__
    __m512 a[MB];
    for (int m = 0; m < mc; m++) a[m] = _mm512_setzero_ps();
    for (int kp = 0; kp < K / 2; kp++) {
        _mm_prefetch((const char *)(wb + (size_t)(kp + PF) * 2 * NB), _MM_HINT_T1);
        __m512bh w = (__m512bh)_mm512_loadu_si512(wb + (size_t)kp * 2 * NB);
        for (int m = 0; m < mc; m++) {
            uint32_t pair;
            memcpy(&pair, x + m * x_stride + 2 * kp, sizeof(pair));
            a[m] = _mm512_dpbf16_ps(a[m], w, (__m512bh)_mm512_set1_epi32((int)pair));
        }
    }
    for (int m = 0; m < mc; m++) _mm512_storeu_ps(acc[m], a[m]);
#else
    BF16_IN_ORDER_HERE
    for (int m = 0; m < mc; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = 0.0f;
    for (int kp = 0; kp < K / 2; kp++) {
        const uint16_t *w = wb + (size_t)kp * 2 * NB;
        float w0[NB], w1[NB];
        for (int j = 0; j < NB; j++) {
            w0[j] = bf16_to_f32(w[2 * j]);
            w1[j] = bf16_to_f32(w[2 * j + 1]);
        }
        for (int m = 0; m < mc; m++) {
            float x0 = bf16_to_f32(x[m * x_stride + 2 * kp]), x1 = bf16_to_f32(x[m * x_stride + 2 * kp + 1]);
            for (int j = 0; j < NB; j++) acc[m][j] += w0[j] * x0 + w1[j] * x1;
        }
    }
#endif
}

/* ---- AMX ---------------------------------------------------------------------------------------
 * Where the CPU has AMX tiles, a block of 16 outputs times 16 rows of x is one tile product per
 * 32 inputs: the packed layout above is already the B tile's (16 input pairs x 16 outputs x 2 =
 * 1 KiB a tile), and an A tile is 16 rows of x as they lie (row stride x_stride; a last chunk of
 * fewer rows is read from a zero-padded copy, and a call of fewer than 16 rows configures its A
 * and C tiles for that many, reading x in place). The tile unit does in one instruction what 16
 * vdpbf16ps do, so rows cost little until the weights' streaming stops being the limit. Each
 * chunk of 16 rows takes the blocks two at a time (amx_pair), each block summed into two tiles
 * over alternate runs of 32 inputs: a chain of products into one tile waits on each one's
 * latency, and two blocks' weights in flight stream better than one; a block's weights are read
 * again from cache for each further chunk. (Sharing each B tile load between up to five chunks
 * instead was slower at every row count from 3 to 256 on a 2-core Xeon: docs/benchmarks.md,
 * "Batch invariance".) Every row count runs the same order of sums for a row, so a row's
 * outputs never depend on how many rows share the call. Linux hands the tile state out on
 * request (arch_prctl, once per process); where it refuses, or K is not a multiple of 32, the
 * AVX512 path runs. A row's sums never mix with another row's, the output rounded once. */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <stdlib.h>
#ifndef AMX_PF
#define AMX_PF 4 /* tiles of weights (1 KiB each) prefetched ahead, into L1: a tile load waits
                   on its 16 lines, and prefetched into L2 only (16 tiles ahead) a step's weights
                   streamed slower at 1-8 rows (docs/benchmarks.md, "Batch invariance") */
#endif
#ifndef AMX_HINT
#define AMX_HINT _MM_HINT_T0
#endif

static inline void amx_prefetch(const uint16_t *wb, int kb, int tiles) {
    for (int l = 0; l < 16 * tiles; l++) /* the weights AMX_PF tiles ahead */
        _mm_prefetch((const char *)(wb + (size_t)(kb + AMX_PF) * 512 + l * 32), AMX_HINT);
}

/* Two blocks of weights against one chunk of rows (x, row stride xs bytes; `rows` rows): the
 * chunk's A tile loaded once for both, each block summed into two tiles over alternate runs of
 * 32 inputs (even runs, with a last odd one, in the first), so two B tile loads and four
 * products are in flight at a time; a0 = even + odd sums of block w0, a1 of block w1 (w1 may be
 * w0 for an odd last block). Tiles: 0 and 5 B, 1 and 7 A (alternately), 2 and 3 w0's sums, 4
 * and 6 w1's: configured by amx_configure_pairs. With few rows the weights' streaming is the
 * limit, and pairs keep more of it in flight than one block's three sums did. */
static inline void amx_pair(const uint16_t *w0, const uint16_t *w1, const uint16_t *x, size_t xs, int K, int rows,
                            float a0[16][NB], float a1[16][NB]) {
    int kbs = K / 32, kb = 0;
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(6);
    for (; kb + 2 <= kbs; kb += 2) {
        amx_prefetch(w0, kb, 2);
        amx_prefetch(w1, kb, 2);
        _tile_loadd(1, x + kb * 32, xs);
        _tile_loadd(0, w0 + (size_t)kb * 512, 64);
        _tile_loadd(5, w1 + (size_t)kb * 512, 64);
        _tile_dpbf16ps(2, 1, 0);
        _tile_dpbf16ps(4, 1, 5);
        _tile_loadd(7, x + (kb + 1) * 32, xs);
        _tile_loadd(0, w0 + (size_t)(kb + 1) * 512, 64);
        _tile_loadd(5, w1 + (size_t)(kb + 1) * 512, 64);
        _tile_dpbf16ps(3, 7, 0);
        _tile_dpbf16ps(6, 7, 5);
    }
    if (kb < kbs) {
        _tile_loadd(1, x + kb * 32, xs);
        _tile_loadd(0, w0 + (size_t)kb * 512, 64);
        _tile_loadd(5, w1 + (size_t)kb * 512, 64);
        _tile_dpbf16ps(2, 1, 0);
        _tile_dpbf16ps(4, 1, 5);
    }
    float p0[16][NB], p1[16][NB];
    _tile_stored(2, a0[0], 64);
    _tile_stored(3, p0[0], 64);
    _tile_stored(4, a1[0], 64);
    _tile_stored(6, p1[0], 64);
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NB; j++) {
            a0[m][j] += p0[m][j];
            a1[m][j] += p1[m][j];
        }
}

/* amx_pair's tiles: B (0, 5) 16 rows, A and the sums `rows` rows */
static void amx_configure_pairs(int rows) {
    uint8_t r = (uint8_t)rows;
    const uint8_t tile_rows[8] = {16, r, r, r, r, 16, r, r};
    amx_load_config(tile_rows);
}

/* The rows in chunks of 16 (a last partial one read from `pad`, or in place with its tiles
 * configured for fewer rows where it is the only chunk), each against the blocks two at a time
 * (amx_pair): one order of sums per row whatever M (the batch-invariant path, and a short call's) */
static void small_gemm_amx_pairs(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                                 void *y, int M, int N, int K, int f32, const uint16_t *pad) {
    int blocks = (N + NB - 1) / NB, full = M / 16, tail = M % 16, short_call = M < 16;
    int chunks = full + (tail > 0);
#pragma omp parallel
    {
        amx_configure_pairs(short_call ? M : 16);
#pragma omp for schedule(static)
        for (int pb = 0; pb < (blocks + 1) / 2; pb++) {
            int b0 = 2 * pb, b1 = b0 + 1 < blocks ? b0 + 1 : b0;
            const uint16_t *w0 = packed + (size_t)b0 * (K / 2) * NB * 2, *w1 = packed + (size_t)b1 * (K / 2) * NB * 2;
            for (int c = 0; c < chunks; c++) {
                int last = c == full && !short_call; /* the padded partial chunk */
                const uint16_t *xc = last ? pad : x + (size_t)c * 16 * x_stride;
                size_t xs = (size_t)(last ? K : x_stride) * 2;
                int rows = c == full ? tail : 16;
                float a0[16][NB], a1[16][NB];
                amx_pair(w0, w1, xc, xs, K, short_call ? M : 16, a0, a1);
                for (int b = b0; b <= b1; b++) {
                    int n0 = b * NB, nc = N - n0 < NB ? N - n0 : NB;
                    for (int m = 0; m < rows; m++)
                        store_row(y, f32, (size_t)(16 * c + m) * N + n0, b == b0 ? a0[m] : a1[m],
                                  bias ? bias + n0 : NULL, nc);
                    if (b1 == b0) break;
                }
            }
        }
        _tile_release();
    }
}

/* Returns 0, or -1 when the padded copy of a last partial chunk could not be allocated. f32:
 * float32 outputs (y float *), else bf16. */
static int small_gemm_amx(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                          void *y, int M, int N, int K, int f32) {
    int full = M / 16, tail = M % 16;
    uint16_t *pad = NULL; /* the last partial chunk's rows, zero-padded to 16 */
    if (tail && M >= 16) {
        pad = calloc((size_t)16 * K, sizeof(uint16_t));
        if (!pad) return -1;
        for (int m = 0; m < tail; m++)
            memcpy(pad + (size_t)m * K, x + (size_t)(16 * full + m) * x_stride, sizeof(uint16_t) * K);
    }
    small_gemm_amx_pairs(x, x_stride, packed, bias, y, M, N, K, f32, pad);
    free(pad);
    return 0;
}
#endif

/* 1 where bf16 products of AMX_MIN_ROWS rows or more run on AMX tiles (built for a CPU with
 * them, and this process allowed to use them), 0 where they run the AVX512 (or plain) path. */
int small_gemm_tiles(void) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return amx_allowed();
#else
    return 0;
#endif
}

/* The instruction sets this build's paths use, as bits: 1 AVX2 with FMA, 2 AVX512F, 4 AVX512-BF16,
 * 8 AMX tiles (built for them; whether this process may use them is small_gemm_tiles). */
int kernel_paths(void) {
    int paths = 0;
#if defined(__AVX2__) && defined(__FMA__)
    paths |= 1;
#endif
#ifdef __AVX512F__
    paths |= 2;
#endif
#ifdef __AVX512BF16__
    paths |= 4;
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    paths |= 8;
#endif
    return paths;
}

/* x: [M, K] with row stride x_stride (elements); packed from small_gemm_pack; bias: [N] or
 * NULL; y: [M, N] contiguous, bf16, or float32 with GEMM_F32_OUT in flags. GEMM_INVARIANT: one
 * order of sums per row whatever M (on AMX tiles for every row count, one chunk of 16 rows at
 * a time, where the CPU has them; else the AVX512 path, whose rows never share sums), so a
 * row's outputs do not depend on what shares the call. */
BF16_IN_ORDER void small_gemm_ex(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                   void *y, int M, int N, int K, int flags) {
    const int invariant = (flags & GEMM_INVARIANT) != 0, f32 = (flags & GEMM_F32_OUT) != 0;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if ((M >= AMX_MIN_ROWS || invariant) && K % 32 == 0 && amx_allowed() &&
        small_gemm_amx(x, x_stride, packed, bias, y, M, N, K, f32) == 0)
        return;
#else
    (void)invariant;
#endif
    int blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        const uint16_t *wb = packed + (size_t)b * (K / 2) * NB * 2;
        int n0 = b * NB, nc = N - n0 < NB ? N - n0 : NB;
        for (int m0 = 0; m0 < M; m0 += MB) {
            int mc = M - m0 < MB ? M - m0 : MB;
            float acc[MB][NB];
            const uint16_t *xm = x + m0 * x_stride;
            /* a constant row count per call site, so the accumulators stay in registers */
            switch (mc) {
            case 1: block_dot(wb, xm, x_stride, K, 1, acc); break;
            case 2: block_dot(wb, xm, x_stride, K, 2, acc); break;
            case 3: block_dot(wb, xm, x_stride, K, 3, acc); break;
            case 4: block_dot(wb, xm, x_stride, K, 4, acc); break;
            case 5: block_dot(wb, xm, x_stride, K, 5, acc); break;
            case 6: block_dot(wb, xm, x_stride, K, 6, acc); break;
            case 7: block_dot(wb, xm, x_stride, K, 7, acc); break;
            case 8: block_dot(wb, xm, x_stride, K, 8, acc); break;
            case 9: block_dot(wb, xm, x_stride, K, 9, acc); break;
            case 10: block_dot(wb, xm, x_stride, K, 10, acc); break;
            case 11: block_dot(wb, xm, x_stride, K, 11, acc); break;
            case 12: block_dot(wb, xm, x_stride, K, 12, acc); break;
            case 13: block_dot(wb, xm, x_stride, K, 13, acc); break;
            case 14: block_dot(wb, xm, x_stride, K, 14, acc); break;
            case 15: block_dot(wb, xm, x_stride, K, 15, acc); break;
            default: block_dot(wb, xm, x_stride, K, MB, acc); break;
            }
            for (int m = 0; m < mc; m++)
                store_row(y, f32, (size_t)(m0 + m) * N + n0, acc[m], bias ? bias + n0 : NULL, nc);
        }
    }
}

void small_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                uint16_t *y, int M, int N, int K) {
    small_gemm_ex(x, x_stride, packed, bias, y, M, N, K, 0);
}

/* ---- float32 ---------------------------------------------------------------------------------
 * The same idea for float32 weights (the default dtype on CPUs without native bf16): packed
 * [ceil(N/16)][K][16], so one 64-byte line holds one input's weights for 16 outputs, and each
 * row of x accumulates 16 outputs in registers (one zmm with AVX512, two ymm with AVX2, fused
 * multiply-adds). Each row's sums run over k in the same order whatever M is, so a
 * row's output does not depend on how many rows share the call. */
#ifdef __AVX512F__
#define MBF 12 /* rows per pass: 12 accumulators + weights in 32 zmm registers */
#elif defined(__AVX2__) && defined(__FMA__)
#define MBF 6 /* AVX2: 12 ymm accumulators + 2 for the weights + 1 broadcast of 16 */
#else
#define MBF 4
#endif
/* The plain C path (no AVX2 with FMA): -fassociative-math lets the compiler vectorise a row's sum
 * over k one way when the call has one row and another way for several (it did, on x86-64
 * without AVX), which breaks the batch invariance above; there the sums stay in k order. The
 * intrinsics paths fix their order themselves and keep the flag. */
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#if defined(__clang__)
#define F32_IN_ORDER
#define F32_IN_ORDER_HERE _Pragma("clang fp reassociate(off)")
#else
#define F32_IN_ORDER __attribute__((optimize("no-associative-math")))
#define F32_IN_ORDER_HERE
#endif
#else
#define F32_IN_ORDER
#define F32_IN_ORDER_HERE
#endif

/* W [N, K] (row stride K) -> packed [ceil(N/16)][K][16]; rows past N are zero. */
void small_gemm_f32_pack(const float *W, float *packed, int N, int K) {
    int blocks = (N + NB - 1) / NB;
    for (int b = 0; b < blocks; b++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NB; j++) {
                int n = b * NB + j;
                packed[((size_t)b * K + k) * NB + j] = n < N ? W[(size_t)n * K + k] : 0.0f;
            }
}

/* out[mc][16] over one block: its weights against mc (<= MBF) rows of x */
static inline __attribute__((always_inline)) F32_IN_ORDER void block_dot_f32(
    const float *wb, const float *x, int64_t x_stride, int K, int mc, float out[MBF][NB]) {
#ifdef __AVX512F__
    __m512 a[MBF];
    for (int m = 0; m < mc; m++) a[m] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        _mm_prefetch((const char *)(wb + (size_t)(k + PF) * NB), _MM_HINT_T1);
        __m512 w = _mm512_loadu_ps(wb + (size_t)k * NB);
        for (int m = 0; m < mc; m++) a[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * x_stride + k]), a[m]);
    }
    for (int m = 0; m < mc; m++) _mm512_storeu_ps(out[m], a[m]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo[MBF], hi[MBF];
    for (int m = 0; m < mc; m++) lo[m] = hi[m] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        _mm_prefetch((const char *)(wb + (size_t)(k + PF) * NB), _MM_HINT_T1);
        __m256 w0 = _mm256_loadu_ps(wb + (size_t)k * NB), w1 = _mm256_loadu_ps(wb + (size_t)k * NB + 8);
        for (int m = 0; m < mc; m++) {
            __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k);
            lo[m] = _mm256_fmadd_ps(w0, xv, lo[m]);
            hi[m] = _mm256_fmadd_ps(w1, xv, hi[m]);
        }
    }
    for (int m = 0; m < mc; m++) {
        _mm256_storeu_ps(out[m], lo[m]);
        _mm256_storeu_ps(out[m] + 8, hi[m]);
    }
#else
    F32_IN_ORDER_HERE
    for (int m = 0; m < mc; m++)
        for (int j = 0; j < NB; j++) out[m][j] = 0.0f;
    for (int k = 0; k < K; k++)
        for (int m = 0; m < mc; m++)
            for (int j = 0; j < NB; j++) out[m][j] += wb[(size_t)k * NB + j] * x[m * x_stride + k];
#endif
}

/* x: [M, K] with row stride x_stride (elements); packed from small_gemm_f32_pack; bias: [N] or
 * NULL; y: [M, N] contiguous. */
F32_IN_ORDER void small_gemm_f32(const float *x, int64_t x_stride, const float *packed, const float *bias,
                                 float *y, int M, int N, int K) {
    int blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        const float *wb = packed + (size_t)b * K * NB;
        int n0 = b * NB, nc = N - n0 < NB ? N - n0 : NB;
        for (int m0 = 0; m0 < M; m0 += MBF) {
            int mc = M - m0 < MBF ? M - m0 : MBF;
            float acc[MBF][NB];
            const float *xm = x + m0 * x_stride;
            switch (mc) { /* a constant row count per call site keeps the sums in registers */
            case 1: block_dot_f32(wb, xm, x_stride, K, 1, acc); break;
            case 2: block_dot_f32(wb, xm, x_stride, K, 2, acc); break;
            case 3: block_dot_f32(wb, xm, x_stride, K, 3, acc); break;
            case 4: block_dot_f32(wb, xm, x_stride, K, 4, acc); break;
            case 5: block_dot_f32(wb, xm, x_stride, K, 5, acc); break;
#if MBF > 6
            case 6: block_dot_f32(wb, xm, x_stride, K, 6, acc); break;
            case 7: block_dot_f32(wb, xm, x_stride, K, 7, acc); break;
            case 8: block_dot_f32(wb, xm, x_stride, K, 8, acc); break;
            case 9: block_dot_f32(wb, xm, x_stride, K, 9, acc); break;
            case 10: block_dot_f32(wb, xm, x_stride, K, 10, acc); break;
            case 11: block_dot_f32(wb, xm, x_stride, K, 11, acc); break;
#endif
            default: block_dot_f32(wb, xm, x_stride, K, MBF, acc); break;
            }
            for (int m = 0; m < mc; m++) {
                float *ym = y + (size_t)(m0 + m) * N + n0;
                for (int j = 0; j < nc; j++) ym[j] = acc[m][j] + (bias ? bias[n0 + j] : 0.0f);
            }
        }
    }
}

/* ---- one row, float32 out, in parts -----------------------------------------------------------
 * y[N] = x[K] @ W[N, K]^T for one row of x (W packed by small_gemm_pack, bf16 != 0, or by
 * small_gemm_f32_pack), unrounded, over part `part` of `parts` equal runs of blocks: the
 * Markov head's bias per drafted position, each thread of the caller's parallel region on its
 * own part (the same part every call, so it stays in that core's cache). With one row a
 * block's sums are one dependent chain, so GV blocks run at once. */
#define GV 8
void small_gemv_part(const void *x, const void *packed, float *y, int N, int K, int bf16, int part, int parts) {
    int blocks = (N + NB - 1) / NB;
    int lo = (int)((int64_t)blocks * part / parts), hi = (int)((int64_t)blocks * (part + 1) / parts);
    int64_t bstride = bf16 ? (int64_t)(K / 2) * NB * 2 : (int64_t)K * NB; /* elements per block */
    int b = lo;
#ifdef __AVX512BF16__
    if (bf16) {
        const uint16_t *x16 = (const uint16_t *)x;
        for (; b + GV <= hi; b += GV) {
            const uint16_t *wb = (const uint16_t *)packed + (int64_t)b * bstride;
            __m512 a[GV];
            for (int i = 0; i < GV; i++) a[i] = _mm512_setzero_ps();
            for (int kp = 0; kp < K / 2; kp++) {
                uint32_t pair;
                memcpy(&pair, x16 + 2 * kp, sizeof(pair));
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
                const uint16_t *w = wb + (int64_t)kp * 2 * NB;
                for (int i = 0; i < GV; i++)
                    a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(w + i * bstride), xb);
            }
            float out[GV][NB];
            for (int i = 0; i < GV; i++) _mm512_storeu_ps(out[i], a[i]);
            for (int i = 0; i < GV; i++)
                for (int j = 0; j < NB && (b + i) * NB + j < N; j++) y[(b + i) * NB + j] = out[i][j];
        }
    }
#endif
    for (; b < hi; b++) {
        float acc[MB][NB]; /* MB >= MBF */
        if (bf16)
            block_dot((const uint16_t *)packed + (int64_t)b * bstride, (const uint16_t *)x, K, K, 1, acc);
        else
            block_dot_f32((const float *)packed + (int64_t)b * bstride, (const float *)x, K, K, 1, acc);
        for (int j = 0; j < NB && b * NB + j < N; j++) y[b * NB + j] = acc[0][j];
    }
}
