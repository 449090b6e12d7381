/* Attention over an int8 KV (Attend8), in integers: a row's queries and its softmax weights
 * become 8-bit codes with a step of their own (the largest magnitude / Q_MAX or W_MAX), and the
 * KV's int8 codes meet them in exact int32 dot products; only the steps are float. Integer sums
 * are the same in any order, so a row comes out bit for bit the same in any tile or chunking,
 * and with or without a unit's vector code. Defines attend_i8_kv (attend_fn).
 *
 * The including unit defines its vector code for the blocks a row covers whole, as these
 * functions (the reference's take nothing: i8v_ok is 0):
 *   i8v_ok(g, d)                  whether they take this group and head size
 *   i8v_queries(i16, count, d, vs)  the queries' codes (count rows of d) as they want them
 *   i8v_keys(keys, b, d, vs)      block b's keys prepared (a tile of several rows)
 *   i8v_scores(vs, i16, r, qstep, g, keys, b, d, kstep, sh, span)  row r's g heads' scores
 *                                 over block b (head h's at sh + h * span, from position b)
 *   i8v_scores_row(...)           the same for a lone row (a decode step: nothing prepared)
 *   i8v_values(values, b, d, vs)  block b's values prepared (a tile of several rows)
 *   i8v_sums(vs, p, vstep, values, b, d, o)  o += one head's weights p . the block's values
 *   i8v_sums_row(vs, p, span, g, vstep, values, b, d, o)  the same, every head of a lone row
 *   i8v_order()                   where o's columns are within each 64 (NULL: in order)
 *   i8v_steps(plane, b, d, step)  the 32 rows' steps of block b
 * vs: the unit's scratch (buf, 64-byte aligned). */
#ifndef EDGELITE_ATTEND_I8_H
#define EDGELITE_ATTEND_I8_H

#include "attend_common.h"

/* x[0..n) as codes round(x / step) (to even), step = largest |x| / top_code; returns the
 * step (0: all zero) */
KINLINE float codes(const float *x, int64_t n, float top_code, int16_t *out) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    if (!(top > 0.0f)) {
        memset(out, 0, (size_t)n * sizeof(int16_t));
        return 0.0f;
    }
    float inv = top_code / top;
    for (int64_t i = 0; i < n; i++) out[i] = (int16_t)nearbyintf(x[i] * inv);
    return top / top_code;
}

/* the scores of positions lo..hi (row j at keys + j * row): the query's codes . the key's
 * codes, times qstep times the key's step (kstep: from position b) */
KINLINE void qk_plain(const int16_t *qc, float qstep, const void *keys, int64_t d, int64_t b, int64_t lo, int64_t hi,
                      const float *kstep, float *sh /* (position b) */) {
    for (int64_t j = lo; j <= hi; j++) {
        const int8_t *k = (const int8_t *)keys + j * (d + 2);
        int32_t dot = 0;
        for (int64_t i = 0; i < d; i++) dot += (int32_t)qc[i] * k[i];
        sh[j - b] = (float)dot * (qstep * kstep[j - b]);
    }
}

/* one block's weights (p: softmax weights from position b, vstep: the value rows' steps)
 * over positions lo..hi, as codes 0..W_MAX (wq, BLOCK of them: 0 outside); returns their step */
KINLINE float weights(const float *p, const float *vstep, int64_t b, int64_t lo, int64_t hi, int16_t *wq) {
    float w[BLOCK];
    for (int64_t jj = 0; jj < BLOCK; jj++) w[jj] = b + jj >= lo && b + jj <= hi ? p[jj] * vstep[jj] : 0.0f;
    return codes(w, BLOCK, W_MAX, wq);
}

/* o += (sum over positions lo..hi of wq x the value's codes) x wstep (column i at o[i], or
 * with `slot`, at o[i - i % 64 + slot[i % 64]]: a unit's own order) */
