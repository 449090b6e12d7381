/* Attention over a float32 or float16 KV (Attend, Attend16): a tile of query rows against one
 * KV head, in the generic vector type (simd.h), compiled by each unit that runs it with its own
 * flags. Defines attend_f32 and attend_f16 (attend_fn).
 *
 * Each row attends to its own causal window only and is computed by the same sequence of
 * float operations whatever the tile holds (fixed-lane dot products, sums in position order),
 * so a row comes out bit for bit the same in any chunking, and on every ISA (the same source,
 * -ffp-contract=off, fused multiply-adds written as VFMA). The rows of a step go in tiles that
 * read each KV position once per tile and KV head (the group's query heads share the read):
 * a decode step reads the valid KV once, a prompt chunk once a tile.
 *
 * ATTEND_SPECIALIZE (the vector units): each group size of 1-8 and a decode row compiled on
 * its own (constants: loops unrolled, running sums in registers); the reference compiles the
 * same functions once, with the group size read at run time (the same sums, a shorter build). */
#ifndef EDGELITE_ATTEND_FLOAT_H
#define EDGELITE_ATTEND_FLOAT_H

#include "attend_common.h"

/* rows first..first+count-1 of one KV head's plane (float32 or float16) as float32: in place
 * for a float32 KV, else widened into buf */
KINLINE const float *rows_f32(const void *plane, int64_t first, int64_t count, int64_t d, int kind, float *buf) {
    if (kind == KV_F32) return (const float *)plane + first * d;
    widen_n((const uint16_t *)plane + first * d, buf, count * d);
    return buf;
}

/* q . k over d values (a multiple of LANES) */
KINLINE float dot(const float *q, const float *k, int64_t d) {
    vf acc = splat(0.0f);
    for (int64_t i = 0; i < d; i += LANES) acc = VFMA(load(q + i), load(k + i), acc);
    return lanes_sum(acc);
}

/* q . (the KV plane's row j of d values) */
KINLINE float dot_kv(const float *q, const void *plane, int64_t j, int64_t d, int kind) {
    vf acc = splat(0.0f);
    for (int64_t i = 0; i < d; i += LANES) acc = VFMA(load(q + i), load_kv(plane, j * d + i, kind), acc);
    return lanes_sum(acc);
}

/* a tile of rows (consecutive positions pos0..pos0+rows-1) against one KV head: each row r
 * attends to its own positions lo_r..pos_r (lo_r: its window's start, else 0). q: rows x g x d
 * (scaled) -> out: rows x g x d. Every KV block (BLOCK positions from a multiple of BLOCK) is
 * read, and widened, once for all the tile's rows. A row's result does not depend on the tile
 * it is in: its dot products are taken 8 positions at a time over whole groups aligned to
 * multiples of 8 and one by one at its range's ragged ends (both are the same sums), its
 * softmax runs over its own range, and its values are summed in position order.
 * scores: rows x g x span scratch (span: the tile's positions), buf: BLOCK x d scratch.
 * (For groups of 1-8 heads and head sizes in multiples of 32: attend_tile_g.) */
