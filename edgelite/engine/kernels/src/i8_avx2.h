/* The int8 attention's vector code for AVX2 without VNNI (x86_avx2.c): a row's whole blocks
 * with the block's codes widened to int16 once and multiplied in pairs (vpmaddwd: exact int32
 * sums, as the plain loops'), so the row comes out bit for bit as theirs. The hooks
 * attend_i8.h calls are at the end. */
#ifndef EDGELITE_I8_AVX2_H
#define EDGELITE_I8_AVX2_H

#include <immintrin.h>

#include "attend_common.h"


/* lane l: the sum of a[l]'s 8 lanes */
static inline __m256i hsum8(const __m256i *a) {
    __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
    __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
    __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* a whole block's key codes widened to int16 (kw: BLOCK x d) */
static void keys_avx2(const void *keys, int64_t b, int64_t d, int16_t *kw) {
    for (int64_t j = 0; j < BLOCK; j++)
        for (int64_t c = 0; c < d; c += 16)
            _mm256_store_si256((__m256i *)(kw + j * d + c),
                               _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const int8_t *)keys + (b + j) * (d + 2) + c))));
}

/* qk_plain over a whole block (kw: keys_avx2's) for every head of a row's group: i16, g x d
 * query codes; qstep, their steps; sh: head h's scores at sh + h * span (position b) */
KINLINE void qk_avx2(const int16_t *i16, const float *qstep, int64_t g, const int16_t *kw, int64_t d,
                    const float *kstep, float *sh, int64_t span) {
    for (int64_t h = 0; h < g; h++) {
        const int16_t *qh = i16 + h * d;
        for (int64_t j0 = 0; j0 < BLOCK; j0 += 8) {
            __m256i acc[8];
            for (int l = 0; l < 8; l++) acc[l] = _mm256_setzero_si256();
            for (int64_t c = 0; c < d; c += 16) {
                __m256i qc = _mm256_loadu_si256((const __m256i *)(qh + c));
                for (int l = 0; l < 8; l++)
                    acc[l] = _mm256_add_epi32(acc[l], _mm256_madd_epi16(qc, _mm256_load_si256((const __m256i *)(kw + (j0 + l) * d + c))));
            }
            __m256 st = _mm256_mul_ps(_mm256_set1_ps(qstep[h]), _mm256_loadu_ps(kstep + j0));
            _mm256_storeu_ps(sh + h * span + j0, _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8(acc)), st));
        }
    }
}

/* a whole block's values for pv_avx2: each pair of positions' codes as int16 pairs, 16 columns
 * in two vectors (columns 0-3 and 8-11, then 4-7 and 12-15: the unpacks' order) */
static void pv_prepare_avx2(const void *values, int64_t b, int64_t d, __m256i *vp) {
    for (int64_t t = 0; t < BLOCK / 2; t++)
        for (int64_t c = 0; c < d; c += 16) {
            const int8_t *r0 = (const int8_t *)values + (b + 2 * t) * (d + 2) + c, *r1 = r0 + d + 2;
            __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)r0));
            __m256i x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)r1));
            vp[t * (d / 8) + c / 8] = _mm256_unpacklo_epi16(x0, x1);
            vp[t * (d / 8) + c / 8 + 1] = _mm256_unpackhi_epi16(x0, x1);
        }
}

/* row_step of rows b..b+7, all there */
static inline __m256 steps8(const void *plane, int64_t b, int64_t d) {
    int32_t xs[8];
    for (int l = 0; l < 8; l++) memcpy(&xs[l], (const int8_t *)plane + (b + l) * (d + 2) + d - 2, 4);
    __m256i x = _mm256_loadu_si256((const __m256i *)xs);
    __m256i e = _mm256_srai_epi32(_mm256_slli_epi32(x, 8), 24), m8 = _mm256_srai_epi32(x, 24);
    __m256 m = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(m8, _mm256_set1_epi32(128))),
                                                                _mm256_set1_ps(1.0f / 256.0f)));
    __m256 s = _mm256_mul_ps(m, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)));
    if (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(-126), e)))) {
        float t[8]; /* (2^e itself subnormal: never from our graph) */
        _mm256_storeu_ps(t, s);
        for (int l = 0; l < 8; l++) t[l] = row_step(plane, b + l, d);
        s = _mm256_loadu_ps(t);
    }
    return s;
}

