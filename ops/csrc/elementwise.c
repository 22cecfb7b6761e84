/* Fused elementwise steps of a decoder layer (what torch runs as several small kernels each):
 * the residual add with the following RMSNorm, and SwiGLU's silu(gate) * up.
 * bfloat16 rows: float32 arithmetic, one rounding per output, as torch's bf16 kernels round each
 * op's output: the residual sum is bit-identical to torch's bf16 add; the norm rounds once where
 * the LayerNorm formulation (FastRMSNorm) also rounds once.
 * float32 rows (`_f32`): the same steps in float32; the residual sum is bit-identical to torch's
 * add, the norm's sum of squares runs in this build's (vectorised) order. Each row is computed
 * alone, the same whatever else shares the call. Built with csrc/paged_attention.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common.h"
#include "kernels.h" /* the prototypes the layer drivers call: checked against the definitions here */

/* h [T, d] (row stride d) += delta [T, d] (row stride delta_stride; NULL: no add), rounded to
 * bf16 in place; then out [T, d] = h / sqrt(mean(h^2) + eps) * w. */
void add_rmsnorm(uint16_t *h, const uint16_t *delta, int64_t delta_stride, const uint16_t *w,
                 uint16_t *out, int T, int d, float eps) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        uint16_t *ht = h + (int64_t)t * d;
        float ss = 0.0f;
        if (delta) {
            const uint16_t *dt = delta + (int64_t)t * delta_stride;
            for (int i = 0; i < d; i++) {
                uint16_t s = f32_to_bf16(bf16_to_f32(ht[i]) + bf16_to_f32(dt[i]));
                ht[i] = s;
                float x = bf16_to_f32(s);
                ss += x * x;
            }
        } else {
            for (int i = 0; i < d; i++) {
                float x = bf16_to_f32(ht[i]);
                ss += x * x;
            }
        }
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
        uint16_t *ot = out + (int64_t)t * d;
        for (int i = 0; i < d; i++) ot[i] = f32_to_bf16(bf16_to_f32(ht[i]) * inv * bf16_to_f32(w[i]));
    }
}

/* gu [T, 2n] (gate | up) -> out [T, n] = silu(gate) * up */
void silu_mul(const uint16_t *gu, uint16_t *out, int T, int n) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gu + (int64_t)t * 2 * n, *u = g + n;
        uint16_t *o = out + (int64_t)t * n;
        for (int i = 0; i < n; i++) {
            float x = bf16_to_f32(g[i]);
            float e = exp_nonpos(x < 0.0f ? x : -x); /* exp(-|x|): no overflow either way */
            float silu = x < 0.0f ? x * e / (1.0f + e) : x / (1.0f + e);
            o[i] = f32_to_bf16(silu * bf16_to_f32(u[i]));
        }
    }
}

/* float32: h [T, d] += delta [T, d] (row stride delta_stride; NULL: no add), in place; then
 * out [T, d] = h / sqrt(mean(h^2) + eps) * w. */
void add_rmsnorm_f32(float *h, const float *delta, int64_t delta_stride, const float *w, float *out,
                     int T, int d, float eps) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        float *ht = h + (int64_t)t * d;
        if (delta) {
            const float *dt = delta + (int64_t)t * delta_stride;
            for (int i = 0; i < d; i++) ht[i] += dt[i];
        }
        float ss = 0.0f;
        for (int i = 0; i < d; i++) ss += ht[i] * ht[i];
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
        float *ot = out + (int64_t)t * d;
        for (int i = 0; i < d; i++) ot[i] = ht[i] * inv * w[i];
    }
}

/* float32: gu [T, 2n] (gate | up) -> out [T, n] = silu(gate) * up */
void silu_mul_f32(const float *gu, float *out, int T, int n) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (int64_t)t * 2 * n, *u = g + n;
        float *o = out + (int64_t)t * n;
        for (int i = 0; i < n; i++) {
            float x = g[i];
            float e = exp_nonpos(x < 0.0f ? x : -x); /* exp(-|x|): no overflow either way */
            float silu = x < 0.0f ? x * e / (1.0f + e) : x / (1.0f + e);
            o[i] = silu * u[i];
        }
    }
}

/* x (T tokens x nh heads of D elements; token stride xs, head stride hs, a head's D elements
 * contiguous), float32 or bfloat16 (bf16 != 0) like w [D], cos / sin [T, D] and out: each head
 * row RMSNorm'd with w and then rotated by its token's cos / sin (rotate_half's sign folded
 * into sin, as rope_store reads them), into out [T, nh, D] contiguous: a q/k-norm and the
 * rotary embedding after it in one pass. float32 arithmetic, one rounding per bf16 output
 * (torch's bf16 path rounds after the norm and again after the rotation). The norm is
 * add_rmsnorm_f32's (same sum order), the rotation rope_store's. Inlined into one body per
 * dtype, where the dtype's branches fold away. */
