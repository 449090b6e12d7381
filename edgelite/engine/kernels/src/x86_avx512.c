/* The AVX-512 path (VNNI, VBMI, BW, DQ, VL; built with those flags, chosen where cpuid says the
 * CPU and the OS have them): every product by byte dot products (vpdpbusd), the attention in
 * 16 lanes where it pays (the float tiles compiled for this ISA; the int8 one's whole blocks by
 * i8_vnni.h). The same bits as the reference (kernels.h's canonical order).
 *
 * A product works on a group of 4 columns and a tile of 1-4 rows (as even as a chunk's rows
 * go), each row's sums in one register whatever the tile: lane 4 j + c holds column c's running
 * sum s[j] (blocks b with b % 4 = j), so a unit of 4 blocks takes one fused multiply-add a row.
 * The blocks' integer sums (four 32-bit parts each out of vpdpbusd) are added across the four
 * columns' registers by unpacks (sum4), which leaves them in that same [block][column] order. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels.h"

#define MM_ROWS 4 /* rows a tile */
#define MM_PREFETCH(p) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p)))
#define MM_INLINE static inline __attribute__((always_inline))

/* 4 blocks' 4 parts (a[c]: column c's vpdpbusd sums, 128-bit lane j = block j's parts) as one
 * vector of whole block sums, lane 4 j + c */
MM_INLINE __m512i sum4(const __m512i *a) {
    __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* 4 floats (or ints) of a row, each spread over 4 lanes: lane 4 j + c holds p[j] */
MM_INLINE __m512 spread_ps(const float *p) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(_mm_loadu_ps(p)));
}
MM_INLINE __m512i spread_epi32(const int32_t *p) {
    return _mm512_permutexvar_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                    _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p)));
}

/* 128-bit lane i of v (i a constant once unrolled) */
MM_INLINE __m128i lane128(__m512i v, int i) {
    switch (i) {
    case 0: return _mm512_castsi512_si128(v);
    case 1: return _mm512_extracti32x4_epi32(v, 1);
    case 2: return _mm512_extracti32x4_epi32(v, 2);
    default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

/* the canonical end of a row's sums (lane 4 j + c: column c's s[j]): (s0 + s1) + (s2 + s3) */
MM_INLINE __m128 finish4(__m512 f) {
    __m128 l0 = _mm512_castps512_ps128(f), l1 = _mm512_extractf32x4_ps(f, 1);
    __m128 l2 = _mm512_extractf32x4_ps(f, 2), l3 = _mm512_extractf32x4_ps(f, 3);
    return _mm_add_ps(_mm_add_ps(l0, l1), _mm_add_ps(l2, l3));
}

/* one row's unit: its whole block sums t (lane 4 j + c) plus corrections, times scale and step,
 * fused into the row's sums */
MM_INLINE __m512 fold(__m512 f, __m512i t, const qrows *x, int64_t row, int64_t b0, __m512 scale) {
    __m512i bias = spread_epi32(x->bias + row * x->lanes + b0);
    __m512 step = spread_ps(x->steps + row * x->lanes + b0);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t, bias)), _mm512_mul_ps(scale, step), f);
}

/* scales of a unit stored [column][block] (s[4 c + j]) in [block][column] order */
MM_INLINE __m512 by_block(__m512 s) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), s);
}

/* MatMul4 (and MatMul4K's codes): a unit's four columns' codes (lo, hi: their low and high
 * halves) against row `row`'s 4 blocks from unit u: whole block sums, lane 4 j + c */
MM_INLINE __m512i dots4(const __m512i *lo, const __m512i *hi, const qrows *x, int64_t row, int64_t u) {
    __m512i e = _mm512_loadu_si512(x->lo + row * x->width + 64 * u), o = _mm512_loadu_si512(x->hi + row * x->width + 64 * u);
    __m512i a[MM_GROUP];
    for (int c = 0; c < MM_GROUP; c++)
        a[c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c], e), hi[c], o);
    return sum4(a);
}

MM_INLINE void nibbles(const uint8_t *c, __m512i *lo, __m512i *hi) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < MM_GROUP; r++) {
        __m512i code = _mm512_loadu_si512(c + 64 * r);
        lo[r] = _mm512_and_si512(code, nib);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(code, 4), nib);
    }
}

