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

#include "common.h"

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

/* Greedy drafting through a vanilla Markov head in float32, the whole block in one call: for each
 * row b and step k, logits[j] = base[b, k, j] + W2[j] . W1[prev] (the head's bias), the first
 * maximal j (torch.argmax's choice), token = d2t[j] (j without a map), and the token becomes
 * the next step's prev. base [B, K, V] contiguous, anchor [B], w1 [vocab, r], w2 [V, r];
 * tokens, prevs [B, K]: the drafted target ids and the id each was drafted after. */
void markov_greedy_f32(const float *base, const int64_t *anchor, const float *w1, const float *w2,
                       const int64_t *d2t, int B, int K, int V, int r, int64_t *tokens, int64_t *prevs) {
#pragma omp parallel for schedule(static) if (B > 1)
    for (int b = 0; b < B; b++) {
        int64_t prev = anchor[b];
        for (int k = 0; k < K; k++) {
            const float *e = w1 + prev * r;
            const float *lg = base + ((int64_t)b * K + k) * V;
            float best = -INFINITY;
            int arg = 0;
            for (int j = 0; j < V; j++) {
                const float *wj = w2 + (int64_t)j * r;
                float s = 0.0f;
                for (int i = 0; i < r; i++) s += wj[i] * e[i];
                float v = lg[j] + s;
                if (v > best) {
                    best = v;
                    arg = j;
                }
            }
            prevs[(int64_t)b * K + k] = prev;
            prev = d2t ? d2t[arg] : arg;
            tokens[(int64_t)b * K + k] = prev;
        }
    }
}

/* float32: each head row of x (T tokens x nh heads of D elements; token stride xs, head stride
 * hs, a head's D elements contiguous) RMSNorm'd with w [D] and then rotated by its token's
 * cos / sin [T, D] (rotate_half's sign folded into sin, as rope_store reads them), into out
 * [T, nh, D] contiguous: a q/k-norm and the rotary embedding after it in one pass. The norm is
 * add_rmsnorm_f32's (same sum order), the rotation rope_store's. */
void norm_rope_f32(const float *x, int64_t xs, int64_t hs, const float *w, float eps, const float *cos,
                   const float *sin, float *out, int T, int nh, int D) {
    int half = D / 2;
#pragma omp parallel for schedule(static) if (T * nh > 1024) /* small: a fork costs more */
    for (int t = 0; t < T; t++) {
        const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
        for (int h = 0; h < nh; h++) {
            const float *xt = x + (int64_t)t * xs + (int64_t)h * hs;
            float y[256]; /* D <= 256 (checked by the caller) */
            float ss = 0.0f;
            for (int i = 0; i < D; i++) ss += xt[i] * xt[i];
            float inv = 1.0f / sqrtf(ss / (float)D + eps);
            for (int i = 0; i < D; i++) y[i] = xt[i] * inv * w[i];
            float *o = out + ((int64_t)t * nh + h) * D;
            for (int d = 0; d < half; d++) o[d] = y[d] * c[d] + y[d + half] * s[d];
            for (int d = half; d < D; d++) o[d] = y[d] * c[d] + y[d - half] * s[d];
        }
    }
}
