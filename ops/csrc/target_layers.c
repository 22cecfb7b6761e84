/* The target's decoder layers over one step's rows in one call (float32 or bfloat16), so that a
 * forward does not pay Python's dispatch, an output allocation and the argument checks for each
 * of a layer's nine kernels (~270 calls a step; ~1.5-2 ms of a ~13 ms one-token step on a
 * 2-core CPU).
 *
 * The same kernels in the same order as the Python loop (FastForwardMixin._layers_fused with
 * the paged attention): per layer the fused q/k/v product, rotary on q in place with the
 * rotated k and v written to the head-major paged cache, causal attention of every segment's
 * pieces, the output product, the residual add fused with the norm after it, SwiGLU and the
 * down product, the residual add fused with the next layer's input norm (the last layer's: the
 * final norm). Bit for bit the loop's output. The tap states the drafter absorbs are copied
 * where the loop cloned them: the embeddings (tap -1), the residual stream after a layer, the
 * final-normed output for the last layer. Built with csrc/paged_attention.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* One layer's weights: products packed by small_gemm_pack / small_gemm_f32_pack, or GGUF
 * blocks packed by quant_pack (float32 steps: `types` the products' block types, qkv, o,
 * gate_up, down, 0 for a float one), bias NULL where none (gate_up has none), norms [d]
 * (next_norm: the next layer's input norm, or the final norm after the last layer), all of the
 * step's dtype. */
typedef struct {
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down, *down_bias;
    const void *post_norm, *next_norm;
    float post_eps, next_eps;
    int types[4];
} TargetLayer;

enum { P_QKV, P_O, P_GATE_UP, P_DOWN };

/* returns 0, or quant_gemm's error */
static int gemm(int bf16, const void *x, int64_t xs, const TargetLayer *l, int which, const void *w, const void *b,
                void *y, int M, int N, int K, int invariant) {
    if (l->types[which])
        return quant_gemm((const float *)x, xs, w, l->types[which], (const float *)b, (float *)y, M, N, K);
    if (bf16)
        small_gemm_ex((const uint16_t *)x, xs, (const uint16_t *)w, (const uint16_t *)b, y, M, N, K,
                      invariant ? GEMM_INVARIANT : 0);
    else
        small_gemm_f32((const float *)x, xs, (const float *)w, (const float *)b, (float *)y, M, N, K);
    return 0;
}

static void norm(int bf16, void *h, const void *delta, int64_t ds, const void *w, void *out, int T, int d,
                 float eps) {
    if (bf16)
        add_rmsnorm((uint16_t *)h, (const uint16_t *)delta, ds, (const uint16_t *)w, (uint16_t *)out, T, d, eps);
    else
        add_rmsnorm_f32((float *)h, (const float *)delta, ds, (const float *)w, (float *)out, T, d, eps);
}

/* rows [T, d] -> column block `col` of taps [T, ntaps * d] */
static void tap(const char *rows, char *taps, int col, int ntaps, int T, int d, size_t es) {
    for (int t = 0; t < T; t++)
        memcpy(taps + ((size_t)t * ntaps + col) * d * es, rows + (size_t)t * d * es, (size_t)d * es);
}

/* h [T, d]: the embedded rows (updated in place: the residual stream); x [T, d] receives the
 * output (final norm applied); first_norm / first_eps: layer 0's input norm. k_caches /
 * v_caches: per layer the head-major pool [Hkv, num_slots, D]; cos / sin [T, D] (rotate_half's
 * sign folded into sin); slots [T] int64; G .. block_shift: the attention's causal segment
 * pieces. tap_col [L + 1]: for the embeddings (0) and after each layer l (l + 1) the column
 * block of taps [T, ntaps * d] that receives a copy, or -1. invariant: the products and the
 * attention in their batch-invariant orders (GEMM_INVARIANT, ATTN_INVARIANT). Returns 0, or -1
 * when a buffer could not be allocated, the attention failed or a block product was refused. */
int target_layers(const TargetLayer *layers, int L, int bf16, void *const *k_caches, void *const *v_caches,
                  int64_t num_slots, void *h, void *x, const void *first_norm, float first_eps,
                  const void *cos, const void *sin, const int64_t *slots, int G, const int32_t *row0,
                  const int32_t *nseg, const int32_t *start, const int32_t *table, int max_blocks,
                  int block_shift, int T, int d, int H, int Hkv, int D, int I, float scale,
                  const int32_t *tap_col, void *taps, int ntaps, int invariant) {
    const int nq = H * D, nk = Hkv * D, nqkv = nq + 2 * nk, dt = bf16 ? 1 : 0;
    const size_t es = bf16 ? 2 : 4;
    char *qkv = malloc(es * (size_t)T * nqkv), *att = malloc(es * (size_t)T * nq);
    char *o = malloc(es * (size_t)T * d), *gu = malloc(es * (size_t)T * 2 * I), *act = malloc(es * (size_t)T * I);
    int rc = (qkv && att && o && gu && act) ? 0 : -1;
    if (rc == 0) {
        if (tap_col[0] >= 0) tap((const char *)h, (char *)taps, tap_col[0], ntaps, T, d, es);
        norm(bf16, h, NULL, 0, first_norm, x, T, d, first_eps);
    }
    for (int l = 0; l < L && rc == 0; l++) {
        const TargetLayer *w = layers + l;
        if ((rc = gemm(bf16, x, d, w, P_QKV, w->qkv, w->qkv_bias, qkv, T, nqkv, d, invariant)) != 0) break;
        rope_store(qkv, nqkv, D, qkv + es * nq, nqkv, D, qkv + es * (nq + nk), nqkv, cos, sin, slots,
                   k_caches[l], v_caches[l], num_slots, dt, T, H, Hkv, D);
        rc = paged_attention_ex(qkv, nqkv, D, k_caches[l], v_caches[l], att, dt, G, row0, nseg, start, table,
                                max_blocks, block_shift, D, num_slots * D, 1, H, Hkv, D, scale,
                                invariant ? ATTN_INVARIANT : 0);
        if (rc != 0) break;
        if ((rc = gemm(bf16, att, nq, w, P_O, w->o, w->o_bias, o, T, d, nq, invariant)) != 0) break;
        norm(bf16, h, o, d, w->post_norm, x, T, d, w->post_eps);
        if ((rc = gemm(bf16, x, d, w, P_GATE_UP, w->gate_up, NULL, gu, T, 2 * I, d, invariant)) != 0) break;
        if (bf16)
            silu_mul((const uint16_t *)gu, (uint16_t *)act, T, I);
        else
            silu_mul_f32((const float *)gu, (float *)act, T, I);
        if ((rc = gemm(bf16, act, I, w, P_DOWN, w->down, w->down_bias, o, T, d, I, invariant)) != 0) break;
        norm(bf16, h, o, d, w->next_norm, x, T, d, w->next_eps);
        if (tap_col[l + 1] >= 0)
            tap((const char *)(l == L - 1 ? x : h), (char *)taps, tap_col[l + 1], ntaps, T, d, es);
    }
    free(qkv);
    free(att);
    free(o);
    free(gu);
    free(act);
    return rc;
}