MM_INLINE void group4(const qrows *x, const uint8_t *c, const float *s, int64_t r0, const int R, float *y, int64_t n,
                      int64_t units) {
    __m512 f[MM_ROWS];
    for (int m = 0; m < R; m++) f[m] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++, c += 256, s += 16) {
        for (int l = 0; l < 4; l++) MM_PREFETCH(c + MM4_AHEAD * 256 + 64 * l);
        MM_PREFETCH(s + MM4_AHEAD * 16);
        __m512i lo[MM_GROUP], hi[MM_GROUP];
        nibbles(c, lo, hi);
        __m512 scale = by_block(_mm512_loadu_ps(s));
        for (int m = 0; m < R; m++) f[m] = fold(f[m], dots4(lo, hi, x, r0 + m, u), x, r0 + m, 4 * u, scale);
    }
    for (int m = 0; m < R; m++) _mm_storeu_ps(y + (r0 + m) * n, finish4(f[m]));
}

/* MatMul4K: as group4, and each row's minimum part in one more register (lane 4 j + c: column
 * c's m[j]) against the super-block's exact block sums */
MM_INLINE void group4k(const qrows *x, const uint8_t *c, const uint8_t *mult, const uint16_t *base, int64_t r0,
                       const int R, float *y, int64_t n, int64_t units) {
    /* mult's bytes (sc: 8 a column, then m: 8 a column) as [sc of blocks 0-3 | 4-7 | m 0-3 | m 4-7],
     * each [block][column] */
    static const uint8_t order[64] = {
        0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27, 4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31,
        32, 40, 48, 56, 33, 41, 49, 57, 34, 42, 50, 58, 35, 43, 51, 59, 36, 44, 52, 60, 37, 45, 53, 61, 38, 46, 54, 62, 39, 47, 55, 63};
    const __m512i perm = _mm512_loadu_si512(order);
    const __m512i col = _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0);
    __m512 f[MM_ROWS], low[MM_ROWS];
    for (int m = 0; m < R; m++) f[m] = low[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < units; sb++, c += 512, mult += 64, base += 8) {
        for (int l = 0; l < 8; l++) MM_PREFETCH(c + MM4K_AHEAD * 512 + 64 * l);
        MM_PREFETCH(mult + MM4K_AHEAD * 64);
        MM_PREFETCH(base + MM4K_AHEAD * 8);
        __m512 de = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)base)));
        __m512 d = _mm512_permutexvar_ps(col, de), e = _mm512_permutexvar_ps(_mm512_add_epi32(col, _mm512_set1_epi32(4)), de);
        __m512i mb = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(mult));
        for (int s = 0; s < 2; s++) { /* MatMul4's units of 4 blocks */
            __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane128(mb, s))), d);
            __m512 mins = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane128(mb, 2 + s))), e);
            __m512 coef = _mm512_fmadd_ps(scale, _mm512_set1_ps(MM4K_SHIFT), mins);
            __m512i lo[MM_GROUP], hi[MM_GROUP];
            nibbles(c + 256 * s, lo, hi);
            int64_t u = 2 * sb + s;
            for (int m = 0; m < R; m++) {
                int64_t row = r0 + m;
                f[m] = fold(f[m], dots4(lo, hi, x, row, u), x, row, 4 * u, scale);
                low[m] = _mm512_fmadd_ps(coef, spread_ps(x->sums + row * x->sum_width + MM4K_SUMS * sb + 4 * s), low[m]);
            }
        }
    }
    for (int m = 0; m < R; m++)
        _mm_storeu_ps(y + (r0 + m) * n, _mm_add_ps(finish4(f[m]), finish4(low[m])));
}

/* byte 8g + i of a vector <- byte 6g + i of 48 loaded ones (i < 6): 8 codes a 64-bit lane */
static const uint8_t UNPACK6[64] = {
    0,  1,  2,  3,  4,  5,  5,  5,  6,  7,  8,  9,  10, 11, 11, 11, 12, 13, 14, 15, 16, 17,
    17, 17, 18, 19, 20, 21, 22, 23, 23, 23, 24, 25, 26, 27, 28, 29, 29, 29, 30, 31, 32, 33,
    34, 35, 35, 35, 36, 37, 38, 39, 40, 41, 41, 41, 42, 43, 44, 45, 46, 47, 47, 47};

/* MatMul6: a super-block's 4 steps of 4 blocks; each step's codes unpacked from their 48
 * bytes (vpmultishiftqb: 8 codes a 64-bit lane) */
