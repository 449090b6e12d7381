/* The products on ARM with the dot product instructions (ARMv8.2 dotprod: SDOT, four byte
 * products into each 32-bit lane), for arm_dotprod.c and arm_i8mm.c (which uses them for a
 * tile's odd row). The same bits as the reference (kernels.h's canonical order): a column's
 * running sums s[0..3] are one register, lane j for the blocks b with b % 4 = j, and a unit of 4
 * blocks is one fused multiply-add a column: its 4 blocks' whole integer sums (SDOT's four parts
 * of each added pairwise) plus corrections, times scale x step.
 *
 * The integer dot of 16 bytes is `dot16`: SDOT here; arm_neon.c defines it from widening
 * multiplies (ARMv8.0) before including this file, so the v8.0 path is this same code. */
#ifndef EDGELITE_ARM_DOT_H
#define EDGELITE_ARM_DOT_H

#include <arm_neon.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MM_ROWS 4 /* rows a tile */
#define MM_PREFETCH(p) __asm__ volatile("prfm pldl1keep, %0" : : "Q"(*(const char *)(p)))
#define MM_INLINE static inline __attribute__((always_inline))

#ifndef ARM_DOT16
/* acc + the four 4-byte dot products of a and b (signed bytes) */
MM_INLINE int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) { return vdotq_s32(acc, a, b); }
#endif

/* four blocks' parts (a[j]: block j's four lanes) as [b0 b1 b2 b3], each a block's whole sum */
MM_INLINE int32x4_t whole4(const int32x4_t *a) { return vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3])); }

/* the canonical end of four columns' sums f[c] = [s0 s1 s2 s3]: (s0 + s1) + (s2 + s3) each */
MM_INLINE float32x4_t finish4(const float32x4_t *f) {
    return vpaddq_f32(vpaddq_f32(f[0], f[1]), vpaddq_f32(f[2], f[3]));
}

/* a column's unit: its block sums t plus corrections, times scale x step, fused into its sums */
MM_INLINE float32x4_t fold(float32x4_t f, int32x4_t t, int32x4_t bias, float32x4_t scale, float32x4_t step) {
    return vfmaq_f32(f, vcvtq_f32_s32(vaddq_s32(t, bias)), vmulq_f32(scale, step));
}

/* MatMul4 (and MatMul4K's codes): column r's unit (64 bytes at c: 4 blocks) against a row's 4
 * blocks (even and odd elements at e, o): [b0 b1 b2 b3] */
MM_INLINE int32x4_t dots4(const uint8_t *c, const int8_t *e, const int8_t *o) {
    const uint8x16_t nib = vdupq_n_u8(0x0F);
    uint8x16x4_t code = vld1q_u8_x4(c);
    int8x16x4_t ev = vld1q_s8_x4(e), ov = vld1q_s8_x4(o);
    int32x4_t a[4];
    for (int j = 0; j < 4; j++)
        a[j] = dot16(dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(code.val[j], nib)), ev.val[j]),
                     vreinterpretq_s8_u8(vshrq_n_u8(code.val[j], 4)), ov.val[j]);
    return whole4(a);
}

MM_INLINE void group4(const qrows *x, const uint8_t *c, const float *s, int64_t r0, const int R, float *y, int64_t n,
                      int64_t units) {
    float32x4_t f[MM_ROWS][MM_GROUP];
    for (int m = 0; m < R; m++)
        for (int r = 0; r < MM_GROUP; r++) f[m][r] = vdupq_n_f32(0.0f);
    for (int64_t u = 0; u < units; u++, c += 256, s += 16) {
        for (int l = 0; l < 4; l++) MM_PREFETCH(c + MM4_AHEAD * 256 + 64 * l);
        for (int m = 0; m < R; m++) {
            int64_t row = r0 + m, at = row * x->lanes + 4 * u;
            const int8_t *e = x->lo + row * x->width + 64 * u, *o = x->hi + row * x->width + 64 * u;
            int32x4_t bias = vld1q_s32(x->bias + at);
            float32x4_t step = vld1q_f32(x->steps + at);
            for (int r = 0; r < MM_GROUP; r++)
                f[m][r] = fold(f[m][r], dots4(c + 64 * r, e, o), bias, vld1q_f32(s + 4 * r), step);
        }
    }
    for (int m = 0; m < R; m++) vst1q_f32(y + (r0 + m) * n, finish4(f[m]));
}