KINLINE void pv_plain(const int16_t *wq, float wstep, const void *values, int64_t d, int64_t b, int64_t lo, int64_t hi,
                      const int *slot, float *o) {
    int32_t acc[MAX_D] = {0};
    for (int64_t j = lo; j <= hi; j++) {
        const int8_t *v = (const int8_t *)values + j * (d + 2);
        for (int64_t i = 0; i < d; i++) acc[i] += (int32_t)wq[j - b] * v[i];
    }
    for (int64_t i = 0; i < d; i++) {
        int64_t at = slot ? i - i % 64 + slot[i % 64] : i;
        o[at] = fmaf((float)acc[i], wstep, o[at]);
    }
}

/* the steps of block b's rows first..end (from position b; 0 for the others) */
KINLINE void steps_of(const void *plane, int64_t b, int64_t first, int64_t end, int64_t d, float *step) {
    if (first == b && end == b + BLOCK - 1) {
        i8v_steps(plane, b, d, step);
        return;
    }
    for (int64_t jj = 0; jj < BLOCK; jj++) step[jj] = b + jj >= first && b + jj <= end ? row_step(plane, b + jj, d) : 0.0f;
}

/* the int8 tile: rows x g queries (scaled) against one KV head, as attend_tile.
 * i16: rows x g x d int16 scratch; steps: rows x g floats; buf: BLOCK x d + rows x g x d floats */
KINLINE void attend_i8(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                       int64_t window, int64_t g, int64_t d, float *scores, float *buf, float *out, int16_t *i16,
                       float *steps) {
    int64_t lo0 = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    int64_t last = pos0 + rows - 1, span = last - lo0 + 1;
    float kstep[BLOCK];
    int16_t wq[BLOCK] __attribute__((aligned(64)));
    void *vs = (void *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    int vec = i8v_ok(g, d);
#define LO(r) (window > 0 && pos0 + (r) - window + 1 > 0 ? pos0 + (r) - window + 1 : 0)
#define WHOLE(r) (LO(r) <= b && pos0 + (r) >= b + BLOCK - 1) /* row r takes every position of block b */
    prefetch_rows(keys, lo0, lo0 - lo0 % BLOCK + AHEAD * BLOCK - 1, last, d + 2);
    for (int64_t r = 0; r < rows * g; r++) steps[r] = codes(q + r * d, d, Q_MAX, i16 + r * d);
    if (vec) i8v_queries(i16, rows * g, d, vs);
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        int whole = 0;
        for (int64_t r = 0; r < rows; r++) whole |= WHOLE(r);
        prefetch_rows(keys, b + AHEAD * BLOCK, b + (AHEAD + 1) * BLOCK - 1, last, d + 2);
        steps_of(keys, b, first, end, d, kstep);
        if (vec && rows == 1 && WHOLE(0)) {
            i8v_scores_row(vs, i16, steps, g, keys, b, d, kstep, scores + (b - lo0), span);
            continue;
        }
        if (vec && whole) i8v_keys(keys, b, d, vs);
        for (int64_t r = 0; r < rows; r++) {
            int64_t lo = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
            if (vec && WHOLE(r)) { /* (a whole block lies within the row's scores) */
                i8v_scores(vs, i16, r, steps + r * g, g, keys, b, d, kstep, scores + r * g * span + (b - lo0), span);
                continue;
            }
            for (int64_t h = 0; h < g && lo <= hi; h++)
                qk_plain(i16 + (r * g + h) * d, steps[r * g + h], keys, d, b, lo, hi, kstep,
                         scores + (r * g + h) * span + (b - lo0));
        }
    }
    prefetch_rows(values, lo0, lo0 - lo0 % BLOCK + AHEAD * BLOCK - 1, last, d + 2);
    /* e^(score - largest), each row's sum kept: the weights' codes are the same whatever their
     * scale, so the sum divides the output once at the end */
    float *sums = steps; /* (the queries' steps are no longer needed) */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < g; h++)
            sums[r * g + h] = exps_ways(scores + (r * g + h) * span + LO(r) - lo0, pos0 + r - LO(r) + 1, 2);
    memset(out, 0, (size_t)(rows * g * d) * sizeof(float));
    const int *order = vec ? i8v_order() : NULL;
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        prefetch_rows(values, b + AHEAD * BLOCK, b + (AHEAD + 1) * BLOCK - 1, last, d + 2);
        steps_of(values, b, first, end, d, kstep);
        int whole = 0;
        for (int64_t r = 0; r < rows; r++) whole |= WHOLE(r);
        if (vec && rows == 1 && WHOLE(0)) {
            i8v_sums_row(vs, scores + (b - lo0), span, g, kstep, values, b, d, out);
            continue;
        }
        if (vec && whole) i8v_values(values, b, d, vs);
        for (int64_t r = 0; r < rows; r++) {
            int64_t lo = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
            for (int64_t h = 0; h < g && lo <= hi; h++) {
                /* (a row's scores from position LO(r); b - lo0 may point before them: read lo..hi only) */
                const float *p = scores + (r * g + h) * span + (b - lo0);
                float *o = out + (r * g + h) * d;
                if (vec && WHOLE(r)) {
                    i8v_sums(vs, p, kstep, values, b, d, o);
                    continue;
                }
                float wstep = weights(p, kstep, b, lo, hi, wq);
                if (wstep != 0.0f) pv_plain(wq, wstep, values, d, b, lo, hi, order, o);
            }
        }
    }
    for (int64_t r = 0; r < rows * g; r++) {
        float *o = out + r * d, inv = 1.0f / sums[r];
        if (order) /* (the unit's column order back to the columns') */
            for (int64_t c = 0; c < d; c += 64) {
                float t[64];
                memcpy(t, o + c, sizeof(t));
                for (int i = 0; i < 64; i++) o[c + i] = t[order[i]];
            }
        for (int64_t i = 0; i < d; i++) o[i] *= inv;
    }
