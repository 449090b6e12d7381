/* The int8 attention's vector code on ARM with the dot product instructions (arm_dotprod.c,
 * arm_i8mm.c): the blocks a row covers whole, in exact int32 sums as the plain loops' (so the
 * same bits). Scores: 4 positions' dot products with a query at a time (SDOT, the four parts of
 * each added pairwise). Values: each block's 32 rows transposed once (4 positions of a column to
 * a lane) and summed against each head's weight codes by SDOT, the codes less 128 (signed) and
 * 128 times each column's sum added back. The hooks attend_i8.h calls. */
#ifndef EDGELITE_I8_DOT_H
#define EDGELITE_I8_DOT_H

#include <arm_neon.h>

#include "attend_common.h"

KINLINE int i8v_ok(int64_t g, int64_t d) { return d % 16 == 0 && d <= MAX_D && g <= MAX_GROUP; }

/* vs: a block's values transposed (BLOCK x d bytes: 4 positions x 16 columns as 4 vectors, lane
 * l of vector k: column 4 k + l), each column's sum over the block (d int32), then the
 * queries' codes as bytes (count x d) */
KINLINE int8_t *vs_values(void *vs) { return (int8_t *)vs; }
KINLINE int32_t *vs_colsum(void *vs, int64_t d) { return (int32_t *)((int8_t *)vs + BLOCK * d); }
KINLINE int8_t *vs_queries(void *vs, int64_t d) { return (int8_t *)(vs_colsum(vs, d) + d); }

KINLINE void i8v_queries(const int16_t *i16, int64_t count, int64_t d, void *vs) {
    int8_t *qb = vs_queries(vs, d);
    for (int64_t i = 0; i < count * d; i++) qb[i] = (int8_t)i16[i]; /* (codes within -127..127) */
}

KINLINE void i8v_keys(const void *keys, int64_t b, int64_t d, void *vs) { (void)keys, (void)b, (void)d, (void)vs; }

/* row r's g heads' scores over block b: 4 positions at a time */
KINLINE void i8v_scores(void *vs, const int16_t *i16, int64_t r, const float *qstep, int64_t g, const void *keys,
                        int64_t b, int64_t d, const float *kstep, float *sh, int64_t span) {
    (void)i16;
    const int8_t *qb = vs_queries(vs, d) + r * g * d;
    for (int64_t j = 0; j < BLOCK; j += 4) {
        const int8_t *k0 = (const int8_t *)keys + (b + j) * (d + 2);
        float32x4_t ks = vld1q_f32(kstep + j);
        for (int64_t h = 0; h < g; h++) {
            int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int64_t i = 0; i < d; i += 16) {
                int8x16_t qv = vld1q_s8(qb + h * d + i);
                for (int l = 0; l < 4; l++) acc[l] = vdotq_s32(acc[l], qv, vld1q_s8(k0 + l * (d + 2) + i));
            }
            int32x4_t dots = vpaddq_s32(vpaddq_s32(acc[0], acc[1]), vpaddq_s32(acc[2], acc[3]));
            vst1q_f32(sh + h * span + j, vmulq_f32(vcvtq_f32_s32(dots), vmulq_n_f32(ks, qstep[h])));
        }
    }
}

KINLINE void i8v_scores_row(void *vs, const int16_t *i16, const float *qstep, int64_t g, const void *keys, int64_t b,
                            int64_t d, const float *kstep, float *sh, int64_t span) {
    i8v_scores(vs, i16, 0, qstep, g, keys, b, d, kstep, sh, span);
}