KINLINE void attend_tile(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                         int64_t window, int64_t g, int64_t d, int kind, float *scores, float *buf, float *out) {
    int64_t lo0 = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    int64_t last = pos0 + rows - 1, span = last - lo0 + 1;
#define LO(r) (window > 0 && pos0 + (r) - window + 1 > 0 ? pos0 + (r) - window + 1 : 0)
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        const float *k = rows_f32(keys, first, end - first + 1, d, kind, buf); /* (position first) */
        for (int64_t r = 0; r < rows; r++) {
            int64_t lo = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
            for (int64_t h = 0; h < g; h++) {
                const float *qh = q + (r * g + h) * d;
                float *sh = scores + (r * g + h) * span; /* (position lo0) */
                int64_t j = lo;
                for (; j <= hi && j % LANES; j++) sh[j - lo0] = dot(qh, k + (j - first) * d, d);
                for (; j + LANES - 1 <= hi; j += LANES) { /* LANES positions' dot products at once */
                    vf acc[LANES];
                    for (int l = 0; l < LANES; l++) acc[l] = splat(0.0f);
                    for (int64_t i = 0; i < d; i += LANES) {
                        vf qi = load(qh + i);
                        for (int l = 0; l < LANES; l++) acc[l] = VFMA(qi, load(k + (j - first + l) * d + i), acc[l]);
                    }
                    store(sh + j - lo0, lanes_sum8(acc));
                }
                for (; j <= hi; j++) sh[j - lo0] = dot(qh, k + (j - first) * d, d);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < g; h++)
            softmax(scores + (r * g + h) * span + LO(r) - lo0, pos0 + r - LO(r) + 1);
    memset(out, 0, (size_t)(rows * g * d) * sizeof(float));
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        const float *v = rows_f32(values, first, end - first + 1, d, kind, buf);
        for (int64_t r = 0; r < rows; r++) {
            int64_t lo = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
            for (int64_t h = 0; h < g && lo <= hi; h++) {
                const float *p = scores + (r * g + h) * span; /* (position lo0) */
                float *o = out + (r * g + h) * d;
                vf acc[MAX_D / LANES];
                for (int64_t i = 0; i < d / LANES; i++) acc[i] = load(o + i * LANES);
                for (int64_t j = lo; j <= hi; j++) {
                    vf pj = splat(p[j - lo0]);
                    for (int64_t i = 0; i < d / LANES; i++) acc[i] = VFMA(pj, load(v + (j - first) * d + i * LANES), acc[i]);
                }
                for (int64_t i = 0; i < d / LANES; i++) store(o + i * LANES, acc[i]);
            }
        }
    }
#undef LO
}

/* attend_tile for a group of G query heads a KV head (a constant where specialized) and d a
 * multiple of 4 LANES: the same results by the same sums, from fewer loads. Keys and values
 * are read (and widened) straight from the KV, once per position for all G heads: QGROUP
 * positions' dot products with every head at once (G x QGROUP running sums in registers), and
 * each value row's slices added to every head's output at once. */
#define QGROUP 4
#define VSLICE 4
/* heads whose value sums a float32 KV's row takes at once: with 32 vector registers (AVX-512)
 * all of a group's, else two (16 registers hold 2 heads' sums, the rows and a weight, not
 * more: measured on AVX2 at G = 3, one sum kept in memory made each position wait on a
 * store); which heads go together does not change any head's sums */
#if defined(__AVX512F__)
#define PV_AT_ONCE 8
#else
#define PV_AT_ONCE 2
#endif

/* a row's value sums for HN heads (weights pr, head h's at pr + h * span from position lo0)
 * over positions lo..hi, columns c..c + VSLICE * LANES - 1 of o (head h's row at o + h * d),
 * each column's sum position by position (the float32 KV's order) */
KINLINE void pv_heads(const int HN, const float *pr, int64_t span, int64_t lo0, const void *values, int64_t row,
                      int64_t lo, int64_t hi, int64_t c, int kind, float *o, int64_t d) {
    vf acc[8][VSLICE];
    for (int h = 0; h < HN; h++)
        for (int v = 0; v < VSLICE; v++) acc[h][v] = load(o + h * d + c + v * LANES);
    for (int64_t j = lo; j <= hi; j++) {
        vf x[VSLICE];
        for (int v = 0; v < VSLICE; v++) x[v] = load_kv(values, j * row + c + v * LANES, kind);
        for (int h = 0; h < HN; h++) {
            vf p = splat(pr[h * span + j - lo0]);
            for (int v = 0; v < VSLICE; v++) acc[h][v] = VFMA(p, x[v], acc[h][v]);
        }
    }
    for (int h = 0; h < HN; h++)
        for (int v = 0; v < VSLICE; v++) store(o + h * d + c + v * LANES, acc[h][v]);
}

/* a row's value sums from a float16 KV (its order): pv_heads for HN heads over columns c..c +
 * PSLICE * LANES - 1, with the even and the odd positions in sums of their own, the odd ones
 * added to the even ones at the end. Each sum then waits on the one two positions back (one
 * position back, the adds' latency decided the time), and 3 heads fit 16 registers (measured
 * on AVX2 at G = 3: float16 decode attention 8-9 % faster; the float32 KV's stays with
 * pv_heads, slower this way). A row's sums are the same in any tile: blocks and parities are
 * fixed by the positions. */
