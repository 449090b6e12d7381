/* A ggml-shaped Q4_0 x Q8_0 dot product loop on NEON with dotprod (the shape of
 * ggml_vec_dot_q4_0_q8_0's ARM path: two blocks a step, nibbles less 8 as signed bytes, SDOT,
 * the two float16 scales' product fused into float lanes), written for scripts/bench_arm.py's
 * instruction counts only: ROWS rows of Q8_0 activations against N columns of K Q4_0 weights.
 * arm_ggml_q4 K N ROWS */
#include <arm_neon.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0; /* 18 bytes */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;       /* 34 bytes */

static inline float f16(uint16_t h) {
    __fp16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static float __attribute__((noinline)) vec_dot_q4_0_q8_0(int n, const block_q4_0 *x, const block_q8_0 *y) {
    const uint8x16_t m4b = vdupq_n_u8(0x0F);
    const int8x16_t s8b = vdupq_n_s8(0x8);
    float32x4_t sumv0 = vdupq_n_f32(0.0f), sumv1 = vdupq_n_f32(0.0f);
    for (int i = 0; i < n / QK; i += 2) {
        const block_q4_0 *x0 = &x[i], *x1 = &x[i + 1];
        const block_q8_0 *y0 = &y[i], *y1 = &y[i + 1];
        const uint8x16_t v0_0 = vld1q_u8(x0->qs), v0_1 = vld1q_u8(x1->qs);
        const int8x16_t v0_0l = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v0_0, m4b)), s8b);
        const int8x16_t v0_0h = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v0_0, 4)), s8b);
        const int8x16_t v0_1l = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v0_1, m4b)), s8b);
        const int8x16_t v0_1h = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v0_1, 4)), s8b);
        const int8x16_t v1_0l = vld1q_s8(y0->qs), v1_0h = vld1q_s8(y0->qs + 16);
        const int8x16_t v1_1l = vld1q_s8(y1->qs), v1_1h = vld1q_s8(y1->qs + 16);
        const int32x4_t p_0 = vdotq_s32(vdotq_s32(vdupq_n_s32(0), v0_0l, v1_0l), v0_0h, v1_0h);
        const int32x4_t p_1 = vdotq_s32(vdotq_s32(vdupq_n_s32(0), v0_1l, v1_1l), v0_1h, v1_1h);
        sumv0 = vmlaq_n_f32(sumv0, vcvtq_f32_s32(p_0), f16(x0->d) * f16(y0->d));
        sumv1 = vmlaq_n_f32(sumv1, vcvtq_f32_s32(p_1), f16(x1->d) * f16(y1->d));
    }
    return vaddvq_f32(sumv0) + vaddvq_f32(sumv1);
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    int k = atoi(argv[1]), n = atoi(argv[2]), rows = atoi(argv[3]);
    block_q4_0 *w = calloc((size_t)n * (size_t)(k / QK), sizeof(block_q4_0));
    block_q8_0 *a = calloc((size_t)rows * (size_t)(k / QK), sizeof(block_q8_0));
    float *y = calloc((size_t)rows * (size_t)n, sizeof(float));
    if (!w || !a || !y) return 2;
    for (size_t i = 0; i < (size_t)n * (size_t)(k / QK); i++) w[i].d = 0x3c00, memset(w[i].qs, 0x5a, QK / 2);
    for (size_t i = 0; i < (size_t)rows * (size_t)(k / QK); i++) a[i].d = 0x3c00, memset(a[i].qs, 3, QK);
    for (int c = 0; c < n; c++)
        for (int r = 0; r < rows; r++) y[r * n + c] = vec_dot_q4_0_q8_0(k, w + (size_t)c * (k / QK), a + (size_t)r * (k / QK));
    printf("%g\n", y[0]);
    return 0;
}