static inline __attribute__((always_inline)) void norm_rope(const void *x, int64_t xs, int64_t hs,
                                                            const void *w, float eps, const void *cos,
                                                            const void *sin, void *out, int T, int nh,
                                                            int D, int bf16) {
    int half = D / 2;
#pragma omp parallel for schedule(static) if (T * nh > 1024) /* small: a fork costs more */
    for (int t = 0; t < T; t++) {
        int64_t c = (int64_t)t * D;
        for (int h = 0; h < nh; h++) {
            int64_t xt = (int64_t)t * xs + (int64_t)h * hs;
            float y[256]; /* D <= 256 (checked by the caller) */
            float ss = 0.0f;
            for (int i = 0; i < D; i++) {
                y[i] = load_elem(x, xt + i, bf16);
                ss += y[i] * y[i];
            }
            float inv = 1.0f / sqrtf(ss / (float)D + eps);
            for (int i = 0; i < D; i++) y[i] = y[i] * inv * load_elem(w, i, bf16);
            float r[256];
            for (int d = 0; d < half; d++) r[d] = y[d] * load_elem(cos, c + d, bf16) + y[d + half] * load_elem(sin, c + d, bf16);
            for (int d = half; d < D; d++) r[d] = y[d] * load_elem(cos, c + d, bf16) + y[d - half] * load_elem(sin, c + d, bf16);
            int64_t o = ((int64_t)t * nh + h) * D;
            for (int d = 0; d < D; d++) {
                if (bf16)
                    ((uint16_t *)out)[o + d] = f32_to_bf16(r[d]);
                else
                    ((float *)out)[o + d] = r[d];
            }
        }
    }
}

void norm_rope_f32(const float *x, int64_t xs, int64_t hs, const float *w, float eps, const float *cos,
                   const float *sin, float *out, int T, int nh, int D) {
    norm_rope(x, xs, hs, w, eps, cos, sin, out, T, nh, D, 0);
}

void norm_rope_bf16(const uint16_t *x, int64_t xs, int64_t hs, const uint16_t *w, float eps,
                    const uint16_t *cos, const uint16_t *sin, uint16_t *out, int T, int nh, int D) {
    norm_rope(x, xs, hs, w, eps, cos, sin, out, T, nh, D, 1);
}

/* ---- argmax over rows -------------------------------------------------------------------------
 * The index of each row's first maximal element, torch.argmax's choice (a NaN counts as the
 * maximum and the first NaN wins; -0.0 and +0.0 are equal): x [T, V] float32 (dtype 0) or
 * bfloat16 (dtype 1) with row stride rs (elements). Two passes over a row: its maximum (and
 * whether it holds a NaN), then the first element equal to it. torch's CPU argmax over bf16
 * logits takes ~4 ns an element (0.75 ms for a verify step's 8 x 49,152 logits); this reads
 * each row twice from cache at the vector width. */
#ifdef __AVX512F__
static inline __m512 argmax_vec(const void *x, int dtype, int64_t i, __mmask16 k) {
    if (dtype) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)x + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)x + i);
}
#elif defined(__AVX2__)
static inline __m256 argmax_vec8(const void *x, int dtype, int64_t i) {
    if (dtype) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}
#endif

static int64_t argmax_row(const void *x, int dtype, int64_t V) {
    float best = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (; i < V; i += 16) {
        __mmask16 k = V - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - i)) - 1u);
        /* masked-off lanes load 0.0 and are kept out of the max by the mask */
        __m512 v = argmax_vec(x, dtype, i, k);
        un |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
        m = _mm512_mask_max_ps(m, k, m, v);
    }
    nan = un != 0;
    best = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
        __m256 v = argmax_vec8(x, dtype, i);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    nan = _mm256_movemask_ps(un) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
    for (; i < V; i++) {
        float v = load_elem(x, i, dtype);
        nan |= v != v;
        best = v > best ? v : best;
    }
#else
    for (; i < V; i++) {
        float v = load_elem(x, i, dtype);
        nan |= v != v;
        best = v > best ? v : best;
    }
#endif
    if (nan) {
        for (i = 0; i < V; i++) {
            float v = load_elem(x, i, dtype);
            if (v != v) return i;
        }
    }
    i = 0;