MM_INLINE void group6(const qrows *x, const uint8_t *c, const int8_t *mult, const float *base, int64_t r0, const int R,
                      float *y, int64_t n, int64_t units) {
    /* mult's bytes (16 a column) as [blocks 0-3 | 4-7 | 8-11 | 12-15], each [block][column] */
    static const uint8_t order[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
        8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    const __m512i perm = _mm512_loadu_si512(UNPACK6), mperm = _mm512_loadu_si512(order);
    const __m512i shifts = _mm512_set1_epi64(0x2A241E18120C0600LL); /* bit 6i for byte i */
    const __m512i six = _mm512_set1_epi8(0x3F);
    const __m512i col = _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0);
    __m512 f[MM_ROWS];
    for (int m = 0; m < R; m++) f[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < units; sb++, c += MM_GROUP * MM6_BYTES, mult += MM_GROUP * 16, base += MM_GROUP) {
        for (int l = 0; l < MM_GROUP * MM6_BYTES / 64; l++) MM_PREFETCH(c + MM6_AHEAD * MM_GROUP * MM6_BYTES + 64 * l);
        MM_PREFETCH(mult + MM6_AHEAD * MM_GROUP * 16);
        __m512i mb = _mm512_permutexvar_epi8(mperm, _mm512_loadu_si512(mult));
        __m512 b4 = _mm512_permutexvar_ps(col, _mm512_castps128_ps512(_mm_loadu_ps(base)));
        for (int s = 0; s < 4; s++) { /* 64 codes (4 blocks) a column */
            __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lane128(mb, s))), b4);
            __m512i q[MM_GROUP];
            for (int r = 0; r < MM_GROUP; r++) {
                __m512i raw = _mm512_maskz_loadu_epi8(0x0000FFFFFFFFFFFFULL, c + MM6_BYTES * r + 48 * s);
                q[r] = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(perm, raw)), six);
            }
            int64_t b0 = sb * (MM6_SUPER / MM6_BLOCK) + 4 * s;
            for (int m = 0; m < R; m++) {
                int64_t row = r0 + m;
                __m512i xv = _mm512_loadu_si512(x->lo + row * x->width + sb * MM6_SUPER + 64 * s), a[MM_GROUP];
                for (int r = 0; r < MM_GROUP; r++) a[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r], xv);
                f[m] = fold(f[m], sum4(a), x, row, b0, scale);
            }
        }
    }
    for (int m = 0; m < R; m++) _mm_storeu_ps(y + (r0 + m) * n, finish4(f[m]));
}

/* MatMul8: two units (4 blocks) at a time; a column's unit is 2 blocks of 8 parts each, so
 * each unit's 4 columns are added by sum4 (4 parts) and the two halves of each block after */
MM_INLINE __m512i halves8(__m512i x, __m512i y) {
    __m512i p = _mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)), q = _mm512_shuffle_i32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1));
    return _mm512_add_epi32(p, q);
}

/* two units' sums of a row into its register: codes q0 (unit u) and q1 (unit u + 1, or zeros) */
MM_INLINE __m512 pair8(__m512 f, const __m512i *q0, const __m512i *q1, const qrows *x, int64_t row, int64_t u,
                       __m512 scale, const int two) {
    const int8_t *xr = x->lo + row * x->width + MM8_UNIT * u;
    __m512i x0 = _mm512_loadu_si512(xr), x1 = two ? _mm512_loadu_si512(xr + MM8_UNIT) : _mm512_setzero_si512();
    __m512i a[MM_GROUP], b[MM_GROUP];
    for (int r = 0; r < MM_GROUP; r++) {
        a[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0[r], x0);
        b[r] = two ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), q1[r], x1) : _mm512_setzero_si512();
    }
    __m512i t = halves8(sum4(a), sum4(b));
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    int64_t at = row * x->lanes + 2 * u;
    __m512i bias = _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(_mm_maskz_loadu_epi32(two ? 15 : 3, x->bias + at)));
    __m512 step = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_maskz_loadu_ps(two ? 15 : 3, x->steps + at)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t, bias)), _mm512_mul_ps(scale, step), f);
}

