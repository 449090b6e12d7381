/* The int8 attention's vector code for AVX-512 VNNI (x86_avx512.c): the blocks a row covers
 * whole, by byte dot products (vpdpbusd: keys transposed 16 positions at a time so that
 * positions lie in lanes, values unpacked four positions to a lane; a decode step reads each
 * block once for all its heads, in registers). The hooks attend_i8.h calls are at the end. */
#ifndef EDGELITE_I8_VNNI_H
#define EDGELITE_I8_VNNI_H

#include <immintrin.h>

#include "attend_common.h"

#define EVEN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* round to nearest, even on ties */
#define Q_BIAS 128 /* a query code plus this: an unsigned byte */

/* 16 rows of 64 bytes (at rows, stride `row`) as 16 vectors: lane l of each holds 4 bytes of
 * row l (vector m: bytes 4 transposed_col[m] .. + 3) */
static int load_order[16];
static inline void transpose16(const int8_t *rows, int64_t row, __m512i *out) {
    __m512i r[16], a[16];
    for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_si512(rows + load_order[l] * row);
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int m = 0; m < 4; m++) {
            a[8 * i + m] = _mm512_shuffle_i32x4(r[8 * i + m], r[8 * i + 4 + m], 0x88);
            a[8 * i + 4 + m] = _mm512_shuffle_i32x4(r[8 * i + m], r[8 * i + 4 + m], 0xdd);
        }
    for (int m = 0; m < 8; m++) {
        out[m] = _mm512_shuffle_i32x4(a[m], a[8 + m], 0x88);
        out[8 + m] = _mm512_shuffle_i32x4(a[m], a[8 + m], 0xdd);
    }
}
static int transposed_col[16]; /* the 4 bytes (4 x this ..) of each row transpose16's vector m holds */
/* (load_order: the row transpose16 loads into its lane l's place; set up once) */

/* transpose16's layout, found by running it on tagged rows once: load_order so that lane l
 * holds row l, and each vector's column */
static void transpose16_init(void) {
    int8_t rows[16 * 64];
    for (int l = 0; l < 16; l++) {
        load_order[l] = l;
        for (int i = 0; i < 16; i++) rows[l * 64 + 4 * i] = (int8_t)l, rows[l * 64 + 4 * i + 1] = (int8_t)i;
    }
    __m512i out[16];
    transpose16(rows, 64, out);
    int8_t bytes[64];
    int lane_row[16];
    _mm512_storeu_si512(bytes, out[0]);
    for (int l = 0; l < 16; l++) lane_row[l] = bytes[4 * l];
    for (int l = 0; l < 16; l++) load_order[lane_row[l]] = l;
    for (int m = 0; m < 16; m++) {
        _mm512_storeu_si512(bytes, out[m]);
        transposed_col[m] = bytes[1];
    }
}

/* a whole block's keys for qk_vnni: for each 16 positions and 64 bytes of the head, the 16
 * transposed vectors (kt) and each position's sum of codes (ksum) */
static void qk_prepare(const void *keys, int64_t b, int64_t d, __m512i *kt, __m512i *ksum) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t s = 0; s < BLOCK / 16; s++)
        for (int64_t c = 0; c < d / 64; c++) {
            __m512i *t = kt + (s * (d / 64) + c) * 16, sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            transpose16((const int8_t *)keys + (b + 16 * s) * (d + 2) + 64 * c, d + 2, t);
            for (int m = 0; m < 16; m++) sum[m % 2] = _mm512_dpbusd_epi32(sum[m % 2], ones, t[m]);
            ksum[s * (d / 64) + c] = _mm512_add_epi32(sum[0], sum[1]);
        }
}

/* qk_plain over a whole block: qb, the query's codes + Q_BIAS as bytes (4 at a time, in
 * transpose16's column order); out: BLOCK scores */
KINLINE void qk_vnni(const uint8_t *qb, float qstep, const __m512i *kt, const __m512i *ksum, int64_t d,
                    const float *kstep, float *out) {
    for (int64_t s = 0; s < BLOCK / 16; s++) {
        __m512i part[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                           _mm512_setzero_si512()}; /* (four running sums: each waits on one in four) */
        for (int64_t c = 0; c < d / 64; c++) {
            const __m512i *t = kt + (s * (d / 64) + c) * 16;
            const uint8_t *qc = qb + c * 64;
            for (int m = 0; m < 16; m++) {
                int32_t q4;
                memcpy(&q4, qc + 4 * m, 4);
                part[m % 4] = _mm512_dpbusd_epi32(part[m % 4], _mm512_set1_epi32(q4), t[m]);
            }
            part[0] = _mm512_sub_epi32(part[0], _mm512_slli_epi32(ksum[s * (d / 64) + c], 7)); /* - Q_BIAS sum(k) */
        }
        __m512i dot = _mm512_add_epi32(_mm512_add_epi32(part[0], part[1]), _mm512_add_epi32(part[2], part[3]));
        _mm512_storeu_ps(out + 16 * s, _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                                                     _mm512_mul_ps(_mm512_set1_ps(qstep), _mm512_loadu_ps(kstep + 16 * s))));
    }
}