/* block b's values transposed, and each column's sum over the block */
KINLINE void i8v_values(const void *values, int64_t b, int64_t d, void *vs) {
    int8_t *t = vs_values(vs);
    int32_t *colsum = vs_colsum(vs, d);
    const int8x16_t ones = vdupq_n_s8(1);
    for (int64_t c = 0; c < d; c += 16) {
        int32x4_t sums[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int64_t t4 = 0; t4 < BLOCK / 4; t4++) {
            const int8_t *v0 = (const int8_t *)values + (b + 4 * t4) * (d + 2) + c;
            int8x16_t r0 = vld1q_s8(v0), r1 = vld1q_s8(v0 + d + 2), r2 = vld1q_s8(v0 + 2 * (d + 2));
            int8x16_t r3 = vld1q_s8(v0 + 3 * (d + 2));
            int16x8_t a = vreinterpretq_s16_s8(vzip1q_s8(r0, r1)), a2 = vreinterpretq_s16_s8(vzip2q_s8(r0, r1));
            int16x8_t e = vreinterpretq_s16_s8(vzip1q_s8(r2, r3)), e2 = vreinterpretq_s16_s8(vzip2q_s8(r2, r3));
            int8x16_t tv[4] = {vreinterpretq_s8_s16(vzip1q_s16(a, e)), vreinterpretq_s8_s16(vzip2q_s16(a, e)),
                               vreinterpretq_s8_s16(vzip1q_s16(a2, e2)), vreinterpretq_s8_s16(vzip2q_s16(a2, e2))};
            for (int k = 0; k < 4; k++) {
                vst1q_s8(t + (t4 * d + c) * 4 + 16 * k, tv[k]);
                sums[k] = vdotq_s32(sums[k], tv[k], ones);
            }
        }
        for (int k = 0; k < 4; k++) vst1q_s32(colsum + c + 4 * k, sums[k]);
    }
}

/* o += one head's weights p (over the block's 32 positions, times the values' steps vstep, as
 * codes 0..255 and a step) . the block's values */
KINLINE void i8v_sums(void *vs, const float *p, const float *vstep, const void *values, int64_t b, int64_t d, float *o) {
    (void)values, (void)b;
    float32x4_t w[BLOCK / 4];
    float top = 0.0f;
    for (int i = 0; i < BLOCK / 4; i++) {
        w[i] = vmulq_f32(vld1q_f32(p + 4 * i), vld1q_f32(vstep + 4 * i));
        top = fmaxf(top, vmaxvq_f32(w[i])); /* (weights and steps are >= 0) */
    }
    if (!(top > 0.0f)) return;
    float inv = W_MAX / top, wstep = top / W_MAX;
    int8_t w8[BLOCK];
    for (int i = 0; i < BLOCK / 4; i++) { /* codes 0..255, less 128 */
        int32x4_t code = vcvtnq_s32_f32(vmulq_n_f32(w[i], inv));
        int8x8_t c8 = vmovn_s16(vcombine_s16(vmovn_s32(vsubq_s32(code, vdupq_n_s32(128))), vdup_n_s16(0)));
        vst1_lane_s32((int32_t *)(w8 + 4 * i), vreinterpret_s32_s8(c8), 0);
    }
    const int8_t *t = vs_values(vs);
    const int32_t *colsum = vs_colsum(vs, d);
    for (int64_t c = 0; c < d; c += 16) {
        int32x4_t acc[4];
        for (int k = 0; k < 4; k++) acc[k] = vshlq_n_s32(vld1q_s32(colsum + c + 4 * k), 7); /* (128 x each sum) */
        for (int64_t t4 = 0; t4 < BLOCK / 4; t4++) {
            int32_t w4;
            memcpy(&w4, w8 + 4 * t4, 4);
            int8x16_t wv = vreinterpretq_s8_s32(vdupq_n_s32(w4));
            for (int k = 0; k < 4; k++) acc[k] = vdotq_s32(acc[k], vld1q_s8(t + (t4 * d + c) * 4 + 16 * k), wv);
        }
        for (int k = 0; k < 4; k++)
            vst1q_f32(o + c + 4 * k, vfmaq_n_f32(vld1q_f32(o + c + 4 * k), vcvtq_f32_s32(acc[k]), wstep));
    }
}

KINLINE void i8v_sums_row(void *vs, const float *p, int64_t span, int64_t g, const float *vstep, const void *values,
                          int64_t b, int64_t d, float *o) {
    i8v_values(values, b, d, vs);
    for (int64_t h = 0; h < g; h++) i8v_sums(vs, p + h * span, vstep, values, b, d, o + h * d);
}

KINLINE const int *i8v_order(void) { return NULL; }

KINLINE void i8v_steps(const void *plane, int64_t b, int64_t d, float *step) {
    for (int64_t jj = 0; jj < BLOCK; jj++) step[jj] = row_step(plane, b + jj, d);
}

#endif