MM_INLINE void group8(const qrows *x, const uint8_t *c, const float *s, int64_t r0, const int R, float *y, int64_t n,
                      int64_t units) {
    /* two units' scales ([column][block] each) as [block][column] */
    const __m512i sperm = _mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0);
    __m512 f[MM_ROWS];
    __m512i q0[MM_GROUP], q1[MM_GROUP];
    for (int m = 0; m < R; m++) f[m] = _mm512_setzero_ps();
    int64_t u = 0;
    for (; u + 1 < units; u += 2, c += 2 * MM_GROUP * MM8_UNIT, s += 4 * MM_GROUP) {
        for (int l = 0; l < 2 * MM_GROUP; l++) MM_PREFETCH(c + MM8_AHEAD * MM_GROUP * MM8_UNIT + 64 * l);
        MM_PREFETCH(s + MM8_AHEAD * 2 * MM_GROUP);
        __m512 scale = _mm512_permutexvar_ps(sperm, _mm512_loadu_ps(s));
        for (int r = 0; r < MM_GROUP; r++) {
            q0[r] = _mm512_loadu_si512(c + MM8_UNIT * r);
            q1[r] = _mm512_loadu_si512(c + MM_GROUP * MM8_UNIT + MM8_UNIT * r);
        }
        for (int m = 0; m < R; m++) f[m] = pair8(f[m], q0, q1, x, r0 + m, u, scale, 1);
    }
    if (u < units) { /* an odd last unit: its pair's second half adds nothing (scales, steps 0) */
        __m512 scale = _mm512_permutexvar_ps(sperm, _mm512_maskz_loadu_ps(0x00FF, s));
        for (int r = 0; r < MM_GROUP; r++) q0[r] = _mm512_loadu_si512(c + MM8_UNIT * r);
        for (int m = 0; m < R; m++) f[m] = pair8(f[m], q0, q1, x, r0 + m, u, scale, 0);
    }
    for (int m = 0; m < R; m++) _mm_storeu_ps(y + (r0 + m) * n, finish4(f[m]));
}

/* a thread's column groups over its rows: in bands the second-level cache holds (every group
 * reads all of a band's quantized rows), tiles of 1-4 rows as even as they go (a lone row costs
 * nearly what four do: the group's codes are unpacked once a tile) */
static void matmul_avx512(const mm_job *p) {
    const qrows *x = p->x;
    int64_t row_bytes = 2 * x->width + 2 * x->lanes * (int64_t)sizeof(float) + x->sum_width * (int64_t)sizeof(float);
    int64_t most_band = MM_BAND_BYTES / row_bytes > MM_ROWS ? MM_BAND_BYTES / row_bytes : MM_ROWS;
    int64_t bands = (p->rows + most_band - 1) / most_band, units = p->units;
    for (int64_t band = 0, b0 = 0; band < bands; band++) {
        int64_t rows = p->rows / bands + (band < p->rows % bands), tiles = (rows + MM_ROWS - 1) / MM_ROWS;
        for (int64_t g = p->g0; g < p->g1; g++) {
            const uint8_t *c = p->codes + g * units * p->unit_bytes;
            float *y = p->y + g * MM_GROUP;
            for (int64_t t = 0, r = b0; t < tiles; t++) {
                int64_t size = rows / tiles + (t < rows % tiles);
#define TILE(R)                                                                                                     \
    (p->kind == MM4   ? group4(x, c, (const float *)p->scales + g * units * 16, r, R, y, p->n, units)                 \
     : p->kind == MM6 ? group6(x, c, (const int8_t *)p->scales + g * units * MM_GROUP * 16,                          \
                               (const float *)p->base + g * units * MM_GROUP, r, R, y, p->n, units)                  \
     : p->kind == MM8 ? group8(x, c, (const float *)p->scales + g * units * 2 * MM_GROUP, r, R, y, p->n, units)      \
                      : group4k(x, c, (const uint8_t *)p->scales + g * units * 64, (const uint16_t *)p->base + g * units * 8, \
                                r, R, y, p->n, units))
                switch (size) {
                case 4: TILE(4); break;
                case 3: TILE(3); break;
                case 2: TILE(2); break;
                default: TILE(1); break;
                }
#undef TILE
                r += size;
            }
        }
        b0 += rows;
    }
}

/* ---- attention ---------------------------------------------------------------------------- */
#define ATTEND_SPECIALIZE 1
#include "attend_float.h"
#include "i8_vnni.h"
#include "attend_i8.h"
#include "norm.h"

const kpath kpath_avx512 = {
    .name = "avx512",
    .needs = FEAT_AVX512,
    .matmul = {matmul_avx512, matmul_avx512, matmul_avx512, matmul_avx512},
    .attend = {attend_f32, attend_f16, attend_i8_kv},
    .norm = norm_rows,
    .init = i8_vnni_init,
};