/* MatMul4K: as group4, each column's minimum part in one more register (m[0..3]) against the
 * super-block's exact block sums. Each super-block first makes its 8 blocks' scales d sc of each
 * column (kept for the codes' part) and minimum coefficients 8 d sc + e m (used at once, for the
 * minimum part): measured, making them per unit and row took 0.93 instructions a weight byte at
 * one row, in two passes 0.87 */
MM_INLINE void group4k(const qrows *x, const uint8_t *c, const uint8_t *mult, const uint16_t *base, int64_t r0,
                       const int R, float *y, int64_t n, int64_t units) {
    float32x4_t f[MM_ROWS][MM_GROUP], low[MM_ROWS][MM_GROUP];
    for (int m = 0; m < R; m++)
        for (int r = 0; r < MM_GROUP; r++) f[m][r] = low[m][r] = vdupq_n_f32(0.0f);
    for (int64_t sb = 0; sb < units; sb++, c += 512, mult += 64, base += 8) {
        for (int l = 0; l < 8; l++) MM_PREFETCH(c + MM4K_AHEAD * 512 + 64 * l);
        MM_PREFETCH(mult + MM4K_AHEAD * 64);
        float d[4], e[4];
        vst1q_f32(d, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(base))));
        vst1q_f32(e, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(base + 4))));
        float32x4_t scale[MM_GROUP][2];
        for (int r = 0; r < MM_GROUP; r++) {
            uint16x8_t sc = vmovl_u8(vld1_u8(mult + 8 * r)), mm = vmovl_u8(vld1_u8(mult + 32 + 8 * r));
            for (int s = 0; s < 2; s++) {
                uint32x4_t sc4 = s ? vmovl_high_u16(sc) : vmovl_u16(vget_low_u16(sc));
                uint32x4_t mm4 = s ? vmovl_high_u16(mm) : vmovl_u16(vget_low_u16(mm));
                scale[r][s] = vmulq_n_f32(vcvtq_f32_u32(sc4), d[r]);
                float32x4_t coef = vfmaq_n_f32(vmulq_n_f32(vcvtq_f32_u32(mm4), e[r]), scale[r][s], MM4K_SHIFT);
                for (int m = 0; m < R; m++)
                    low[m][r] = vfmaq_f32(low[m][r], coef, vld1q_f32(x->sums + (r0 + m) * x->sum_width + MM4K_SUMS * sb + 4 * s));
            }
        }
        for (int s = 0; s < 2; s++) { /* MatMul4's units of 4 blocks */
            int64_t u = 2 * sb + s;
            for (int m = 0; m < R; m++) {
                int64_t row = r0 + m, at = row * x->lanes + 4 * u;
                const int8_t *ev = x->lo + row * x->width + 64 * u, *ov = x->hi + row * x->width + 64 * u;
                int32x4_t bias = vld1q_s32(x->bias + at);
                float32x4_t step = vld1q_f32(x->steps + at);
                for (int r = 0; r < MM_GROUP; r++)
                    f[m][r] = fold(f[m][r], dots4(c + 256 * s + 64 * r, ev, ov), bias, scale[r][s], step);
            }
        }
    }
    for (int m = 0; m < R; m++)
        vst1q_f32(y + (r0 + m) * n, vaddq_f32(finish4(f[m]), finish4(low[m])));
}

/* MatMul6: a column's 48 bytes (64 codes, 8 in 6 bytes) as the four phases of its 16 groups of
 * 3 bytes: code 4g + k in lane g of q[k] */
MM_INLINE void unpack6(const uint8_t *c, int8x16_t *q) {
    uint8x16x3_t b = vld3q_u8(c);
    const uint8x16_t six = vdupq_n_u8(63);
    q[0] = vreinterpretq_s8_u8(vandq_u8(b.val[0], six));
    q[1] = vreinterpretq_s8_u8(vandq_u8(vsliq_n_u8(vshrq_n_u8(b.val[0], 6), b.val[1], 2), six));
    q[2] = vreinterpretq_s8_u8(vandq_u8(vsliq_n_u8(vshrq_n_u8(b.val[1], 4), b.val[2], 4), six));
    q[3] = vreinterpretq_s8_u8(vshrq_n_u8(b.val[2], 2));
}

#ifndef ARM_DOT16
/* the 4 blocks' sums of a column's phases q against a row's 64 codes (x, its phases by vld4):
 * lane l of each SDOT covers groups 4l..4l+3 of a phase, block l, so the four add up whole */
MM_INLINE int32x4_t dots6(const int8x16_t *q, int8x16x4_t xv) {
    return dot16(dot16(dot16(dot16(vdupq_n_s32(0), q[0], xv.val[0]), q[1], xv.val[1]), q[2], xv.val[2]), q[3],
                 xv.val[3]);
}
#endif