/* a whole block's values for pv_vnni: for each 4 positions and 64 columns, 4 vectors whose
 * lane l holds the 4 positions' codes of one column (vector v, lane l: column
 * 16 (l / 4) + 4 v + l % 4; its sum goes to o[16 v + l]: pv_slot) */
static int pv_slot[64]; /* column -> where pv_vnni sums it (set up once) */

static void pv_slot_init(void) {
    for (int v = 0; v < 4; v++)
        for (int l = 0; l < 16; l++) pv_slot[16 * (l / 4) + 4 * v + l % 4] = 16 * v + l;
}

/* 4 rows' 64 codes (at x0, stride `row`) as 4 vectors: vector v, lane l holds the 4 rows'
 * codes of column 16 (l / 4) + 4 v + l % 4 (pv_slot's order) */
static inline void unpack4(const int8_t *x0, int64_t row, __m512i *u) {
    __m512i x[4], t[4];
    for (int l = 0; l < 4; l++) x[l] = _mm512_loadu_si512(x0 + l * row);
    t[0] = _mm512_unpacklo_epi8(x[0], x[1]), t[1] = _mm512_unpackhi_epi8(x[0], x[1]);
    t[2] = _mm512_unpacklo_epi8(x[2], x[3]), t[3] = _mm512_unpackhi_epi8(x[2], x[3]);
    u[0] = _mm512_unpacklo_epi16(t[0], t[2]), u[1] = _mm512_unpackhi_epi16(t[0], t[2]);
    u[2] = _mm512_unpacklo_epi16(t[1], t[3]), u[3] = _mm512_unpackhi_epi16(t[1], t[3]);
}

static void pv_prepare(const void *values, int64_t b, int64_t d, __m512i *vt) {
    for (int64_t t4 = 0; t4 < BLOCK / 4; t4++)
        for (int64_t c = 0; c < d / 64; c++) {
            const int8_t *x0 = (const int8_t *)values + (b + 4 * t4) * (d + 2) + 64 * c;
            unpack4(x0, d + 2, vt + (t4 * (d / 64) + c) * 4);
        }
}

/* weights() over a whole block: the same codes (as bytes) and step */
KINLINE float weights_vnni(const float *p, const float *vstep, uint8_t *wq) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(vstep));
    __m512 c = _mm512_mul_ps(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(vstep + 16));
    float top = _mm512_reduce_max_ps(_mm512_max_ps(a, c)); /* (weights and steps are >= 0) */
    if (!(top > 0.0f)) return 0.0f;
    __m512 inv = _mm512_set1_ps(W_MAX / top);
        _mm_storeu_si128((__m128i *)wq, _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_mul_ps(a, inv), EVEN)));
    _mm_storeu_si128((__m128i *)(wq + 16), _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_mul_ps(c, inv), EVEN)));
    return top / W_MAX;
}

/* row_step of rows b..b+15, all there */
static inline __m512 steps16(const void *plane, int64_t b, int64_t d) {
    int32_t xs[16];
    for (int l = 0; l < 16; l++) memcpy(&xs[l], (const int8_t *)plane + (b + l) * (d + 2) + d - 2, 4);
    __m512i x = _mm512_loadu_si512(xs);
    __m512i e = _mm512_srai_epi32(_mm512_slli_epi32(x, 8), 24), m8 = _mm512_srai_epi32(x, 24);
    __mmask16 tiny = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(-126));
    __m512 m = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(m8, _mm512_set1_epi32(128))),
                                                                _mm512_set1_ps(1.0f / 256.0f)));
    __m512 s = _mm512_mul_ps(m, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23)));
    if (tiny) { /* (2^e itself subnormal: never from our graph) */
        float t[16];
        _mm512_storeu_ps(t, s);
        for (int l = 0; l < 16; l++)
            if (tiny >> l & 1) t[l] = row_step(plane, b + l, d);
        s = _mm512_loadu_ps(t);
    }
    return s;
}

/* one row (a decode step) over a whole block, every head of the group at once: the keys
 * transposed in registers and the values unpacked in registers, read once for all heads.
 * qb: g x d query bytes (as qk_vnni's); sh: head h's scores at sh + h * span (position b) */
