/* The ARMv8.2 dotprod + i8mm path (USMMLA; built with -march=armv8.2-a+dotprod+i8mm, chosen
 * where getauxval says the CPU has both: Cortex-X2-X4, A710/A715, Snapdragon 8 Gen 1-3,
 * Dimensity 9000+, Tensor G3): a tile's rows in pairs by 2 x 8 by 8 x 2 matrix products (one
 * instruction: 32 byte products, SDOT's 16), a lone row by arm_dot.h's SDOT; MatMul6 by SDOT;
 * the attention as arm_dotprod.c's. The same bits as the reference (kernels.h's canonical order).
 *
 * SMMLA(acc, A, B) (USMMLA: A unsigned): A the codes of two columns c0, c1 (8 bytes each; 4-bit
 * codes as signed bytes, MatMul8's 8-bit ones unsigned), B the elements of two rows r0, r1 (8
 * bytes each, signed): acc [c0 r0, c0 r1, c1 r0, c1 r1] += their four dot products. A block's whole sums for the 2 x 2 come out of its halves' products added in one
 * register; the float sums are kept in that same order, lane (c, r) of a column pair's
 * register s[b % 4] for block b. */
#include <math.h>

#include "arm_dot.h"

/* [lo 8 bytes of a | lo 8 of b] and [hi 8 of a | hi 8 of b] */
MM_INLINE uint8x16_t zip_lo(uint8x16_t a, uint8x16_t b) {
    return vreinterpretq_u8_u64(vzip1q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
}
MM_INLINE uint8x16_t zip_hi(uint8x16_t a, uint8x16_t b) {
    return vreinterpretq_u8_u64(vzip2q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
}

/* two rows' lanes in the products' order [c0 r0, c0 r1, c1 r0, c1 r1]: v0 of r0, v1 of r1 */
MM_INLINE float32x4_t rows2_f(float v0, float v1) { return (float32x4_t){v0, v1, v0, v1}; }
MM_INLINE int32x4_t rows2_i(int32_t v0, int32_t v1) { return (int32x4_t){v0, v1, v0, v1}; }
MM_INLINE float32x4_t cols2_f(float c0, float c1) { return (float32x4_t){c0, c0, c1, c1}; }

/* the canonical end of a column pair's sums s[0..3]: (s0 + s1) + (s2 + s3) in each lane, stored
 * as rows r0, r1 of columns c, c + 1 */
MM_INLINE void finish_pair(const float32x4_t *s, float *y0, float *y1) {
    float32x4_t t = vaddq_f32(vaddq_f32(s[0], s[1]), vaddq_f32(s[2], s[3]));
    y0[0] = vgetq_lane_f32(t, 0), y1[0] = vgetq_lane_f32(t, 1), y0[1] = vgetq_lane_f32(t, 2), y1[1] = vgetq_lane_f32(t, 3);
}

/* MatMul4 (and MatMul4K's codes): a unit's block j of two rows against columns 2p, 2p + 1 */
MM_INLINE int32x4_t pair4(const uint8_t *c, int p, int j, const int8_t *e0, const int8_t *o0, const int8_t *e1,
                          const int8_t *o1) {
    const uint8x16_t nib = vdupq_n_u8(0x0F);
    uint8x16_t a = vld1q_u8(c + 64 * (2 * p) + 16 * j), b = vld1q_u8(c + 64 * (2 * p + 1) + 16 * j);
    uint8x16_t alo = vandq_u8(a, nib), ahi = vshrq_n_u8(a, 4), blo = vandq_u8(b, nib), bhi = vshrq_n_u8(b, 4);
    int8x16_t xe0 = vld1q_s8(e0 + 16 * j), xe1 = vld1q_s8(e1 + 16 * j);
    int8x16_t xo0 = vld1q_s8(o0 + 16 * j), xo1 = vld1q_s8(o1 + 16 * j);
    /* (the codes 0..15 as signed bytes: SMMLA) */
    int8x16_t x0 = vreinterpretq_s8_u8(zip_lo(vreinterpretq_u8_s8(xe0), vreinterpretq_u8_s8(xe1)));
    int8x16_t x1 = vreinterpretq_s8_u8(zip_hi(vreinterpretq_u8_s8(xe0), vreinterpretq_u8_s8(xe1)));
    int8x16_t x2 = vreinterpretq_s8_u8(zip_lo(vreinterpretq_u8_s8(xo0), vreinterpretq_u8_s8(xo1)));
    int8x16_t x3 = vreinterpretq_s8_u8(zip_hi(vreinterpretq_u8_s8(xo0), vreinterpretq_u8_s8(xo1)));
    int32x4_t acc = vmmlaq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(zip_lo(alo, blo)), x0);
    acc = vmmlaq_s32(acc, vreinterpretq_s8_u8(zip_hi(alo, blo)), x1);
    acc = vmmlaq_s32(acc, vreinterpretq_s8_u8(zip_lo(ahi, bhi)), x2);
    return vmmlaq_s32(acc, vreinterpretq_s8_u8(zip_hi(ahi, bhi)), x3);
}

/* MatMul4: rows r0, r0 + 1 of a group */
MM_INLINE void pairs4(const qrows *x, const uint8_t *c, const float *s, int64_t r0, float *y, int64_t n,
                      int64_t units) {
    float32x4_t f[2][4];
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 4; j++) f[p][j] = vdupq_n_f32(0.0f);
    const int8_t *e0 = x->lo + r0 * x->width, *o0 = x->hi + r0 * x->width;
    const int8_t *e1 = e0 + x->width, *o1 = o0 + x->width;
    for (int64_t u = 0; u < units; u++, c += 256, s += 16, e0 += 64, o0 += 64, e1 += 64, o1 += 64) {
        for (int l = 0; l < 4; l++) MM_PREFETCH(c + MM4_AHEAD * 256 + 64 * l);
        int64_t at0 = r0 * x->lanes + 4 * u, at1 = at0 + x->lanes;
        for (int j = 0; j < 4; j++) {
            int32x4_t bias = rows2_i(x->bias[at0 + j], x->bias[at1 + j]);
            float32x4_t step = rows2_f(x->steps[at0 + j], x->steps[at1 + j]);
            for (int p = 0; p < 2; p++) {
                float32x4_t scale = cols2_f(s[4 * (2 * p) + j], s[4 * (2 * p + 1) + j]);
                f[p][j] = fold(f[p][j], pair4(c, p, j, e0, o0, e1, o1), bias, scale, step);
            }
        }
    }
    for (int p = 0; p < 2; p++) finish_pair(f[p], y + r0 * n + 2 * p, y + (r0 + 1) * n + 2 * p);
}

