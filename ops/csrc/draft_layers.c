/* The drafter's decoder layers over a block of query rows in one call (bfloat16), so that a
 * proposal does not pay Python's dispatch for each of a layer's dozen kernels (each torch op or
 * ctypes call right after a kernel that streamed weights through the caches costs ~10-30 us);
 * and an all-greedy block's tail (draft LM head, Markov walk, confidence logits) likewise.
 *
 * The same kernels in the same order as the Python loop over them (FastDraftBackbone._layers
 * with the in-place attention): per layer the fused q/k/v product over the block's rows and the
 * context rows riding along, the q and k head norms with the rotary embedding, the k/v rows
 * written to the drafter's slot-major pools, attention of every block row to its context and
 * whole block, the output product, the residual add fused with the norm after it, SwiGLU and
 * the down product, the residual add fused with the next layer's input norm (the last layer's:
 * the final norm). Bit for bit the Python loop's output. Built with csrc/paged_attention.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

/* One layer's weights: products packed by small_gemm_pack (bias NULL where none), norms [d] or
 * [D] (next_norm: the next layer's input norm, or the final norm after the last layer). */
typedef struct {
    const uint16_t *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;
    const uint16_t *q_norm, *k_norm, *post_norm, *next_norm;
    float q_eps, k_eps, post_eps, next_eps;
} DraftLayer;

/* h [n, d]: the embedded block (updated in place: the residual stream); rows [n + m, d]: rows
 * n .. hold the context rows' features, rows 0 .. n - 1 receive each layer's normed input and,
 * at the end, the output (final norm applied); first_norm / first_eps: layer 0's input norm.
 * flat [n + m]: pool row (slot * capacity + position) of each block then context row; k_pools,
 * v_pools: per layer [slots * capacity, Hkv, D]; cos_q / sin_q [n, D] and cos_k / sin_k
 * [n + m, D] as the rotary kernels take them; G .. block_shift: the attention's segments (every
 * block row sees its context and the whole block). Returns 0, or -1 when a buffer could not be
 * allocated or the attention failed. */
int draft_layers_bf16(const DraftLayer *layers, int L, void *const *k_pools, void *const *v_pools,
                      uint16_t *h, uint16_t *rows, const uint16_t *first_norm, float first_eps,
                      const int64_t *flat, const uint16_t *cos_q, const uint16_t *sin_q,
                      const uint16_t *cos_k, const uint16_t *sin_k, int G, const int32_t *row0,
                      const int32_t *nseg, const int32_t *start, const int32_t *table, int max_blocks,
                      int block_shift, int n, int m, int d, int H, int Hkv, int D, int I, float scale) {
    const int T = n + m, nq = H * D, nk = Hkv * D, nqkv = nq + 2 * nk;
    uint16_t *qkv = malloc(sizeof(uint16_t) * (size_t)T * nqkv);
    uint16_t *qr = malloc(sizeof(uint16_t) * (size_t)n * nq);
    uint16_t *kr = malloc(sizeof(uint16_t) * (size_t)T * nk);
    uint16_t *att = malloc(sizeof(uint16_t) * (size_t)n * nq);
    uint16_t *o = malloc(sizeof(uint16_t) * (size_t)n * d);
    uint16_t *xn = malloc(sizeof(uint16_t) * (size_t)n * d);
    uint16_t *gu = malloc(sizeof(uint16_t) * (size_t)n * 2 * I);
    uint16_t *act = malloc(sizeof(uint16_t) * (size_t)n * I);
    int rc = (qkv && qr && kr && att && o && xn && gu && act) ? 0 : -1;
    if (rc == 0) add_rmsnorm(h, NULL, 0, first_norm, rows, n, d, first_eps);
    for (int l = 0; l < L && rc == 0; l++) {
        const DraftLayer *w = layers + l;
        uint16_t *kp = (uint16_t *)k_pools[l], *vp = (uint16_t *)v_pools[l];
        small_gemm(rows, d, w->qkv, w->qkv_bias, qkv, T, nqkv, d);
        norm_rope_bf16(qkv, nqkv, D, w->q_norm, w->q_eps, cos_q, sin_q, qr, n, H, D);
        norm_rope_bf16(qkv + nq, nqkv, D, w->k_norm, w->k_eps, cos_k, sin_k, kr, T, Hkv, D);
        for (int t = 0; t < T; t++) {
            memcpy(kp + flat[t] * nk, kr + (size_t)t * nk, sizeof(uint16_t) * (size_t)nk);
            memcpy(vp + flat[t] * nk, qkv + (size_t)t * nqkv + nq + nk, sizeof(uint16_t) * (size_t)nk);
        }
        rc = paged_attention(qr, nq, D, kp, vp, att, 1, G, row0, nseg, start, table, max_blocks,
                             block_shift, nk, D, 0, H, Hkv, D, scale);
        if (rc != 0) break;
        small_gemm(att, nq, w->o, w->o_bias, o, n, d, nq);
        add_rmsnorm(h, o, d, w->post_norm, xn, n, d, w->post_eps);
        small_gemm(xn, d, w->gate_up, NULL, gu, n, 2 * I, d);
        silu_mul(gu, act, n, I);
        small_gemm(act, I, w->down, NULL, o, n, d, I);
        add_rmsnorm(h, o, d, w->next_norm, rows, n, d, w->next_eps);
    }
    free(qkv);
    free(qr);
    free(kr);
    free(att);
    free(o);
    free(xn);
    free(gu);
    free(act);
    return rc;
}

/* An all-greedy block's tail in one call (bfloat16 hidden rows): the draft LM head over the
 * block's rows, the Markov head's greedy walk over its logits (markov_greedy_walk) and the
 * confidence head's raw logits, what DSparkDrafter.propose otherwise runs as three Python
 * calls and a dozen torch ops. hidden [B * K, d] (row stride hs); head packed [V, d] (no bias);
 * w1 / w2 / d2t / r as markov_greedy_walk takes them; anchor [B]. Confidence (w_h non-NULL):
 * conf[i] = sum_j hidden[i][j] * w_h[j] in float32 (j in order), + bias, + per_prev[prev of
 * row i] (per_prev NULL: none). -> tokens, prevs [B, K] int64 target ids. Returns 0, or -1 when
 * a buffer could not be allocated. */
int draft_tail_bf16(const uint16_t *hidden, int64_t hs, const uint16_t *head, int V, const void *w1,
                    const void *w2, int wdtype, const int64_t *d2t, int r, const int64_t *anchor,
                    int B, int K, int d, const float *w_h, const float *per_prev, float bias,
                    int64_t *tokens, int64_t *prevs, float *conf) {
    const int R = B * K;
    uint16_t *base = malloc(sizeof(uint16_t) * (size_t)R * V);
    if (!base) return -1;
    small_gemm(hidden, hs, head, NULL, base, R, V, d);
    int rc = markov_greedy_walk(base, 1, anchor, w1, w2, wdtype, d2t, B, K, V, r, tokens, prevs);
    free(base);
    if (rc != 0 || !w_h) return rc;
    for (int i = 0; i < R; i++) {
        const uint16_t *h = hidden + (int64_t)i * hs;
        float s = 0.0f;
        for (int j = 0; j < d; j++) s += bf16_to_f32(h[j]) * w_h[j];
        s += bias;
        if (per_prev) s += per_prev[prevs[i]];
        conf[i] = s;
    }
    return 0;
}