MM_INLINE void group6(const qrows *x, const uint8_t *c, const int8_t *mult, const float *base, int64_t r0, const int R,
                      float *y, int64_t n, int64_t units) {
    float32x4_t f[MM_ROWS][MM_GROUP];
    for (int m = 0; m < R; m++)
        for (int r = 0; r < MM_GROUP; r++) f[m][r] = vdupq_n_f32(0.0f);
    for (int64_t sb = 0; sb < units; sb++, c += MM_GROUP * MM6_BYTES, mult += MM_GROUP * 16, base += MM_GROUP) {
        for (int l = 0; l < MM_GROUP * MM6_BYTES / 64; l++) MM_PREFETCH(c + MM6_AHEAD * MM_GROUP * MM6_BYTES + 64 * l);
        for (int s = 0; s < 4; s++) { /* 64 codes (4 blocks) a column */
            int8x16_t q[MM_GROUP][4];
            float32x4_t scale[MM_GROUP];
            for (int r = 0; r < MM_GROUP; r++) {
                unpack6(c + MM6_BYTES * r + 48 * s, q[r]);
                int8x8_t m8 = vreinterpret_s8_u32(vld1_dup_u32((const uint32_t *)(mult + 16 * r + 4 * s)));
                scale[r] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(m8)))), base[r]);
            }
            int64_t b0 = sb * (MM6_SUPER / MM6_BLOCK) + 4 * s;
            for (int m = 0; m < R; m++) {
                int64_t row = r0 + m, at = row * x->lanes + b0;
                int8x16x4_t xv = vld4q_s8(x->lo + row * x->width + sb * MM6_SUPER + 64 * s);
                int32x4_t bias = vld1q_s32(x->bias + at);
                float32x4_t step = vld1q_f32(x->steps + at);
                for (int r = 0; r < MM_GROUP; r++) f[m][r] = fold(f[m][r], dots6(q[r], xv), bias, scale[r], step);
            }
        }
    }
    for (int m = 0; m < R; m++) vst1q_f32(y + (r0 + m) * n, finish4(f[m]));
}

/* MatMul8: two units (4 blocks) at a time, the codes as signed bytes (code - 128: their dot with
 * the row is the codes' less 128 times the row's block sums, which the rows' own layout adds
 * back: rows_arm's bias8); an odd last unit's second half is zeros */
typedef struct {
    int32_t *bias8; /* each block's correction plus 128 times its codes' sum: `lanes` a row */
} rows_arm;

static __attribute__((unused)) int prep8(qrows *x, int kind) {
    (void)kind;
    rows_arm *own = (rows_arm *)malloc(sizeof(rows_arm) + (size_t)(x->rows * x->lanes) * sizeof(int32_t));
    if (!own) return 0;
    own->bias8 = (int32_t *)(own + 1);
    for (int64_t r = 0; r < x->rows; r++)
        for (int64_t b = 0; b < x->lanes; b++) {
            int32_t sum = 0;
            if (b < x->blocks)
                for (int j = 0; j < MM8_BLOCK; j++) sum += x->lo[r * x->width + b * MM8_BLOCK + j];
            own->bias8[r * x->lanes + b] = b < x->blocks ? x->bias[r * x->lanes + b] + 128 * sum : 0;
        }
    x->own = own;
    return 1;
}

MM_INLINE int32x4_t dots8(const uint8_t *c0, const uint8_t *c1, const int8_t *xr, const int two) {
    const uint8x16_t flip = vdupq_n_u8(0x80);
    int32x4_t a[4];
    for (int j = 0; j < 4; j++) {
        a[j] = vdupq_n_s32(0);
        if (j >= 2 && !two) continue;
        const uint8_t *c = (j < 2 ? c0 : c1) + MM8_BLOCK * (j % 2);
        for (int h = 0; h < 2; h++)
            a[j] = dot16(a[j], vreinterpretq_s8_u8(veorq_u8(vld1q_u8(c + 16 * h), flip)), vld1q_s8(xr + 32 * j + 16 * h));
    }
    return whole4(a);
}

