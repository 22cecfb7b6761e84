/* The kernels the layer drivers (draft_layers.c, target_layers.c) call, defined in
 * small_gemm.c, elementwise.c and paged_attention.c. */
#ifndef DSPARK_CSRC_KERNELS_H
#define DSPARK_CSRC_KERNELS_H
#include <stdint.h>

/* small_gemm_ex flags */
#define GEMM_INVARIANT 1 /* one order of sums per row whatever the row count */
#define GEMM_F32_OUT 2   /* float32 outputs, unrounded */
void small_gemm_ex(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, void *y,
                   int M, int N, int K, int flags);
void small_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                uint16_t *y, int M, int N, int K);
void small_gemm_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                    int M, int N, int K);
void norm_rope_bf16(const uint16_t *x, int64_t xs, int64_t hs, const uint16_t *w, float eps,
                    const uint16_t *cos, const uint16_t *sin, uint16_t *out, int T, int nh, int D);
void add_rmsnorm(uint16_t *h, const uint16_t *delta, int64_t delta_stride, const uint16_t *w,
                 uint16_t *out, int T, int d, float eps);
void add_rmsnorm_f32(float *h, const float *delta, int64_t delta_stride, const float *w, float *out,
                     int T, int d, float eps);
void silu_mul(const uint16_t *gu, uint16_t *out, int T, int n);
void silu_mul_f32(const float *gu, float *out, int T, int n);
void rope_store(void *q, int64_t q_stride, int64_t q_hstride, const void *k, int64_t k_stride,
                int64_t k_hstride, const void *v, int64_t v_stride, const void *cos, const void *sin,
                const int64_t *slots, void *k_cache, void *v_cache, int64_t num_slots, int dtype, int T,
                int H, int Hkv, int D);
int markov_greedy_walk(const void *base, int base_dtype, const int64_t *anchor, const void *w1,
                       const void *w2, int dtype, const int64_t *d2t, int B, int K, int V, int r,
                       int64_t *tokens, int64_t *prevs);
/* paged_attention_ex flags */
#define ATTN_INVARIANT 1 /* one body, one order of sums per query row, for every row count */
int paged_attention_ex(const void *q, int64_t q_stride, int64_t q_hstride, const void *k_cache,
                       const void *v_cache, void *out, int dtype, int G, const int32_t *row0, const int32_t *n,
                       const int32_t *start, const int32_t *block_table, int max_blocks, int block_shift,
                       int64_t kv_token_stride, int64_t kv_head_stride, int causal, int H, int Hkv, int D,
                       float scale, int flags);
int paged_attention(const void *q, int64_t q_stride, int64_t q_hstride, const void *k_cache,
                    const void *v_cache, void *out, int dtype, int G, const int32_t *row0,
                    const int32_t *n, const int32_t *start, const int32_t *block_table, int max_blocks,
                    int block_shift, int64_t kv_token_stride, int64_t kv_head_stride, int causal,
                    int H, int Hkv, int D, float scale);

/* GGUF block types (ggml's type ids) quant_gemm computes from (csrc/quant_gemm.c) */
#define GGML_TYPE_Q4_0 2
#define GGML_TYPE_Q4_1 3
#define GGML_TYPE_Q8_0 8
int quant_block_bytes(int type);
int64_t quant_pack_bytes(int type, int N, int K);
int quant_pack(const void *w, int64_t row_bytes, int type, int N, int K, void *out);
int quant_gemm(const float *x, int64_t xs, const void *packed, int type, const float *bias, float *y, int M,
               int N, int K);

#endif