/* weights() over a whole block: the same codes and step */
KINLINE float weights_avx2(const float *p, const float *vstep, int16_t *wq) {
    __m256 w[BLOCK / 8], top8 = _mm256_setzero_ps();
    for (int i = 0; i < BLOCK / 8; i++) {
        w[i] = _mm256_mul_ps(_mm256_loadu_ps(p + 8 * i), _mm256_loadu_ps(vstep + 8 * i));
        top8 = _mm256_max_ps(top8, w[i]); /* (weights and steps are >= 0) */
    }
    float t[8], top = 0.0f;
    _mm256_storeu_ps(t, top8);
    for (int l = 0; l < 8; l++) top = t[l] > top ? t[l] : top;
    if (!(top > 0.0f)) {
        memset(wq, 0, BLOCK * sizeof(int16_t));
        return 0.0f;
    }
    __m256 inv = _mm256_set1_ps(W_MAX / top);
    for (int i = 0; i < BLOCK / 8; i += 2) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(w[i], inv)), c = _mm256_cvtps_epi32(_mm256_mul_ps(w[i + 1], inv));
        _mm256_storeu_si256((__m256i *)(wq + 8 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xd8));
    }
    return top / W_MAX;
}

/* pv_plain over a whole block (wq: BLOCK codes, all inside) */
KINLINE void pv_avx2(const int16_t *wq, float wstep, const __m256i *vp, int64_t d, float *o) {
    __m256i acc[MAX_D / 8];
    for (int64_t v = 0; v < d / 8; v++) acc[v] = _mm256_setzero_si256();
    for (int64_t t = 0; t < BLOCK / 2; t++) {
        __m256i w = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)wq[2 * t] | (uint32_t)(uint16_t)wq[2 * t + 1] << 16));
        for (int64_t v = 0; v < d / 8; v++) acc[v] = _mm256_add_epi32(acc[v], _mm256_madd_epi16(vp[t * (d / 8) + v], w));
    }
    __m256 ws = _mm256_set1_ps(wstep);
    for (int64_t c = 0; c < d; c += 16) {
        __m256i lo = acc[c / 8], hi = acc[c / 8 + 1];
        __m256 a = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20));
        __m256 e = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(a, ws, _mm256_loadu_ps(o + c)));
        _mm256_storeu_ps(o + c + 8, _mm256_fmadd_ps(e, ws, _mm256_loadu_ps(o + c + 8)));
    }
}

/* ---- the hooks (attend_i8.h) ---- */
KINLINE int i8v_ok(int64_t g, int64_t d) { (void)g; return d % 16 == 0; }

/* vs: a block's keys as int16 (BLOCK x d), or its values as int16 pairs (the same bytes) */
KINLINE void i8v_queries(const int16_t *i16, int64_t count, int64_t d, void *vs) { (void)i16, (void)count, (void)d, (void)vs; }

KINLINE void i8v_keys(const void *keys, int64_t b, int64_t d, void *vs) { keys_avx2(keys, b, d, (int16_t *)vs); }

KINLINE void i8v_scores(void *vs, const int16_t *i16, int64_t r, const float *qstep, int64_t g, const void *keys,
                        int64_t b, int64_t d, const float *kstep, float *sh, int64_t span) {
    (void)keys, (void)b;
    qk_avx2(i16 + r * g * d, qstep, g, (const int16_t *)vs, d, kstep, sh, span);
}

KINLINE void i8v_scores_row(void *vs, const int16_t *i16, const float *qstep, int64_t g, const void *keys, int64_t b,
                            int64_t d, const float *kstep, float *sh, int64_t span) {
    keys_avx2(keys, b, d, (int16_t *)vs);
    qk_avx2(i16, qstep, g, (const int16_t *)vs, d, kstep, sh, span);
}

KINLINE void i8v_values(const void *values, int64_t b, int64_t d, void *vs) { pv_prepare_avx2(values, b, d, (__m256i *)vs); }

KINLINE void i8v_sums(void *vs, const float *p, const float *vstep, const void *values, int64_t b, int64_t d, float *o) {
    (void)values, (void)b;
    int16_t wq[BLOCK] __attribute__((aligned(32)));
    float wstep = weights_avx2(p, vstep, wq);
    if (wstep != 0.0f) pv_avx2(wq, wstep, (const __m256i *)vs, d, o);
}

KINLINE void i8v_sums_row(void *vs, const float *p, int64_t span, int64_t g, const float *vstep, const void *values,
                          int64_t b, int64_t d, float *o) {
    pv_prepare_avx2(values, b, d, (__m256i *)vs);
    for (int64_t h = 0; h < g; h++) i8v_sums(vs, p + h * span, vstep, values, b, d, o + h * d);
}

KINLINE const int *i8v_order(void) { return NULL; }

KINLINE void i8v_steps(const void *plane, int64_t b, int64_t d, float *step) {
    for (int64_t jj = 0; jj < BLOCK; jj += 8) _mm256_storeu_ps(step + jj, steps8(plane, b + jj, d));
}

#endif
