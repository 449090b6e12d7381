/* What the float and the int8 attention share: e^x for a row's scores, a row's softmax, an
 * int8 row's step, prefetching ahead of a scan. Included by each unit that compiles attention. */
#ifndef EDGELITE_ATTEND_COMMON_H
#define EDGELITE_ATTEND_COMMON_H

#include "simd.h"

/* e^x for x <= 0 (a score less the row's largest), a vector at a time: x = n ln2 + r with
 * |r| <= ln2/2 (ln2 in two parts), e^r by a degree-7 polynomial (Cephes' expf coefficients,
 * by fused multiply-adds), times 2^n built in the exponent bits. Below EXP_FLOOR it is exactly
 * 0: such a weight is lost in a sum of at least 1 anyway, and divided by the sum it would make
 * subnormal floats, which cost the products that meet them a hundred cycles each. */
#define EXP_FLOOR -72.0f /* e^-72 / 2^20 positions is still a normal float */
#define WIDE 16          /* the int8 rows' sums of e^x: lanes (two vectors) */

KINLINE vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

KINLINE vf exp_neg(vf x) {
    vi under = x < splat(EXP_FLOOR);
    x = pick(under, splat(EXP_FLOOR), x);
    vf t = VFMA(x, splat(1.44269504088896341f), splat(0.5f));
    vi n = __builtin_convertvector(t, vi); /* toward zero: one too high where t < 0 */
    n = n + (vi)(__builtin_convertvector(n, vf) > t); /* (true is -1): now floor(t) */
    vf nf = __builtin_convertvector(n, vf);
    vf r = VFMA(nf, splat(-0.693359375f), x);
    r = VFMA(nf, splat(2.12194440e-4f), r);
    vf p = splat(1.9875691500e-4f);
    p = VFMA(p, r, splat(1.3981999507e-3f));
    p = VFMA(p, r, splat(8.3334519073e-3f));
    p = VFMA(p, r, splat(4.1665795894e-2f));
    p = VFMA(p, r, splat(1.6666665459e-1f));
    p = VFMA(p, r, splat(5.0000001201e-1f));
    p = VFMA(p, r * r, r) + splat(1.0f);
    return pick(under, splat(0.0f), p * (vf)((n + 127) << 23));
}

