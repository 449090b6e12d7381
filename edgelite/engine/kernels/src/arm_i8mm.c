/* The ARMv8.2 dotprod + i8mm path (SMMLA, USMMLA; built with -march=armv8.2-a+dotprod+i8mm,
 * chosen where getauxval says the CPU has both: Cortex-X2-X4, A710/A715, Snapdragon 8 Gen 1-3,
 * Dimensity 9000+, Tensor G3): a tile's rows in pairs by 2 x 8 by 8 x 2 matrix products (one
 * instruction: 32 byte products, SDOT's 16), a lone row by arm_dot.h's SDOT; MatMul6 by SDOT;
 * the attention as arm_dotprod.c's. The same bits as the reference (kernels.h's canonical order).
 *
 * SMMLA(acc, A, B) (USMMLA: A unsigned): A the codes of two columns c0, c1 (8 bytes each; 4-bit
 * codes as signed bytes, MatMul8's 8-bit ones unsigned), B the elements of two rows r0, r1 (8
 * bytes each, signed): acc [c0 r0, c0 r1, c1 r0, c1 r1] += their four dot products. A block's
 * whole sums for the 2 x 2 come out of its halves' products added in one register; the float
 * sums are kept in that same order, lane (c, r) of a column pair's register s[b % 4] for block
 * b. The rows' own layout (prep) holds each pair of rows' codes in that order (8 bytes of one,
 * 8 of the other) and each block's steps and corrections as [r0 r1 r0 r1]. */
#include <math.h>

#include "arm_dot.h"

/* the rows' layout for row pairs: pair p's codes of 16 bytes q (lo, hi: as qrows' at 2 x width
 * bytes a pair), [r0 0-7 | r1 0-7 | r0 8-15 | r1 8-15]; per block [r0 r1 r0 r1] of the steps
 * and corrections; the lone row's rows_arm first (arm_dot.h's MatMul8) */
typedef struct {
    rows_arm dot;
    int8_t *lo2, *hi2;
    float *steps2;
    int32_t *bias2;
} rows_i8mm;

static int prep(qrows *x, int kind) {
    int split = kind == MM4 || kind == MM4K;
    int64_t pairs = x->rows / 2, code_bytes = 2 * pairs * x->width, lanes = pairs * x->lanes * 4;
    size_t bytes = sizeof(rows_i8mm) + 64 + (size_t)(code_bytes * (split ? 2 : 1)) + (size_t)lanes * 8 +
                   (size_t)(x->rows * x->lanes) * sizeof(int32_t);
    char *mem = (char *)malloc(bytes);
    if (!mem) return 0;
    rows_i8mm *own = (rows_i8mm *)mem;
    char *at = (char *)(((uintptr_t)(own + 1) + 63) & ~(uintptr_t)63);
    own->dot.bias8 = (int32_t *)at, at += (size_t)(x->rows * x->lanes) * sizeof(int32_t);
    own->steps2 = (float *)at, at += (size_t)lanes * 4;
    own->bias2 = (int32_t *)at, at += (size_t)lanes * 4;
    own->lo2 = (int8_t *)at, at += code_bytes;
    own->hi2 = split ? (int8_t *)at : NULL;
    for (int64_t r = 0; r < x->rows; r++) /* (the lone row's MatMul8 by SDOT: arm_dot.h's prep8) */
        for (int64_t b = 0; b < x->lanes; b++) {
            int32_t sum = 0;
            if (kind == MM8 && b < x->blocks)
                for (int j = 0; j < MM8_BLOCK; j++) sum += x->lo[r * x->width + b * MM8_BLOCK + j];
            own->dot.bias8[r * x->lanes + b] = b < x->blocks ? x->bias[r * x->lanes + b] + 128 * sum : 0;
        }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t r0 = 2 * p, r1 = r0 + 1;
        for (int h = 0; h < 1 + split; h++) {
            const int8_t *src = h ? x->hi : x->lo;
            int8_t *dst = (h ? own->hi2 : own->lo2) + 2 * p * x->width;
            for (int64_t q = 0; q + 16 <= x->width; q += 16) {
                int64x2_t a = vreinterpretq_s64_s8(vld1q_s8(src + r0 * x->width + q));
                int64x2_t b = vreinterpretq_s64_s8(vld1q_s8(src + r1 * x->width + q));
                vst1q_s8(dst + 2 * q, vreinterpretq_s8_s64(vzip1q_s64(a, b)));
                vst1q_s8(dst + 2 * q + 16, vreinterpretq_s8_s64(vzip2q_s64(a, b)));
            }
        }
        for (int64_t b = 0; b < x->lanes; b++) {
            int64_t at2 = (p * x->lanes + b) * 4, a0 = r0 * x->lanes + b, a1 = r1 * x->lanes + b;
            float st[4] = {x->steps[a0], x->steps[a1], x->steps[a0], x->steps[a1]};
            int32_t bi[4] = {x->bias[a0], x->bias[a1], x->bias[a0], x->bias[a1]};
            memcpy(own->steps2 + at2, st, sizeof(st));
            memcpy(own->bias2 + at2, bi, sizeof(bi));
        }
    }
    x->own = own;
    return 1;
}