/* MatMul4K: as pairs4, and each column's minimum part: lane (c, r) of m[p][b % 8] */
MM_INLINE void pairs4k(const qrows *x, const uint8_t *c, const uint8_t *mult, const uint16_t *base, int64_t r0,
                       float *y, int64_t n, int64_t units) {
    float32x4_t f[2][4], low[2][8];
    for (int p = 0; p < 2; p++) {
        for (int j = 0; j < 4; j++) f[p][j] = vdupq_n_f32(0.0f);
        for (int j = 0; j < 8; j++) low[p][j] = vdupq_n_f32(0.0f);
    }
    for (int64_t sb = 0; sb < units; sb++, c += 512, mult += 64, base += 8) {
        for (int l = 0; l < 8; l++) MM_PREFETCH(c + MM4K_AHEAD * 512 + 64 * l);
        float d[4], e[4];
        vst1q_f32(d, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(base))));
        vst1q_f32(e, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(base + 4))));
        const float *sums0 = x->sums + r0 * x->sum_width + MM4K_SUMS * sb, *sums1 = sums0 + x->sum_width;
        for (int s = 0; s < 2; s++) {
            int64_t u = 2 * sb + s, at0 = r0 * x->lanes + 4 * u, at1 = at0 + x->lanes;
            const int8_t *e0 = x->lo + r0 * x->width + 64 * u, *o0 = x->hi + r0 * x->width + 64 * u;
            for (int j = 0; j < 4; j++) {
                int b8 = 4 * s + j; /* (the block within its super-block) */
                int32x4_t bias = rows2_i(x->bias[at0 + j], x->bias[at1 + j]);
                float32x4_t step = rows2_f(x->steps[at0 + j], x->steps[at1 + j]);
                float32x4_t sums = rows2_f(sums0[b8], sums1[b8]);
                for (int p = 0; p < 2; p++) {
                    int c0 = 2 * p, c1 = 2 * p + 1;
                    float sc0 = (float)mult[8 * c0 + b8] * d[c0], sc1 = (float)mult[8 * c1 + b8] * d[c1];
                    float k0 = fmaf(sc0, MM4K_SHIFT, (float)mult[32 + 8 * c0 + b8] * e[c0]);
                    float k1 = fmaf(sc1, MM4K_SHIFT, (float)mult[32 + 8 * c1 + b8] * e[c1]);
                    f[p][j] = fold(f[p][j], pair4(c + 256 * s, p, j, e0, o0, e0 + x->width, o0 + x->width), bias,
                                   cols2_f(sc0, sc1), step);
                    low[p][b8] = vfmaq_f32(low[p][b8], cols2_f(k0, k1), sums);
                }
            }
        }
    }
    for (int p = 0; p < 2; p++) {
        float32x4_t main = vaddq_f32(vaddq_f32(f[p][0], f[p][1]), vaddq_f32(f[p][2], f[p][3]));
        const float32x4_t *m = low[p];
        float32x4_t mins = vaddq_f32(vaddq_f32(vaddq_f32(m[0], m[1]), vaddq_f32(m[2], m[3])),
                                     vaddq_f32(vaddq_f32(m[4], m[5]), vaddq_f32(m[6], m[7])));
        float32x4_t t = vaddq_f32(main, mins);
        float *ya = y + r0 * n + 2 * p, *yb = y + (r0 + 1) * n + 2 * p;
        ya[0] = vgetq_lane_f32(t, 0), yb[0] = vgetq_lane_f32(t, 1), ya[1] = vgetq_lane_f32(t, 2), yb[1] = vgetq_lane_f32(t, 3);
    }
}