#if defined(__AVX512F__)
/* exp_neg over 16 lanes (the same operations lane by lane: the same bits) */
typedef float wf __attribute__((vector_size(64)));
typedef int32_t wi __attribute__((vector_size(64)));
KINLINE wf wsplat(float x) { return (wf)_mm512_set1_ps(x); }
KINLINE wf WFMA(wf a, wf b, wf c) { return (wf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
KINLINE wf wpick(wi mask, wf yes, wf no) { return (wf)(((wi)yes & mask) | ((wi)no & ~mask)); }
KINLINE wf exp_neg16(wf x) {
    wi under = x < wsplat(EXP_FLOOR);
    x = wpick(under, wsplat(EXP_FLOOR), x);
    wf t = WFMA(x, wsplat(1.44269504088896341f), wsplat(0.5f));
    wi n = __builtin_convertvector(t, wi);
    n = n + (wi)(__builtin_convertvector(n, wf) > t);
    wf nf = __builtin_convertvector(n, wf);
    wf r = WFMA(nf, wsplat(-0.693359375f), x);
    r = WFMA(nf, wsplat(2.12194440e-4f), r);
    wf p = wsplat(1.9875691500e-4f);
    p = WFMA(p, r, wsplat(1.3981999507e-3f));
    p = WFMA(p, r, wsplat(8.3334519073e-3f));
    p = WFMA(p, r, wsplat(4.1665795894e-2f));
    p = WFMA(p, r, wsplat(1.6666665459e-1f));
    p = WFMA(p, r, wsplat(5.0000001201e-1f));
    p = WFMA(p, r * r, r) + wsplat(1.0f);
    return wpick(under, wsplat(0.0f), p * (wf)((n + 127) << 23));
}
#endif

/* e^x in place of each of count scores less their largest, in `ways` sets of LANES lanes
 * (score j in set j / LANES % ways, lane j % LANES); returns their sum, lane by lane in
 * order. ways 1: the float rows (softmax); 2: the int8 rows (their weights become codes) */
KINLINE float exps_ways(float *s, int64_t count, const int ways) {
    const int64_t n = (int64_t)ways * LANES;
    int64_t j = 0;
    vf top[2] = {splat(-INFINITY), splat(-INFINITY)}, sums[2] = {splat(0.0f), splat(0.0f)};
    for (; j + n <= count; j += n)
        for (int h = 0; h < ways; h++) {
            vf x = load(s + j + h * LANES);
            top[h] = pick(x > top[h], x, top[h]);
        }
    float best = -INFINITY;
    for (int h = 0; h < ways; h++)
        for (int l = 0; l < LANES; l++) best = top[h][l] > best ? top[h][l] : best;
    for (; j < count; j++) best = s[j] > best ? s[j] : best;
    vf b = splat(best);
    j = 0;
#if defined(__AVX512F__)
    if (ways == 2) { /* (16 lanes at once: the same sums) */
        wf wsum = wsplat(0.0f), wb = wsplat(best);
        for (; j + n <= count; j += n) {
            wf x;
            memcpy(&x, s + j, sizeof(x));
            wf e = exp_neg16(x - wb);
            memcpy(s + j, &e, sizeof(e));
            wsum += e;
        }
        memcpy(sums, &wsum, sizeof(wsum));
    }
#endif
    for (; j + n <= count; j += n)
        for (int h = 0; h < ways; h++) {
            vf e = exp_neg(load(s + j + h * LANES) - b);
            store(s + j + h * LANES, e);
            sums[h] += e;
        }
    if (j < count) { /* the tail, padded with -inf (weight 0: counted nowhere) */
        float tail[2 * LANES];
        for (int l = 0; l < n; l++) tail[l] = j + l < count ? s[j + l] : -INFINITY;
        for (int h = 0; h < ways; h++) {
            vf e = exp_neg(load(tail + h * LANES) - b);
            for (int l = 0; l < LANES && j + h * LANES + l < count; l++) {
                s[j + h * LANES + l] = e[l];
                sums[h][l] += e[l];
            }
        }
    }
    if (ways == 1) return lanes_sum(sums[0]);
    float total = 0.0f;
    for (int l = 0; l < n; l++) total += sums[l / LANES][l % LANES];
    return total;
}

/* softmax in place over one head's count scores */
KINLINE void softmax(float *s, int64_t count) {
    float inv = 1.0f / exps_ways(s, count, 1);
    for (int64_t j = 0; j < count; j++) s[j] *= inv;
}

/* an int8 row's step: 2^e (1 + (b + 128) / 256) from its two bytes after the d codes */
KINLINE float row_step(const void *plane, int64_t j, int64_t d) {
    const int8_t *row = (const int8_t *)plane + j * (d + 2);
    float m = 1.0f + (float)(row[d + 1] + 128) * (1.0f / 256.0f), p;
    if (row[d] < -126) return ldexpf(m, row[d]); /* (2^e itself would be subnormal) */
    uint32_t bits = (uint32_t)(row[d] + 127) << 23; /* 2^e */
    memcpy(&p, &bits, 4);
    return m * p;
}

/* the int8 KV's codes (measured over the exporter's text, SmolLM2: KL from the fp32 export
 * 1.28e-3 above float32 KV's with 8-bit queries and weights; 0.98e-3 with 16-bit queries;
 * 0.91e-3 with both 16-bit) */
#define Q_MAX 127.0f /* a query code's largest magnitude (int8) */
#define W_MAX 255.0f /* a weight code's largest (uint8) */
#define MAX_GROUP 32 /* query heads a KV head the vector code takes */

/* blocks of int8 positions asked for ahead (measured at 4,000 positions, 30 layers: 136 us a
 * layer with none beyond the hardware's own, 86 with 4 blocks into the second-level cache, 140
 * into the first; for float16 and float32 rows, 4-8 KB a block, any made it slower) */
#define AHEAD 4

/* the lines of rows `first`..`last` (clipped to `end`) of a plane with `row` bytes a row */
KINLINE void prefetch_rows(const void *plane, int64_t first, int64_t last, int64_t end, int64_t row) {
    if (first > end) return;
    last = last < end ? last : end;
    const char *at = (const char *)plane + first * row, *stop = (const char *)plane + (last + 1) * row;
    for (; at < stop; at += 64) PREFETCH(at);
    PREFETCH(stop - 1);
}

#endif