/* [lo 8 bytes of a | lo 8 of b] and [hi 8 of a | hi 8 of b] */
MM_INLINE uint8x16_t zip_lo(uint8x16_t a, uint8x16_t b) {
    return vreinterpretq_u8_u64(vzip1q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
}
MM_INLINE uint8x16_t zip_hi(uint8x16_t a, uint8x16_t b) {
    return vreinterpretq_u8_u64(vzip2q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
}

/* columns c0's and c1's 4 scales (a, b) as [a_j a_j b_j b_j] for each block j */
MM_INLINE void scales2(float32x4_t a, float32x4_t b, float32x4_t *out) {
    float32x4_t t0 = vzip1q_f32(a, b), t1 = vzip2q_f32(a, b); /* [a0 b0 a1 b1], [a2 b2 a3 b3] */
    out[0] = vzip1q_f32(t0, t0), out[1] = vzip2q_f32(t0, t0), out[2] = vzip1q_f32(t1, t1), out[3] = vzip2q_f32(t1, t1);
}

/* the canonical end of a column pair's sums s[0..3] of a row pair: (s0 + s1) + (s2 + s3), lanes
 * [c0 r0, c0 r1, c1 r0, c1 r1] stored into rows y0, y1 at columns 0, 1 */
MM_INLINE void finish_pair(const float32x4_t *s, float *y0, float *y1) {
    float32x4_t t = vaddq_f32(vaddq_f32(s[0], s[1]), vaddq_f32(s[2], s[3]));
    float v[4];
    vst1q_f32(v, t);
    y0[0] = v[0], y1[0] = v[1], y0[1] = v[2], y1[1] = v[3];
}

/* MatMul4: row pairs pp..pp+RP-1 of a group; each block's codes split and paired once for them */
MM_INLINE void pairs4(const qrows *x, const uint8_t *c, const float *s, int64_t pp, const int RP, float *y,
                      int64_t n, int64_t units) {
    const rows_i8mm *w = (const rows_i8mm *)x->own;
    const uint8x16_t nib = vdupq_n_u8(0x0F);
    float32x4_t f[2][2][4];
    for (int q = 0; q < RP; q++)
        for (int p = 0; p < 2; p++)
            for (int j = 0; j < 4; j++) f[q][p][j] = vdupq_n_f32(0.0f);
    for (int64_t u = 0; u < units; u++, c += 256, s += 16) {
        for (int l = 0; l < 4; l++) MM_PREFETCH(c + MM4_AHEAD * 256 + 64 * l);
        float32x4_t sc[2][4];
        for (int p = 0; p < 2; p++) scales2(vld1q_f32(s + 4 * (2 * p)), vld1q_f32(s + 4 * (2 * p + 1)), sc[p]);
        for (int j = 0; j < 4; j++) {
            int8x16_t cl[2][2], ch[2][2];
            for (int p = 0; p < 2; p++) {
                uint8x16_t a = vld1q_u8(c + 64 * (2 * p) + 16 * j), b = vld1q_u8(c + 64 * (2 * p + 1) + 16 * j);
                uint8x16_t al = vandq_u8(a, nib), ah = vshrq_n_u8(a, 4), bl = vandq_u8(b, nib), bh = vshrq_n_u8(b, 4);
                cl[p][0] = vreinterpretq_s8_u8(zip_lo(al, bl)), cl[p][1] = vreinterpretq_s8_u8(zip_hi(al, bl));
                ch[p][0] = vreinterpretq_s8_u8(zip_lo(ah, bh)), ch[p][1] = vreinterpretq_s8_u8(zip_hi(ah, bh));
            }
            for (int q = 0; q < RP; q++) {
                int64_t pair = pp + q, at = (pair * x->lanes + 4 * u + j) * 4, cq = 2 * (pair * x->width + 64 * u + 16 * j);
                int8x16_t e0 = vld1q_s8(w->lo2 + cq), e1 = vld1q_s8(w->lo2 + cq + 16);
                int8x16_t o0 = vld1q_s8(w->hi2 + cq), o1 = vld1q_s8(w->hi2 + cq + 16);
                int32x4_t bias = vld1q_s32(w->bias2 + at);
                float32x4_t step = vld1q_f32(w->steps2 + at);
                for (int p = 0; p < 2; p++) {
                    int32x4_t acc = vmmlaq_s32(vmmlaq_s32(vdupq_n_s32(0), cl[p][0], e0), cl[p][1], e1);
                    acc = vmmlaq_s32(vmmlaq_s32(acc, ch[p][0], o0), ch[p][1], o1);
                    f[q][p][j] = fold(f[q][p][j], acc, bias, sc[p][j], step);
                }
            }
        }
    }
    for (int q = 0; q < RP; q++)
        for (int p = 0; p < 2; p++)
            finish_pair(f[q][p], y + 2 * (pp + q) * n + 2 * p, y + (2 * (pp + q) + 1) * n + 2 * p);
}

/* MatMul4K: a row pair of a group: the codes' part as pairs4 (lane (c, r) of s[b % 4]); each
 * row's minimum part as arm_dot.h's group4k (m[b % 4] of a column in the lanes of one register,
 * against the row's exact block sums; the sums' order is the reference's either way). A unit's
 * scales d sc are made once for the pair */
MM_INLINE void pairs4k(const qrows *x, const uint8_t *c, const uint8_t *mult, const uint16_t *base, int64_t pair,
                       float *y, int64_t n, int64_t units) {
    const rows_i8mm *w = (const rows_i8mm *)x->own;
    const uint8x16_t nib = vdupq_n_u8(0x0F);
    const int64_t r0 = 2 * pair;
    float32x4_t f[2][4], low[2][MM_GROUP];
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 4; j++) f[p][j] = vdupq_n_f32(0.0f);
    for (int m = 0; m < 2; m++)
        for (int r = 0; r < MM_GROUP; r++) low[m][r] = vdupq_n_f32(0.0f);
    for (int64_t sb = 0; sb < units; sb++, c += 512, mult += 64, base += 8) {
        for (int l = 0; l < 8; l++) MM_PREFETCH(c + MM4K_AHEAD * 512 + 64 * l);
        float d[4], e[4];
        vst1q_f32(d, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(base))));
        vst1q_f32(e, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(base + 4))));
        for (int s = 0; s < 2; s++) {
            int64_t u = 2 * sb + s;
            float32x4_t scale[MM_GROUP];
            for (int r = 0; r < MM_GROUP; r++) {
                uint8x8_t b8 = vreinterpret_u8_u32(vld1_dup_u32((const uint32_t *)(mult + 8 * r + 4 * s)));
                uint8x8_t m8 = vreinterpret_u8_u32(vld1_dup_u32((const uint32_t *)(mult + 32 + 8 * r + 4 * s)));
                scale[r] = vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b8)))), d[r]);
                float32x4_t coef = vfmaq_n_f32(vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(m8)))), e[r]),
                                               scale[r], MM4K_SHIFT);
                for (int m = 0; m < 2; m++)
                    low[m][r] = vfmaq_f32(low[m][r], coef, vld1q_f32(x->sums + (r0 + m) * x->sum_width + MM4K_SUMS * sb + 4 * s));
            }
            float32x4_t sc[2][4];
            for (int p = 0; p < 2; p++) scales2(scale[2 * p], scale[2 * p + 1], sc[p]);
            for (int j = 0; j < 4; j++) {
                int64_t at = (pair * x->lanes + 4 * u + j) * 4, cq = 2 * (pair * x->width + 64 * u + 16 * j);
                int8x16_t e0 = vld1q_s8(w->lo2 + cq), e1 = vld1q_s8(w->lo2 + cq + 16);
                int8x16_t o0 = vld1q_s8(w->hi2 + cq), o1 = vld1q_s8(w->hi2 + cq + 16);
                int32x4_t bias = vld1q_s32(w->bias2 + at);
                float32x4_t step = vld1q_f32(w->steps2 + at);
                for (int p = 0; p < 2; p++) {
                    uint8x16_t a = vld1q_u8(c + 256 * s + 64 * (2 * p) + 16 * j);
                    uint8x16_t b = vld1q_u8(c + 256 * s + 64 * (2 * p + 1) + 16 * j);
                    uint8x16_t al = vandq_u8(a, nib), ah = vshrq_n_u8(a, 4), bl = vandq_u8(b, nib), bh = vshrq_n_u8(b, 4);
                    int32x4_t acc = vmmlaq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(zip_lo(al, bl)), e0);
                    acc = vmmlaq_s32(acc, vreinterpretq_s8_u8(zip_hi(al, bl)), e1);
                    acc = vmmlaq_s32(acc, vreinterpretq_s8_u8(zip_lo(ah, bh)), o0);
                    acc = vmmlaq_s32(acc, vreinterpretq_s8_u8(zip_hi(ah, bh)), o1);
                    f[p][j] = fold(f[p][j], acc, bias, sc[p][j], step);
                }
            }
        }
    }
    float mins[2][4];
    for (int m = 0; m < 2; m++) vst1q_f32(mins[m], finish4(low[m]));
    for (int p = 0; p < 2; p++) {
        float v[4];
        vst1q_f32(v, vaddq_f32(vaddq_f32(f[p][0], f[p][1]), vaddq_f32(f[p][2], f[p][3])));
        float *y0 = y + r0 * n + 2 * p, *y1 = y0 + n;
        y0[0] = v[0] + mins[0][2 * p], y1[0] = v[1] + mins[1][2 * p];
        y0[1] = v[2] + mins[0][2 * p + 1], y1[1] = v[3] + mins[1][2 * p + 1];
    }
}

