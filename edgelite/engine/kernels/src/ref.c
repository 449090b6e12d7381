/* The reference path: every operator in plain C (the attention in the generic vector type),
 * built with the baseline flags of the machine (x86-64; ARMv8.0, whose baseline has NEON). Its
 * sums are the canonical ones (kernels.h): every other path gives its bits. It runs where a CPU
 * has no vector path for an operator, and it is what the tests compare every path with. */
#include <math.h>
#include <string.h>

#include "kernels.h"

/* ---- products ----------------------------------------------------------------------------- */

/* MatMul4's block b of column r (codes at c: the group's units of 4 columns x 64 bytes) against
 * row `row`: the exact integer sum plus the block's correction */
static int32_t dot4(const qrows *x, const uint8_t *c, int64_t row, int r, int64_t b) {
    const uint8_t *q = c + (b / MM4_STEP) * 256 + 64 * r + 16 * (b % MM4_STEP);
    const int8_t *e = x->lo + row * x->width + 16 * b, *o = x->hi + row * x->width + 16 * b;
    int32_t dot = x->bias[row * x->lanes + b];
    for (int j = 0; j < 16; j++) dot += (q[j] & 15) * e[j] + (q[j] >> 4) * o[j];
    return dot;
}

/* code i (0..255) of a MatMul6 column's super-block (8 codes in 6 bytes, code i at bit 6i) */
static int code6(const uint8_t *c, int64_t i) {
    const uint8_t *g = c + 6 * (i / 8);
    uint64_t v = 0;
    for (int j = 0; j < 6; j++) v |= (uint64_t)g[j] << (8 * j);
    return (int)((v >> (6 * (i % 8))) & 63);
}

static void group4(const qrows *x, const uint8_t *c, const float *s, int64_t row, float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float sum[4] = {0};
        for (int64_t b = 0; b < x->blocks; b++) {
            float scale = s[(b / MM4_STEP) * 16 + 4 * r + b % MM4_STEP];
            sum[b % 4] = fmaf((float)dot4(x, c, row, r, b), scale * x->steps[row * x->lanes + b], sum[b % 4]);
        }
        y[row * n + r] = mm_sum4(sum);
    }
}

static void group6(const qrows *x, const uint8_t *c, const int8_t *mult, const float *base, int64_t row, float *y,
                   int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float sum[4] = {0};
        for (int64_t b = 0; b < x->blocks; b++) {
            int64_t at = (b / 16) * MM_GROUP + r;
            const int8_t *xq = x->lo + row * x->width + b * MM6_BLOCK;
            int32_t dot = x->bias[row * x->lanes + b];
            for (int j = 0; j < MM6_BLOCK; j++) dot += code6(c + at * MM6_BYTES, (b % 16) * MM6_BLOCK + j) * xq[j];
            float scale = (float)mult[at * 16 + b % 16] * base[at];
            sum[b % 4] = fmaf((float)dot, scale * x->steps[row * x->lanes + b], sum[b % 4]);
        }
        y[row * n + r] = mm_sum4(sum);
    }
}

static void group8(const qrows *x, const uint8_t *c, const float *s, int64_t row, float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float sum[4] = {0};
        for (int64_t b = 0; b < x->blocks; b++) {
            const uint8_t *q = c + (b / 2) * MM_GROUP * MM8_UNIT + MM8_UNIT * r + MM8_BLOCK * (b % 2);
            const int8_t *xq = x->lo + row * x->width + b * MM8_BLOCK;
            int32_t dot = x->bias[row * x->lanes + b];
            for (int j = 0; j < MM8_BLOCK; j++) dot += q[j] * xq[j];
            float scale = s[(b / 2) * 2 * MM_GROUP + 2 * r + b % 2];
            sum[b % 4] = fmaf((float)dot, scale * x->steps[row * x->lanes + b], sum[b % 4]);
        }
        y[row * n + r] = mm_sum4(sum);
    }
}

/* MatMul4K: block b's scale d sc and minimum coefficient 8 d sc + e m (low), from the
 * super-block's multiples (mult) and float16 d and e (halves) of column r */