#undef WHOLE
#undef LO
}

/* attend_i8 compiled for one group size and head size (constants: its loops unrolled, its
 * running sums in registers; measured, a third faster than with them read at run time), or for
 * any */
#define I8_FN(NAME, G, D)                                                                          \
    static __attribute__((noinline)) void NAME(const float *q, const void *keys, const void *values, \
                                               int64_t pos0, int64_t rows, int64_t window, int64_t g, \
                                               int64_t d, float *scores, float *buf, float *out,     \
                                               int16_t *i16, float *steps) {                          \
        (void)g, (void)d; /* (G and D where constants) */                                          \
        attend_i8(q, keys, values, pos0, rows, window, G, D, scores, buf, out, i16, steps);         \
    }
I8_FN(attend_i8_any, g, d)
#ifdef ATTEND_SPECIALIZE
I8_FN(attend_i8_g1, 1, 64)
I8_FN(attend_i8_g2, 2, 64)
I8_FN(attend_i8_g3, 3, 64)
I8_FN(attend_i8_g4, 4, 64)
I8_FN(attend_i8_g5, 5, 64)
I8_FN(attend_i8_g6, 6, 64)
I8_FN(attend_i8_g7, 7, 64)
I8_FN(attend_i8_g8, 8, 64)
static void (*const attend_i8_d64[9])(const float *, const void *, const void *, int64_t, int64_t, int64_t, int64_t,
                                      int64_t, float *, float *, float *, int16_t *, float *) = {
    attend_i8_any, attend_i8_g1, attend_i8_g2, attend_i8_g3, attend_i8_g4, attend_i8_g5, attend_i8_g6, attend_i8_g7,
    attend_i8_g8};
#endif

static void attend_i8_kv(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                         int64_t window, int64_t g, int64_t d, float *scores, float *buf, float *out, int16_t *i16,
                         float *steps) {
#ifdef ATTEND_SPECIALIZE
    if (d == 64 && g <= 8) {
        attend_i8_d64[g](q, keys, values, pos0, rows, window, g, d, scores, buf, out, i16, steps);
        return;
    }
#endif
    attend_i8_any(q, keys, values, pos0, rows, window, g, d, scores, buf, out, i16, steps);
}

#endif
