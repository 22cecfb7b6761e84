/* Shared helpers of the CPU kernels: bfloat16 <-> float32, an element of either, and a
 * vectorisable exp. */
#ifndef DSPARK_CSRC_COMMON_H
#define DSPARK_CSRC_COMMON_H
#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* Element i of a float32 (bf16 == 0) or bfloat16 row, as float32: for kernels with one body
 * for both dtypes (inlined per dtype, where the branch folds away). */
static inline __attribute__((always_inline)) float load_elem(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* exp for x <= 0 (softmax inputs after subtracting the max): Cody-Waite range reduction and a
 * degree-6 polynomial, ~1 ulp on [-87, 0]; pure arithmetic, so the compiler vectorises it. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

#endif