/* MatMul8: block j (of a unit's 2) of two rows against columns 2p, 2p + 1 */
MM_INLINE int32x4_t pair8(const uint8_t *c, int p, int j, const int8_t *x0, const int8_t *x1) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int h = 0; h < 2; h++) {
        uint8x16_t a = vld1q_u8(c + MM8_UNIT * (2 * p) + MM8_BLOCK * j + 16 * h);
        uint8x16_t b = vld1q_u8(c + MM8_UNIT * (2 * p + 1) + MM8_BLOCK * j + 16 * h);
        uint8x16_t v0 = vreinterpretq_u8_s8(vld1q_s8(x0 + MM8_BLOCK * j + 16 * h));
        uint8x16_t v1 = vreinterpretq_u8_s8(vld1q_s8(x1 + MM8_BLOCK * j + 16 * h));
        acc = vusmmlaq_s32(acc, zip_lo(a, b), vreinterpretq_s8_u8(zip_lo(v0, v1)));
        acc = vusmmlaq_s32(acc, zip_hi(a, b), vreinterpretq_s8_u8(zip_hi(v0, v1)));
    }
    return acc;
}

MM_INLINE void pairs8(const qrows *x, const uint8_t *c, const float *s, int64_t r0, float *y, int64_t n,
                      int64_t units) {
    float32x4_t f[2][4];
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 4; j++) f[p][j] = vdupq_n_f32(0.0f);
    for (int64_t u = 0; u < units; u++, c += MM_GROUP * MM8_UNIT, s += 2 * MM_GROUP) {
        for (int l = 0; l < MM_GROUP; l++) MM_PREFETCH(c + MM8_AHEAD * MM_GROUP * MM8_UNIT + 64 * l);
        int64_t at0 = r0 * x->lanes + 2 * u, at1 = at0 + x->lanes;
        const int8_t *x0 = x->lo + r0 * x->width + MM8_UNIT * u, *x1 = x0 + x->width;
        for (int j = 0; j < 2; j++) {
            int slot = (int)((2 * u + j) % 4); /* (block 2u + j's running sum) */
            int32x4_t bias = rows2_i(x->bias[at0 + j], x->bias[at1 + j]);
            float32x4_t step = rows2_f(x->steps[at0 + j], x->steps[at1 + j]);
            for (int p = 0; p < 2; p++) {
                float32x4_t scale = cols2_f(s[2 * (2 * p) + j], s[2 * (2 * p + 1) + j]);
                f[p][slot] = fold(f[p][slot], pair8(c, p, j, x0, x1), bias, scale, step);
            }
        }
    }
    for (int p = 0; p < 2; p++) finish_pair(f[p], y + r0 * n + 2 * p, y + (r0 + 1) * n + 2 * p);
}

/* rows in pairs by the matrix products, a lone last row by SDOT; MatMul6 all by SDOT */
MM_INLINE int64_t up_to_two(int64_t left) { return left < 2 ? left : 2; }

static void matmul_i8mm(const mm_job *p) {
    if (p->kind == MM6) {
        matmul_dot(p);
        return;
    }
    const qrows *x = p->x;
    for (int64_t g = p->g0; g < p->g1; g++) {
        const uint8_t *c = p->codes + g * p->units * p->unit_bytes;
        float *y = p->y + g * MM_GROUP;
        int64_t r = 0;
        for (; r + 2 <= p->rows; r += 2) {
            if (p->kind == MM4) pairs4(x, c, (const float *)p->scales + g * p->units * 16, r, y, p->n, p->units);
            else if (p->kind == MM8)
                pairs8(x, c, (const float *)p->scales + g * p->units * 2 * MM_GROUP, r, y, p->n, p->units);
            else pairs4k(x, c, (const uint8_t *)p->scales + g * p->units * 64, (const uint16_t *)p->base + g * p->units * 8,
                         r, y, p->n, p->units);
        }
        if (r < p->rows) ARM_KIND_TILE(p, g, r, 1);
    }
}

#define ATTEND_SPECIALIZE 1
#include "attend_float.h"
#include "i8_dot.h"
#include "attend_i8.h"

const kpath kpath_i8mm = {
    .name = "i8mm",
    .needs = FEAT_DOTPROD | FEAT_I8MM,
    .matmul = {matmul_i8mm, matmul_i8mm, matmul_i8mm, matmul_i8mm},
    .prep = {[MM8] = prep8},
    .attend = {attend_f32, attend_f16, attend_i8_kv},
};