#define HEADS_AT_ONCE 4
KINLINE void qk_vnni_row(const uint8_t *qb, const float *qstep, int64_t g, const void *keys, int64_t b, int64_t d,
                        const float *kstep, float *sh, int64_t span) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t s = 0; s < BLOCK / 16; s++)
        for (int64_t h0 = 0; h0 < g; h0 += HEADS_AT_ONCE) {
            int hn = g - h0 < HEADS_AT_ONCE ? (int)(g - h0) : HEADS_AT_ONCE;
            __m512i acc[HEADS_AT_ONCE][2];
            for (int h = 0; h < HEADS_AT_ONCE; h++) acc[h][0] = acc[h][1] = _mm512_setzero_si512();
            for (int64_t c = 0; c < d / 64; c++) {
                __m512i t[16], ks[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                transpose16((const int8_t *)keys + (b + 16 * s) * (d + 2) + 64 * c, d + 2, t);
                for (int m = 0; m < 16; m++) ks[m % 2] = _mm512_dpbusd_epi32(ks[m % 2], ones, t[m]);
                for (int h = 0; h < hn; h++) {
                    const uint8_t *qc = qb + (h0 + h) * d + c * 64;
                    for (int m = 0; m < 16; m++) {
                        int32_t q4;
                        memcpy(&q4, qc + 4 * m, 4);
                        acc[h][m % 2] = _mm512_dpbusd_epi32(acc[h][m % 2], _mm512_set1_epi32(q4), t[m]);
                    }
                    acc[h][0] = _mm512_sub_epi32(acc[h][0], _mm512_slli_epi32(_mm512_add_epi32(ks[0], ks[1]), 7));
                }
            }
            __m512 st = _mm512_loadu_ps(kstep + 16 * s);
            for (int h = 0; h < hn; h++) {
                __m512 x = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[h][0], acc[h][1]));
                _mm512_storeu_ps(sh + (h0 + h) * span + 16 * s, _mm512_mul_ps(x, _mm512_mul_ps(_mm512_set1_ps(qstep[h0 + h]), st)));
            }
        }
}

/* one row over a whole block, every head of the group at once (w8: g x BLOCK weight codes,
 * wstep: g steps, 0 for a head with none); o: g x d outputs in pv_slot's order */
#define PV_HEADS 3
KINLINE void pv_vnni_row(const uint8_t *w8, const float *wstep, int64_t g, const void *values, int64_t b, int64_t d,
                        float *o) {
    for (int64_t c = 0; c < d / 64; c++)
        for (int64_t h0 = 0; h0 < g; h0 += PV_HEADS) {
            int hn = g - h0 < PV_HEADS ? (int)(g - h0) : PV_HEADS;
            __m512i acc[PV_HEADS][4];
            for (int h = 0; h < PV_HEADS; h++)
                for (int v = 0; v < 4; v++) acc[h][v] = _mm512_setzero_si512();
            for (int64_t t4 = 0; t4 < BLOCK / 4; t4++) {
                const int8_t *x0 = (const int8_t *)values + (b + 4 * t4) * (d + 2) + 64 * c;
                __m512i u[4];
                unpack4(x0, d + 2, u);
                for (int h = 0; h < hn; h++) {
                    int32_t w4;
                    memcpy(&w4, w8 + (h0 + h) * BLOCK + 4 * t4, 4);
                    __m512i w = _mm512_set1_epi32(w4);
                    for (int v = 0; v < 4; v++) acc[h][v] = _mm512_dpbusd_epi32(acc[h][v], w, u[v]);
                }
            }
            for (int h = 0; h < hn; h++) {
                if (wstep[h0 + h] == 0.0f) continue;
                __m512 ws = _mm512_set1_ps(wstep[h0 + h]);
                float *oh = o + (h0 + h) * d + 64 * c;
                for (int v = 0; v < 4; v++)
                    _mm512_storeu_ps(oh + 16 * v, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][v]), ws, _mm512_loadu_ps(oh + 16 * v)));
            }
        }
}

/* pv_plain over a whole block (wq: BLOCK codes, all inside), in pv_slot's order */
KINLINE void pv_vnni(const uint8_t *wq, float wstep, const __m512i *vt, int64_t d, float *o) {
    __m512 ws = _mm512_set1_ps(wstep);
    for (int64_t c = 0; c < d / 64; c++) {
        __m512i acc[8]; /* (columns 16 v.., positions in even and odd fours: two running sums) */
        for (int v = 0; v < 8; v++) acc[v] = _mm512_setzero_si512();
        for (int64_t t4 = 0; t4 < BLOCK / 4; t4++) {
            int32_t w4;
            memcpy(&w4, wq + 4 * t4, 4);
            __m512i w = _mm512_set1_epi32(w4);
            const __m512i *u = vt + (t4 * (d / 64) + c) * 4;
            for (int v = 0; v < 4; v++) acc[v + 4 * (t4 % 2)] = _mm512_dpbusd_epi32(acc[v + 4 * (t4 % 2)], w, u[v]);
        }
        for (int v = 0; v < 4; v++) acc[v] = _mm512_add_epi32(acc[v], acc[v + 4]);
        for (int v = 0; v < 4; v++)
            _mm512_storeu_ps(o + 64 * c + 16 * v,
                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[v]), ws, _mm512_loadu_ps(o + 64 * c + 16 * v)));
    }
}