#ifdef __AVX512F__
    __m512 b = _mm512_set1_ps(best);
    for (; i + 16 <= V; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(argmax_vec(x, dtype, i, (__mmask16)0xffff), b, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz((unsigned)eq);
    }
#elif defined(__AVX2__)
    __m256 b = _mm256_set1_ps(best);
    for (; i + 8 <= V; i += 8) {
        int eq = _mm256_movemask_ps(_mm256_cmp_ps(argmax_vec8(x, dtype, i), b, _CMP_EQ_OQ));
        if (eq) return i + __builtin_ctz((unsigned)eq);
    }
#endif
    for (; i < V; i++)
        if (load_elem(x, i, dtype) == best) return i;
    return 0; /* an all -inf row: its first element, as torch */
}

void argmax_rows(const void *x, int dtype, int T, int64_t V, int64_t rs, int64_t *out) {
    int64_t esize = dtype ? 2 : 4;
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int t = 0; t < T; t++) out[t] = argmax_row((const char *)x + (int64_t)t * rs * esize, dtype, V);
}

/* The first maximal entry of one row among the entries a packed token mask allows (a greedy
 * draft row under a grammar): x [V] float32 (dtype 0) or bfloat16 (dtype 1); entry j stands for
 * token t = d2t[j] (t = j where d2t is NULL: no truncated vocabulary), allowed where bit t of
 * bits [W] int32 is set (llguidance's layout; tokens past 32 W are not). A NaN counts as the
 * maximum and the first NaN wins, as in argmax_row. Returns -1 when no entry is allowed. The
 * argmax of the row masked to -inf off the allowed tokens, without writing the mask out. */
static int64_t argmax_allowed_words(const void *x, int dtype, int64_t V, const uint32_t *b, int64_t W) {
    /* entry j is token j: the maximum over the allowed words (whole words of ones as plain
     * loops the compiler vectorises, words of nothing skipped), then its first allowed index */
    float best = -INFINITY;
    int nan = 0, any = 0;
    for (int64_t w = 0; w < W && 32 * w < V; w++) {
        uint32_t word = b[w];
        int64_t base = 32 * w, n = V - base < 32 ? V - base : 32;
        if (!word) continue;
        any = 1;
        if (word == 0xFFFFFFFFu && n == 32) {
            float m = -INFINITY;
            int un = 0;
            for (int64_t j = 0; j < 32; j++) {
                float v = load_elem(x, base + j, dtype);
                un |= v != v;
                m = v > m ? v : m;
            }
            nan |= un;
            best = m > best ? m : best;
            continue;
        }
        for (uint32_t bits = word; bits; bits &= bits - 1) {
            int64_t j = base + __builtin_ctz(bits);
            if (j >= V) break;
            float v = load_elem(x, j, dtype);
            nan |= v != v;
            best = v > best ? v : best;
        }
    }
    if (!any) return -1;
    for (int64_t w = 0; w < W && 32 * w < V; w++) {
        for (uint32_t bits = b[w]; bits; bits &= bits - 1) {
            int64_t j = 32 * w + __builtin_ctz(bits);
            if (j >= V) break;
            float v = load_elem(x, j, dtype);
            if (nan ? v != v : v == best) return j;
        }
    }
    return -1; /* allowed tokens all past the row */
}

int64_t argmax_allowed(const void *x, int dtype, int64_t V, const int64_t *d2t, const int32_t *bits,
                       int64_t W) {
    const uint32_t *b = (const uint32_t *)bits;
    if (!d2t) return argmax_allowed_words(x, dtype, V, b, W);
    int64_t at = -1;
    float best = -INFINITY;
    for (int64_t j = 0; j < V; j++) {
        int64_t t = d2t[j];
        if (t < 0 || (t >> 5) >= W || !((b[t >> 5] >> (t & 31)) & 1u)) continue;
        float v = load_elem(x, j, dtype);
        if (at < 0 || v > best || (v != v && best == best)) {
            at = j;
            best = v;
        }
    }
    return at;
}

/* Inverse-CDF draws, one per row: a float32 row of V entries (rows need not be normalised) and
 * a uniform u (double, in [0, 1)) -> the first index whose cumulative mass exceeds
 * x = min(u * total, the double below total). The mass is summed in double over blocks of 64
 * entries, each block in order and eight blocks side by side (independent sums the core
 * overlaps), then the blocks' sums in order: the same order for every row and batch, so a draw
 * reads its own row and uniform alone. The search walks the blocks' sums to the block holding x,
 * then that block's entries; an entry of zero mass never raises the sum, so it is never drawn.
 * A row without mass (or with a NaN) draws V - 1.
 * The row drawn from may be a residual, computed entry by entry as it is read (never stored):
 * max(0, p - q) against a draft distribution q (RESID_Q), or p without the draft token t
 * (RESID_ONE_HOT: max(0, p - one-hot(t))), as speculative sampling draws after a rejection. */