/* MatMul8: row pairs pp..pp+RP-1 of a group; a unit's block j into s[(2u + j) % 4] */
MM_INLINE void pairs8(const qrows *x, const uint8_t *c, const float *s, int64_t pp, const int RP, float *y,
                      int64_t n, int64_t units) {
    const rows_i8mm *w = (const rows_i8mm *)x->own;
    float32x4_t f[2][2][4];
    for (int q = 0; q < RP; q++)
        for (int p = 0; p < 2; p++)
            for (int j = 0; j < 4; j++) f[q][p][j] = vdupq_n_f32(0.0f);
    for (int64_t u = 0; u < units; u++, c += MM_GROUP * MM8_UNIT, s += 2 * MM_GROUP) {
        for (int l = 0; l < MM_GROUP; l++) MM_PREFETCH(c + MM8_AHEAD * MM_GROUP * MM8_UNIT + 64 * l);
        float32x4_t sc[2][2]; /* column pair p, block j: [a_j a_j b_j b_j] */
        for (int p = 0; p < 2; p++) {
            float32x4_t ab = vcombine_f32(vld1_f32(s + 2 * (2 * p)), vld1_f32(s + 2 * (2 * p + 1)));
            sc[p][0] = vtrn1q_f32(ab, ab), sc[p][1] = vtrn2q_f32(ab, ab);
        }
        for (int j = 0; j < 2; j++) {
            int slot = (int)((2 * u + j) % 4);
            uint8x16_t cc[2][4];
            for (int p = 0; p < 2; p++)
                for (int h = 0; h < 2; h++) {
                    uint8x16_t a = vld1q_u8(c + MM8_UNIT * (2 * p) + MM8_BLOCK * j + 16 * h);
                    uint8x16_t b = vld1q_u8(c + MM8_UNIT * (2 * p + 1) + MM8_BLOCK * j + 16 * h);
                    cc[p][2 * h] = zip_lo(a, b), cc[p][2 * h + 1] = zip_hi(a, b);
                }
            for (int q = 0; q < RP; q++) {
                int64_t pair = pp + q, at = (pair * x->lanes + 2 * u + j) * 4;
                const int8_t *xv = w->lo2 + 2 * (pair * x->width + MM8_UNIT * u + MM8_BLOCK * j);
                int8x16_t xs[4] = {vld1q_s8(xv), vld1q_s8(xv + 16), vld1q_s8(xv + 32), vld1q_s8(xv + 48)};
                int32x4_t bias = vld1q_s32(w->bias2 + at);
                float32x4_t step = vld1q_f32(w->steps2 + at);
                for (int p = 0; p < 2; p++) {
                    int32x4_t acc = vdupq_n_s32(0);
                    for (int i = 0; i < 4; i++) acc = vusmmlaq_s32(acc, cc[p][i], xs[i]);
                    f[q][p][slot] = fold(f[q][p][slot], acc, bias, sc[p][j], step);
                }
            }
        }
    }
    for (int q = 0; q < RP; q++)
        for (int p = 0; p < 2; p++)
            finish_pair(f[q][p], y + 2 * (pp + q) * n + 2 * p, y + (2 * (pp + q) + 1) * n + 2 * p);
}