#define PSLICE 2
KINLINE void pv_pairs(const int HN, const float *pr, int64_t span, int64_t lo0, const void *values, int64_t row,
                      int64_t lo, int64_t hi, int64_t c, int kind, float *o, int64_t d) {
    vf acc[2][3][PSLICE];
    for (int h = 0; h < HN; h++)
        for (int v = 0; v < PSLICE; v++) {
            acc[0][h][v] = load(o + h * d + c + v * LANES);
            acc[1][h][v] = splat(0.0f);
        }
#define PV_AT(P, J)                                                                                \
    do {                                                                                           \
        vf x[PSLICE];                                                                              \
        for (int v = 0; v < PSLICE; v++) x[v] = load_kv(values, (J) * row + c + v * LANES, kind);  \
        for (int h = 0; h < HN; h++) {                                                             \
            vf p = splat(pr[h * span + (J) - lo0]);                                                \
            for (int v = 0; v < PSLICE; v++) acc[P][h][v] = VFMA(p, x[v], acc[P][h][v]);           \
        }                                                                                          \
    } while (0)
    int64_t j = lo;
    if (j <= hi && j % 2) {
        PV_AT(1, j);
        j++;
    }
    for (; j + 1 <= hi; j += 2) {
        PV_AT(0, j);
        PV_AT(1, j + 1);
    }
    if (j <= hi) PV_AT(0, j);
#undef PV_AT
    for (int h = 0; h < HN; h++)
        for (int v = 0; v < PSLICE; v++) store(o + h * d + c + v * LANES, acc[0][h][v] + acc[1][h][v]);
}