#define DRAW_BLOCK 64
enum { RESID_NONE = 0, RESID_ONE_HOT = 1, RESID_Q = 2 };

static inline __attribute__((always_inline)) float mass_at(const float *p, const float *q, int64_t t,
                                                          int mode, int64_t i) {
    if (mode == RESID_Q) {
        float r = p[i] - q[i];
        return r > 0 ? r : 0.0f;
    }
    if (mode == RESID_ONE_HOT && i == t) {
        float r = p[i] - 1.0f;
        return r > 0 ? r : 0.0f;
    }
    return p[i];
}

/* The draws' sums in the order written (the library's -fassociative-math would let the total
 * and the search's running sum be added in different orders). */
#if defined(__GNUC__) && !defined(__clang__)
#define ORDERED_SUMS __attribute__((optimize("no-associative-math")))
#else
#define ORDERED_SUMS
#endif

ORDERED_SUMS static inline __attribute__((always_inline)) double
block_sums(const float *p, const float *q, int64_t t, int mode, int64_t V, double *sums) {
    int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK, full = V / DRAW_BLOCK;
    int64_t b = 0;
    for (; b + 8 <= full; b += 8) {
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t at = b * DRAW_BLOCK;
        for (int j = 0; j < DRAW_BLOCK; j++)
            for (int k = 0; k < 8; k++) acc[k] += (double)mass_at(p, q, t, mode, at + k * DRAW_BLOCK + j);
        for (int k = 0; k < 8; k++) sums[b + k] = acc[k];
    }
    for (; b < nb; b++) {
        double acc = 0;
        int64_t end = (b + 1) * DRAW_BLOCK < V ? (b + 1) * DRAW_BLOCK : V;
        for (int64_t i = b * DRAW_BLOCK; i < end; i++) acc += (double)mass_at(p, q, t, mode, i);
        sums[b] = acc;
    }
    double total = 0;
    for (b = 0; b < nb; b++) total += sums[b];
    return total;
}

ORDERED_SUMS static int64_t draw_from(const float *p, const float *q, int64_t t, int mode, int64_t V, double total, double u,
                         const double *sums) {
    int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK, b;
    if (!(total > 0)) return V - 1; /* no mass, or a NaN */
    double x = u * total, below = nextafter(total, 0.0);
    x = x < below ? x : below;
    double before = 0; /* the mass of the blocks before b */
    for (b = 0; b < nb - 1; b++) {
        if (before + sums[b] > x) break;
        before += sums[b];
    } /* b: the block holding x, or the last one */
    int64_t end = (b + 1) * DRAW_BLOCK < V ? (b + 1) * DRAW_BLOCK : V, last = -1;
    double c = before;
    for (int64_t i = b * DRAW_BLOCK; i < end; i++) {
        float m = mass_at(p, q, t, mode, i);
        if (m > 0) last = i;
        c += (double)m;
        if (c > x && m > 0) return i;
    }
    /* the block summed in another order fell short of x by a rounding: its last entry with mass */
    if (last >= 0) return last;
    for (int64_t i = V - 1; i >= 0; i--)
        if (mass_at(p, q, t, mode, i) > 0) return i;
    return V - 1;
}

/* Speculative sampling's last draw of each request, one per row: p is row prow[r] of probs
 * [*, V] (stride ps); where rejected[r], the residual max(0, p - q) is drawn from, q being row
 * qrow[r] of qs [*, V] (stride qss), or one-hot on token[r] where qs is NULL or onehot[r]; a
 * residual whose mass is not above eps (p equals q up to rounding) draws from p instead, as
 * does a request that was not rejected (rejected all 0: plain draws from the rows prow). u [N]
 * double, out [N]: the draws above. Returns 0, or -1 when a buffer could not be allocated. */