/* rows in twos and fours by the matrix products (MatMul4K: twos), a lone last row by SDOT;
 * MatMul6 by SDOT: its 6-bit codes come out of their stream in phases (unpack6), and pairing two
 * columns' blocks from those took more zips than the matrix products saved (measured: 1.53
 * instructions a weight byte at two rows, SDOT 0.91) */
static void matmul_i8mm(const mm_job *p) {
    if (p->kind == MM6) {
        matmul_dot(p);
        return;
    }
    const qrows *x = p->x;
    int64_t pairs = p->rows / 2;
    for (int64_t g = p->g0; g < p->g1; g++) {
        const uint8_t *c = p->codes + g * p->units * p->unit_bytes;
        float *y = p->y + g * MM_GROUP;
        for (int64_t pp = 0; pp < pairs;) {
            int two = pp + 2 <= pairs && (p->kind == MM4 || p->kind == MM8);
            if (p->kind == MM4) {
                const float *s = (const float *)p->scales + g * p->units * 16;
                if (two) pairs4(x, c, s, pp, 2, y, p->n, p->units);
                else pairs4(x, c, s, pp, 1, y, p->n, p->units);
            } else if (p->kind == MM8) {
                const float *s = (const float *)p->scales + g * p->units * 2 * MM_GROUP;
                if (two) pairs8(x, c, s, pp, 2, y, p->n, p->units);
                else pairs8(x, c, s, pp, 1, y, p->n, p->units);
            } else {
                pairs4k(x, c, (const uint8_t *)p->scales + g * p->units * 64, (const uint16_t *)p->base + g * p->units * 8,
                        pp, y, p->n, p->units);
            }
            pp += two ? 2 : 1;
        }
        if (p->rows % 2) ARM_KIND_TILE(p, g, p->rows - 1, 1);
    }
}

#define ATTEND_SPECIALIZE 1
#include "attend_float.h"
#include "i8_dot.h"
#include "attend_i8.h"
#include "norm.h"

const kpath kpath_i8mm = {
    .name = "i8mm",
    .needs = FEAT_DOTPROD | FEAT_I8MM,
    .matmul = {matmul_i8mm, matmul_i8mm, matmul_i8mm, matmul_i8mm},
    .prep = {[MM4] = prep, [MM4K] = prep, [MM8] = prep},
    .attend = {attend_f32, attend_f16, attend_i8_kv},
    .norm = norm_rows,
};