MM_INLINE void group8(const qrows *x, const uint8_t *c, const float *s, int64_t r0, const int R, float *y, int64_t n,
                      int64_t units) {
    const rows_arm *own = (const rows_arm *)x->own;
    float32x4_t f[MM_ROWS][MM_GROUP];
    for (int m = 0; m < R; m++)
        for (int r = 0; r < MM_GROUP; r++) f[m][r] = vdupq_n_f32(0.0f);
    for (int64_t u = 0; u < units; u += 2, c += 2 * MM_GROUP * MM8_UNIT, s += 4 * MM_GROUP) {
        int two = u + 1 < units;
        for (int l = 0; l < 2 * MM_GROUP; l++) MM_PREFETCH(c + MM8_AHEAD * MM_GROUP * MM8_UNIT + 64 * l);
        float32x4_t scale[MM_GROUP];
        for (int r = 0; r < MM_GROUP; r++) { /* [unit u's 2 blocks | unit u + 1's] of column r */
            float32x2_t lo = vld1_f32(s + 2 * r), hi = two ? vld1_f32(s + 2 * MM_GROUP + 2 * r) : vdup_n_f32(0.0f);
            scale[r] = vcombine_f32(lo, hi);
        }
        for (int m = 0; m < R; m++) {
            int64_t row = r0 + m, at = row * x->lanes + 2 * u;
            int32x4_t bias = two ? vld1q_s32(own->bias8 + at) : vcombine_s32(vld1_s32(own->bias8 + at), vdup_n_s32(0));
            float32x4_t step = two ? vld1q_f32(x->steps + at) : vcombine_f32(vld1_f32(x->steps + at), vdup_n_f32(0.0f));
            const int8_t *xr = x->lo + row * x->width + MM8_UNIT * u;
            for (int r = 0; r < MM_GROUP; r++)
                f[m][r] = fold(f[m][r], dots8(c + MM8_UNIT * r, c + MM_GROUP * MM8_UNIT + MM8_UNIT * r, xr, two), bias,
                               scale[r], step);
        }
    }
    for (int m = 0; m < R; m++) vst1q_f32(y + (r0 + m) * n, finish4(f[m]));
}

/* rows in tiles of 1-4 for column groups g0..g1 (the same sums for each row whatever the tile) */
#define ARM_TILES(p, R_OF, TILE)                                                                  \
    do {                                                                                          \
        for (int64_t g = (p)->g0; g < (p)->g1; g++)                                               \
            for (int64_t r = 0; r < (p)->rows;) {                                                 \
                int64_t size = R_OF((p)->rows - r);                                               \
                switch (size) {                                                                   \
                case 4: TILE(g, r, 4); break;                                                     \
                case 3: TILE(g, r, 3); break;                                                     \
                case 2: TILE(g, r, 2); break;                                                     \
                default: TILE(g, r, 1); break;                                                    \
                }                                                                                 \
                r += size;                                                                        \
            }                                                                                     \
    } while (0)

/* one tile of any kind */
#define ARM_KIND_TILE(p, g, r, R)                                                                                  \
    ((p)->kind == MM4   ? group4((p)->x, (p)->codes + (g) * (p)->units * (p)->unit_bytes,                            \
                                 (const float *)(p)->scales + (g) * (p)->units * 16, r, R, (p)->y + (g) * MM_GROUP,   \
                                 (p)->n, (p)->units)                                                                  \
     : (p)->kind == MM6 ? group6((p)->x, (p)->codes + (g) * (p)->units * (p)->unit_bytes,                            \
                                 (const int8_t *)(p)->scales + (g) * (p)->units * MM_GROUP * 16,                      \
                                 (const float *)(p)->base + (g) * (p)->units * MM_GROUP, r, R,                        \
                                 (p)->y + (g) * MM_GROUP, (p)->n, (p)->units)                                         \
     : (p)->kind == MM8 ? group8((p)->x, (p)->codes + (g) * (p)->units * (p)->unit_bytes,                            \
                                 (const float *)(p)->scales + (g) * (p)->units * 2 * MM_GROUP, r, R,                  \
                                 (p)->y + (g) * MM_GROUP, (p)->n, (p)->units)                                         \
                        : group4k((p)->x, (p)->codes + (g) * (p)->units * (p)->unit_bytes,                           \
                                  (const uint8_t *)(p)->scales + (g) * (p)->units * 64,                               \
                                  (const uint16_t *)(p)->base + (g) * (p)->units * 8, r, R, (p)->y + (g) * MM_GROUP,  \
                                  (p)->n, (p)->units))

MM_INLINE int64_t up_to_four(int64_t left) { return left < MM_ROWS ? left : MM_ROWS; }

static void matmul_dot(const mm_job *p) {
#define TILE(g, r, R) ARM_KIND_TILE(p, g, r, R)
    ARM_TILES(p, up_to_four, TILE);
#undef TILE
}

#endif