ORDERED_SUMS int sample_final_rows(const float *probs, int64_t ps, const int64_t *prow, const float *qs, int64_t qss,
                      const int64_t *qrow, const uint8_t *onehot, const int64_t *token, const uint8_t *rejected,
                      double eps, int N, int64_t V, const double *u, int64_t *out) {
    int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
    int failed = 0;
#pragma omp parallel for schedule(static) if (N >= 4) reduction(| : failed)
    for (int r = 0; r < N; r++) {
        double *sums = (double *)malloc((size_t)nb * sizeof(double));
        if (!sums) {
            failed = 1;
            continue;
        }
        const float *p = probs + prow[r] * ps;
        int drawn = 0;
        if (rejected[r]) {
            int hot = !qs || onehot[r];
            const float *q = hot ? NULL : qs + qrow[r] * qss;
            int mode = hot ? RESID_ONE_HOT : RESID_Q;
            double total = hot ? block_sums(p, NULL, token[r], RESID_ONE_HOT, V, sums)
                               : block_sums(p, q, 0, RESID_Q, V, sums);
            if (total > eps) {
                out[r] = draw_from(p, q, hot ? token[r] : 0, mode, V, total, u[r], sums);
                drawn = 1;
            }
        }
        if (!drawn)
            out[r] = draw_from(p, NULL, 0, RESID_NONE, V, block_sums(p, NULL, 0, RESID_NONE, V, sums), u[r], sums);
        free(sums);
    }
    return failed ? -1 : 0;
}

/* Token masks applied in place: x [T, V] float32 with row stride rs, bits [T, W] packed as
 * llguidance writes them (bit j of word w allows token 32 w + j): a token that is not allowed
 * gets -inf. Tokens past 32 W are not allowed. Whole words of 0 or of ones (most of a JSON
 * state's vocabulary) are one store loop or nothing. */
void mask_rows_bits(float *x, int T, int64_t V, int64_t rs, const int32_t *bits, int64_t W) {
#pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *row = x + (int64_t)t * rs;
        const uint32_t *b = (const uint32_t *)bits + (int64_t)t * W;
        for (int64_t base = 0; base < V; base += 32) {
            int64_t w = base / 32, n = V - base < 32 ? V - base : 32;
            uint32_t word = w < W ? b[w] : 0u;
            if (word == 0xFFFFFFFFu) continue;
            for (int64_t j = 0; j < n; j++)
                if (!((word >> j) & 1u)) row[base + j] = -INFINITY;
        }
    }
}

/* Greedy drafting through a vanilla Markov head, the whole block in one call: for each row b
 * and step k, logits[j] = base[b, k, j] + W2[j] . W1[prev] (the head's bias), the first maximal
 * j (torch.argmax's choice), token = d2t[j] (j without a map), and the token becomes the next
 * step's prev. base [B, K, V] contiguous, float32 or bf16 (base_dtype 0 / 1), anchor [B];
 * w1 [vocab, r] in float32 or bf16 (dtype 0 / 1); w2: W2 [V, r] packed by small_gemm_pack /
 * small_gemm_f32_pack (same dtype); tokens, prevs [B, K]: the drafted target ids and the id
 * each was drafted after. Returns 0, or -1 when its buffer could not be allocated.
 * The bias stays float32 (not rounded to a bf16 head's dtype, as torch's bf16 linear would
 * round it) and is added to the logits in float32. The bias of one position is split across
 * the threads (each core reads its part of W2 from its own cache: the walk is bound by that
 * read), the argmax taken by one. */
void small_gemv_part(const void *x, const void *packed, float *y, int N, int K, int bf16, int part, int parts);

int markov_greedy_walk(const void *base, int base_dtype, const int64_t *anchor, const void *w1,
                       const void *w2, int dtype, const int64_t *d2t, int B, int K, int V, int r,
                       int64_t *tokens, int64_t *prevs) {
    float *v = (float *)malloc((size_t)V * sizeof(float));
    if (!v) return -1;
    int64_t esize = dtype ? 2 : 4;
    int64_t prev = 0;
#pragma omp parallel
    {
        int part = 0, parts = 1;
#ifdef _OPENMP
        part = omp_get_thread_num();
        parts = omp_get_num_threads();
#endif
        for (int b = 0; b < B; b++) {
#pragma omp single
            prev = anchor[b];
            for (int k = 0; k < K; k++) {
                const char *e = (const char *)w1 + prev * r * esize;
                small_gemv_part(e, w2, v, V, r, dtype, part, parts);
#pragma omp barrier
#pragma omp single
                {
                    int64_t lg = ((int64_t)b * K + k) * V;
                    if (base_dtype)
                        for (int j = 0; j < V; j++) v[j] += load_elem(base, lg + j, 1);
                    else
                        for (int j = 0; j < V; j++) v[j] += load_elem(base, lg + j, 0);
                    int64_t arg = argmax_row(v, 0, V);
                    prevs[(int64_t)b * K + k] = prev;
                    prev = d2t ? d2t[arg] : arg;
                    tokens[(int64_t)b * K + k] = prev;
                } /* single's barrier: every thread sees the new prev */
            }
        }
    }
    free(v);
    return 0;
}