/* a row's value sums of its G heads over one block's positions lo..hi, in its KV's order */
KINLINE void pv_row(const int G, const float *pr, int64_t span, int64_t lo0, const void *values, int64_t row,
                    int64_t lo, int64_t hi, int kind, float *o, int64_t d) {
    if (kind == KV_F16) {
        for (int64_t c = 0; c < d; c += PSLICE * LANES) {
            int h0 = 0;
            for (; h0 + 3 <= G; h0 += 3) pv_pairs(3, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
            for (; h0 + 2 <= G; h0 += 2) pv_pairs(2, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
            if (h0 < G) pv_pairs(1, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
        }
        return;
    }
    for (int64_t c = 0; c < d; c += VSLICE * LANES) {
        int h0 = 0;
        if (PV_AT_ONCE >= 8) {
            pv_heads(G, pr, span, lo0, values, row, lo, hi, c, kind, o, d);
            continue;
        }
        for (; h0 + 2 <= G; h0 += 2) pv_heads(2, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
        if (h0 < G) pv_heads(1, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
    }
}

KINLINE void attend_tile_g(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                           int64_t window, const int G, int64_t d, int kind, float *scores, float *out) {
    int64_t row = d; /* a position's values in the plane */
    int64_t lo0 = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    int64_t last = pos0 + rows - 1, span = last - lo0 + 1;
#define LO(r) (window > 0 && pos0 + (r) - window + 1 > 0 ? pos0 + (r) - window + 1 : 0)
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        for (int64_t r = 0; r < rows; r++) {
            int64_t j = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
            const float *qr = q + r * G * d;
            float *sr = scores + r * G * span; /* (position lo0) */
            for (; j + QGROUP - 1 <= hi; j += QGROUP) {
                vf acc[8][QGROUP];
                for (int h = 0; h < G; h++)
                    for (int l = 0; l < QGROUP; l++) acc[h][l] = splat(0.0f);
                for (int64_t i = 0; i < d; i += LANES) {
                    vf k[QGROUP];
                    for (int l = 0; l < QGROUP; l++) k[l] = load_kv(keys, (j + l) * row + i, kind);
                    for (int h = 0; h < G; h++) {
                        vf qi = load(qr + h * d + i);
                        for (int l = 0; l < QGROUP; l++) acc[h][l] = VFMA(qi, k[l], acc[h][l]);
                    }
                }
                for (int h = 0; h < G; h++) lanes_sum4(acc[h], sr + h * span + j - lo0);
            }
            for (; j <= hi; j++)
                for (int h = 0; h < G; h++) sr[h * span + j - lo0] = dot_kv(qr + h * d, keys, j, d, kind);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < G; h++) softmax(scores + (r * G + h) * span + LO(r) - lo0, pos0 + r - LO(r) + 1);
    memset(out, 0, (size_t)(rows * G * d) * sizeof(float));
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        for (int64_t r = 0; r < rows; r++) {
            int64_t lo = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
            if (lo <= hi) pv_row(G, scores + r * G * span, span, lo0, values, row, lo, hi, kind, out + r * G * d, d);
        }
    }
#undef LO
}

#define FLOAT_TILE(KIND) attend_tile(q, keys, values, pos0, rows, window, g, d, KIND, scores, buf, out)
#define FLOAT_GROUP(G, KIND) attend_tile_g(q, keys, values, pos0, rows, window, G, d, KIND, scores, out)
#ifdef ATTEND_SPECIALIZE
#define FLOAT_GROUPS(KIND)                                                                           \
    switch (g) {                                                                                     \
        case 1: FLOAT_GROUP(1, KIND); return;                                                        \
        case 2: FLOAT_GROUP(2, KIND); return;                                                        \
        case 3: FLOAT_GROUP(3, KIND); return;                                                        \
        case 4: FLOAT_GROUP(4, KIND); return;                                                        \
        case 5: FLOAT_GROUP(5, KIND); return;                                                        \
        case 6: FLOAT_GROUP(6, KIND); return;                                                        \
        case 7: FLOAT_GROUP(7, KIND); return;                                                        \
        case 8: FLOAT_GROUP(8, KIND); return;                                                        \
        default: break;                                                                              \
    }
/* a decode row without a window (the common step): attend_tile_g with rows and window
 * constants, in a function of its own (the same sums; on AVX2, with them read at run time, the
 * key loop kept some of the group's sums on the stack) */
#define FLOAT_ROW_FN(NAME, KIND)                                                                     \
    static __attribute__((noinline)) void NAME(const float *q, const void *keys, const void *values, \
                                               int64_t pos0, int64_t g, int64_t d, float *scores, float *out) { \
        const int64_t rows = 1, window = -1;                                                         \
        FLOAT_GROUPS(KIND)                                                                           \
    }
#else
#define FLOAT_GROUPS(KIND)                                                                           \
    if (g >= 1 && g <= 8) {                                                                          \
        FLOAT_GROUP((int)g, KIND);                                                                   \
        return;                                                                                      \
    }
#define FLOAT_ROW_FN(NAME, KIND)                                                                     \
    static void NAME(const float *q, const void *keys, const void *values, int64_t pos0, int64_t g, \
                     int64_t d, float *scores, float *out) {                                         \
        const int64_t rows = 1, window = -1;                                                         \
        FLOAT_GROUPS(KIND)                                                                           \
    }
#endif
FLOAT_ROW_FN(attend_f32_row, KV_F32)
FLOAT_ROW_FN(attend_f16_row, KV_F16)

/* attend_tile_g for this model's group size and head size where it takes them, else
 * attend_tile: one function a KV dtype, each compiled on its own (how one instance is laid out
 * then does not move another's: measured, 40 % on a float16 decode) */
#define FLOAT_HEAD_FN(NAME, ROW, KIND)                                                               \
    static __attribute__((noinline)) void NAME(const float *q, const void *keys, const void *values, \
                                               int64_t pos0, int64_t rows, int64_t window, int64_t g, \
                                               int64_t d, float *scores, float *buf, float *out,     \
                                               int16_t *i16, float *steps) {                         \
        (void)i16, (void)steps;                                                                      \
        if (d % (VSLICE * LANES) == 0) {                                                             \
            if (rows == 1 && window < 0 && g >= 1 && g <= 8) {                                       \
                ROW(q, keys, values, pos0, g, d, scores, out);                                       \
                return;                                                                              \
            }                                                                                        \
            FLOAT_GROUPS(KIND)                                                                       \
        }                                                                                            \
        FLOAT_TILE(KIND);                                                                            \
    }
FLOAT_HEAD_FN(attend_f32, attend_f32_row, KV_F32)
FLOAT_HEAD_FN(attend_f16, attend_f16_row, KV_F16)

#endif