/* ---- the hooks (attend_i8.h) ---- */
KINLINE int i8v_ok(int64_t g, int64_t d) { return d % 64 == 0 && g <= MAX_GROUP; }

/* vs: kt (BLOCK x d bytes: a block's keys or values, prepared), ksum (BLOCK x d / 1024
 * vectors), then the queries' bytes (count x d) */
KINLINE __m512i *vs_kt(void *vs) { return (__m512i *)vs; }
KINLINE __m512i *vs_ksum(void *vs, int64_t d) { return (__m512i *)vs + BLOCK * d / 64; }
KINLINE uint8_t *vs_qb(void *vs, int64_t d) { return (uint8_t *)(vs_ksum(vs, d) + BLOCK * d / 1024); }

KINLINE void i8v_queries(const int16_t *i16, int64_t count, int64_t d, void *vs) {
    uint8_t *qb = vs_qb(vs, d);
    for (int64_t r = 0; r < count; r++)
        for (int64_t c = 0; c < d / 64; c++)
            for (int m = 0; m < 16; m++)
                for (int i = 0; i < 4; i++) /* (in transpose16's column order) */
                    qb[r * d + c * 64 + 4 * m + i] = (uint8_t)(i16[r * d + 64 * c + 4 * transposed_col[m] + i] + Q_BIAS);
}

KINLINE void i8v_keys(const void *keys, int64_t b, int64_t d, void *vs) { qk_prepare(keys, b, d, vs_kt(vs), vs_ksum(vs, d)); }

KINLINE void i8v_scores(void *vs, const int16_t *i16, int64_t r, const float *qstep, int64_t g, const void *keys,
                        int64_t b, int64_t d, const float *kstep, float *sh, int64_t span) {
    (void)i16, (void)keys, (void)b;
    for (int64_t h = 0; h < g; h++) {
        float dots[BLOCK];
        qk_vnni(vs_qb(vs, d) + (r * g + h) * d, qstep[h], vs_kt(vs), vs_ksum(vs, d), d, kstep, dots);
        memcpy(sh + h * span, dots, sizeof(dots)); /* (a whole block lies within the row's scores) */
    }
}

KINLINE void i8v_scores_row(void *vs, const int16_t *i16, const float *qstep, int64_t g, const void *keys, int64_t b,
                            int64_t d, const float *kstep, float *sh, int64_t span) {
    (void)i16;
    qk_vnni_row(vs_qb(vs, d), qstep, g, keys, b, d, kstep, sh, span);
}

KINLINE void i8v_values(const void *values, int64_t b, int64_t d, void *vs) { pv_prepare(values, b, d, vs_kt(vs)); }

KINLINE void i8v_sums(void *vs, const float *p, const float *vstep, const void *values, int64_t b, int64_t d, float *o) {
    (void)values, (void)b;
    uint8_t w8[BLOCK];
    float wstep = weights_vnni(p, vstep, w8);
    if (wstep != 0.0f) pv_vnni(w8, wstep, vs_kt(vs), d, o);
}

KINLINE void i8v_sums_row(void *vs, const float *p, int64_t span, int64_t g, const float *vstep, const void *values,
                          int64_t b, int64_t d, float *o) {
    (void)vs;
    uint8_t w8[MAX_GROUP * BLOCK];
    float wsteps[MAX_GROUP];
    for (int64_t h = 0; h < g; h++) wsteps[h] = weights_vnni(p + h * span, vstep, w8 + h * BLOCK);
    pv_vnni_row(w8, wsteps, g, values, b, d, o);
}

KINLINE const int *i8v_order(void) { return pv_slot; }

KINLINE void i8v_steps(const void *plane, int64_t b, int64_t d, float *step) {
    for (int64_t jj = 0; jj < BLOCK; jj += 16) _mm512_storeu_ps(step + jj, steps16(plane, b + jj, d));
}

/* transpose16's and pv_vnni's tables, once */
static void i8_vnni_init(void) {
    transpose16_init();
    pv_slot_init();
}

#endif