static void group4k(const qrows *x, const uint8_t *c, const uint8_t *mult, const uint16_t *halves, int64_t row,
                    float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float sum[4] = {0}, low[4] = {0};
        for (int64_t b = 0; b < x->blocks; b++) {
            int64_t sb = b / 8;
            float scale = (float)mult[sb * 64 + 8 * r + b % 8] * half_value(halves[sb * 8 + r]);
            float coef = fmaf(scale, MM4K_SHIFT, (float)mult[sb * 64 + 32 + 8 * r + b % 8] * half_value(halves[sb * 8 + 4 + r]));
            sum[b % 4] = fmaf((float)dot4(x, c, row, r, b), scale * x->steps[row * x->lanes + b], sum[b % 4]);
            low[b % 4] = fmaf(coef, x->sums[row * x->sum_width + MM4K_SUMS * sb + b % 8], low[b % 4]);
        }
        y[row * n + r] = mm_sum4(sum) + mm_sum4(low);
    }
}

static void matmul_ref(const mm_job *p) {
    const qrows *x = p->x;
    for (int64_t g = p->g0; g < p->g1; g++) {
        const uint8_t *c = p->codes + g * p->units * p->unit_bytes;
        float *y = p->y + g * MM_GROUP;
        for (int64_t r = 0; r < p->rows; r++) {
            if (p->kind == MM4) group4(x, c, (const float *)p->scales + g * p->units * 16, r, y, p->n);
            else if (p->kind == MM8) group8(x, c, (const float *)p->scales + g * p->units * 2 * MM_GROUP, r, y, p->n);
            else if (p->kind == MM4K)
                group4k(x, c, (const uint8_t *)p->scales + g * p->units * 64, (const uint16_t *)p->base + g * p->units * 8,
                        r, y, p->n);
            else group6(x, c, (const int8_t *)p->scales + g * p->units * MM_GROUP * 16,
                        (const float *)p->base + g * p->units * MM_GROUP, r, y, p->n);
        }
    }
}

/* ---- attention ---------------------------------------------------------------------------- */
#include "attend_float.h"

/* the int8 attention's vector hooks: none here (the plain loops run every block) */
KINLINE int i8v_ok(int64_t g, int64_t d) { (void)g, (void)d; return 0; }
KINLINE void i8v_queries(const int16_t *i16, int64_t count, int64_t d, void *vs) { (void)i16, (void)count, (void)d, (void)vs; }
KINLINE void i8v_keys(const void *keys, int64_t b, int64_t d, void *vs) { (void)keys, (void)b, (void)d, (void)vs; }
KINLINE void i8v_scores(void *vs, const int16_t *i16, int64_t r, const float *qstep, int64_t g, const void *keys,
                        int64_t b, int64_t d, const float *kstep, float *sh, int64_t span) {
    (void)vs, (void)i16, (void)r, (void)qstep, (void)g, (void)keys, (void)b, (void)d, (void)kstep, (void)sh, (void)span;
}
KINLINE void i8v_scores_row(void *vs, const int16_t *i16, const float *qstep, int64_t g, const void *keys, int64_t b,
                            int64_t d, const float *kstep, float *sh, int64_t span) {
    i8v_scores(vs, i16, 0, qstep, g, keys, b, d, kstep, sh, span);
}
KINLINE void i8v_values(const void *values, int64_t b, int64_t d, void *vs) { (void)values, (void)b, (void)d, (void)vs; }
KINLINE void i8v_sums(void *vs, const float *p, const float *vstep, const void *values, int64_t b, int64_t d, float *o) {
    (void)vs, (void)p, (void)vstep, (void)values, (void)b, (void)d, (void)o;
}
KINLINE void i8v_sums_row(void *vs, const float *p, int64_t span, int64_t g, const float *vstep, const void *values,
                          int64_t b, int64_t d, float *o) {
    (void)vs, (void)p, (void)span, (void)g, (void)vstep, (void)values, (void)b, (void)d, (void)o;
}
KINLINE const int *i8v_order(void) { return NULL; }
KINLINE void i8v_steps(const void *plane, int64_t b, int64_t d, float *step) {
    for (int64_t jj = 0; jj < BLOCK; jj++) step[jj] = row_step(plane, b + jj, d);
}
#include "attend_i8.h"
#include "norm.h"

const kpath kpath_ref = {
    .name = "ref",
    .needs = 0,
    .matmul = {matmul_ref, matmul_ref, matmul_ref, matmul_ref},
    .attend = {attend_f32, attend_f16, attend_i8_kv},
    .norm = norm_rows,
};
