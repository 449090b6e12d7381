/* Products with narrow weights, read as they are stored (engine/linear.py rewrites a fast
 * export's MatMulNBits as a range loads), where onnxruntime's MatMulNBits packs them again:
 *
 * MatMul4: 4-bit codes in blocks of 32 (MatMulNBits bits 4, block_size 32, accuracy_level 4,
 * zero point 8): 4 bits and a float scale a block, where MatMulNBits holds about 6.
 *   inputs:  a       float32 (..., K)
 *            codes   uint8 (N/4, B/4, 4, 64): four columns' codes interleaved, 64 bytes (4
 *                    blocks, two codes a byte: the block's element 2j in byte j's low half,
 *                    2j + 1 in its high half, as MatMulNBits holds them) of each column in
 *                    turn, then the next 4 blocks; B: the blocks of K padded to a multiple of 4
 *            scales  float32 (N/4, B/4, 4, 4): the same order, one a block
 *   output:  float32 (..., N): y[n] = sum over blocks b of scale[n, b] step[b]
 *            sum_j (code[n, b, j] - 8) x[b, j]
 *   attributes: K, N, threads
 *
 * MatMul6: 6-bit codes in blocks of 16 with a K-quant's scales (Q6_K as the exporter stores it:
 * MatMulNBits bits 8, block_size 16, accuracy_level 4, the codes widened from 6 bits at load,
 * each block's scale a float16 per 256 weights times a signed byte per block): 6.56 bits a
 * weight, where MatMulNBits holds about 12.
 *   inputs:  a       float32 (..., K)
 *            codes   uint8 (N/4, K/256, 4, 192): each column's 256 codes of a super-block as
 *                    the export's stream holds them (8 codes in 6 bytes, code i at bit 6i),
 *                    four columns in turn, then the next super-block
 *            mult    int8 (N/4, K/256, 4, 16): each block's multiple, the same order
 *            base    float32 (N/4, K/256, 4): each super-block's scale
 *   output:  float32 (..., N): y[n] = sum over blocks b of base[n, b / 16] mult[n, b] step[b]
 *            sum_j (code[n, b, j] - zero) x[b, j]
 *   attributes: K, N, zero (the codes' zero point), threads
 *
 * MatMul4K: Q4_K's products whole (4-bit codes in blocks of 32, each block's scale d x sc and
 * minimum dmin x m, as the exporter stores a K-quant's: a float per 256 weights, a byte per 32):
 * 4.625 bits a weight, where MatMul4 with the export's separate minima product reads about 6.
 *   inputs:  a       float32 (..., K), K a multiple of 256
 *            codes   uint8 (N/4, K/128, 4, 64): as MatMul4's
 *            mult    uint8 (N/4, K/256, 2, 4, 8): a super-block's 8 scale multiples sc of each
 *                    of the four columns in turn, then their 8 minimum multiples m; then the
 *                    next super-block
 *            base    float16 (N/4, K/256, 8): the four columns' d, then their e (dmin, signed)
 *   output:  float32 (..., N): y[n] = sum over blocks b of d sc[n, b] step[b] sum_j (code[n, b,
 *            j] - 8) x[b, j] + (8 d sc[n, b] + e m[n, b]) sum_j a[b, j]: the codes centred at 8 as
 *            MatMul4's, and the rest of each block's weights by the block's exact sum of a
 *   attributes: K, N, threads
 *
 * MatMul8: 8-bit codes in blocks of 32 (MatMulNBits bits 8, block_size 32, accuracy_level 4, no
 * zero points: a Q8_0 product, or a fast export's 8-bit head): its codes and float scales.
 *   inputs:  a       float32 (..., K), K a multiple of 64
 *            codes   uint8 (N/4, K/64, 4, 64): each column's 64 codes (2 blocks) in turn, four
 *                    columns, then the next 64
 *            scales  float32 (N/4, K/64, 4, 2): the same order, one a block
 *   output:  float32 (..., N): y[n] = sum over blocks b of scale[n, b] step[b] sum_j (code[n,
 *            b, j] - zero) x[b, j]
 *   attributes: K, N, zero (the codes' zero point: MatMulNBits' is 128), threads
 *
 * Each row of a is quantized per block as MatMulNBits' level 4 does: codes round(a x 127 /
 * largest) (to even) and a step, largest / 127 (blocks of 32 for MatMul4, 16 for MatMul6).
 * Where the compiler targets AVX-512 VNNI and VBMI, the sums are byte dot products
 * (`vpdpbusd`; MatMul4: the codes' low halves against the even elements, the high halves
 * against the odd ones; MatMul6: codes unpacked by `vpmultishiftqb`), four columns and up to
 * four rows at a time (MatMul8: the codes as they are), each block's integer sum times its scale and step added to the row's
 * float lanes; every row is the same sequence of operations whatever the rows beside it, so a
 * row comes out the same in any chunking. Where it targets AVX2 without them, MatMul4 and
 * MatMul8 have an 8-lane path (group4_avx2, group8_avx2), as row-invariant. Elsewhere the same
 * sums in plain C (edgelite_matmul_fast says which operators have a vector path: engine/linear.py
 * rewrites only those). MatMul4K runs
 * MatMul4's sums; each super-block's scales and minimum coefficients come from its bytes once
 * for all the tile's rows. */

#include "ortop.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define MM_VECTOR 1
#define MM_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MM_VECTOR 0
#define MM_AVX2 1 /* MatMul4 and MatMul8 in 8 lanes (the others in plain C) */
#else
#define MM_VECTOR 0
#define MM_AVX2 0
#endif

#if MM_VECTOR || MM_AVX2
#define MM_INLINE static inline __attribute__((always_inline))
#define MM_PREFETCH(p) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p)))
#endif

enum { MM4 = 0, MM6 = 1, MM4K = 2, MM8 = 3 }; /* the operators */
#define MM_GROUP 4         /* columns interleaved together */
#define MM_ROWS 4          /* rows of a that share a group's codes once loaded */
#define MM_THREADS 16      /* threads a call may use */
#define MM_PARALLEL (1 << 20) /* rows x weights below which a call stays on its caller's thread */
#define MM_MAX_RANK 8
#define MM_PAD 64          /* bytes after each quantized row (see mm_compute) */
#define MM_BAND_BYTES (512 << 10) /* quantized rows' bytes a band of rows holds at most (see mm_run) */
#define MM4_BLOCK 32       /* MatMul4: weights a block (one scale) */
#define MM4_STEP 4         /* blocks a column holds in 64 bytes */
#define MM4_AHEAD 8        /* steps (256 bytes of codes) asked for ahead: measured best of 2-32 */
#define MM6_BLOCK 16       /* MatMul6: weights a block (one multiple) */
#define MM6_SUPER 256      /* weights a super-block (one base scale) */
#define MM6_BYTES 192      /* a column's codes of a super-block */
#define MM6_AHEAD 2        /* super-blocks (768 bytes of codes) asked for ahead */
#define MM4K_SUPER 256     /* MatMul4K: weights a super-block (one d and e) */
#define MM4K_SHIFT 8.0f    /* its codes' centre */
#define MM4K_SUMS 16       /* floats a super-block of a row's sums (see qrows) */
#define MM4K_ROWS 3        /* MatMul4K's most rows a tile (4 spill its registers) */
#define MM8_BLOCK 32       /* MatMul8: weights a block (one scale) */
#define MM8_UNIT 64        /* its codes a column's unit holds (2 blocks) */
#define MM8_AHEAD 8        /* units (256 bytes of codes) asked for ahead */
#define MM4K_AHEAD 4       /* super-blocks (2,048 bytes of codes) asked for ahead */

/* the operators with a vector path, a bit each (1 << MM4 ...): engine/linear.py rewrites those */
int edgelite_matmul_fast(void) { return MM_VECTOR ? 15 : MM_AVX2 ? (1 << MM4) | (1 << MM8) : 0; }

typedef struct {
    api_t api;
    int kind;
    int64_t k, n, zero, threads;
} mm_state;

/* rows of a, quantized: per row, `width` bytes of codes in lo (MatMul4: a block's even
 * elements; MatMul6: all, in order) and hi (MatMul4: its odd elements), and each block's step
 * and correction (minus the zero point times the sum of its codes: where a block's integer sum
 * starts), one a block (the vector paths spread them over the block's lanes themselves) */
typedef struct {
    int8_t *lo, *hi;
    float *steps;
    int32_t *bias;
    /* MatMul4K: a super-block's 8 block sums of a, twice (16 lanes) */
    float *sums;
    /* AVX2 (MatMul4, MatMul8): each block's step in each of its 8-lane sums' lanes (MatMul4: 4
     * lanes a block, MatMul8: 8), and its correction in the first of them (0 in the others) */
    float *wide_steps;
    int32_t *wide_bias;
    int64_t wide_lanes;
    int16_t *wide_x; /* AVX2, MatMul8: the codes in lo widened to 16 bits (width a row) */
    /* blocks a row; a row's bytes of codes, its steps' count and its sums' count, padded */
    int64_t blocks, width, lanes, sum_width;
} qrows;

typedef struct {
    const qrows *x;
    int kind;
    const uint8_t *codes;
    const void *scales; /* MatMul4: float scales; MatMul6: int8 multiples; MatMul4K: uint8 ones */
    const void *base;   /* MatMul6: float32; MatMul4K: float16 */
    float *y;
    int64_t rows, n, g0, g1;
} mm_part;

/* row x (k values) in blocks of `block` as codes: element j of block b at lo[b * block / 2 +
 * j / 2] (even j) or hi[..] (odd j) when `split` (MatMul4), else at lo[b * block + j]; its
 * step and correction as qrows holds them; blocks past k zero */
static void quantize_a(const float *x, int64_t k, int64_t blocks, int64_t block, int split, int64_t zero,
                       int8_t *lo, int8_t *hi, float *steps, int32_t *bias, float *sums) {
    memset(lo, 0, (size_t)(split ? blocks * block / 2 : blocks * block));
    if (split) memset(hi, 0, (size_t)(blocks * block / 2));
    memset(steps, 0, (size_t)blocks * sizeof(float));
    memset(bias, 0, (size_t)blocks * sizeof(int32_t));
    for (int64_t b = 0; b * block < k; b++) {
        const float *v = x + b * block;
        int64_t len = k - b * block < block ? k - b * block : block;
        float top = 0.0f, exact = 0.0f;
        for (int64_t j = 0; j < len; j++) top = fabsf(v[j]) > top ? fabsf(v[j]) : top, exact += v[j];
        float inv = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t sum = 0;
        for (int64_t j = 0; j < len; j++) {
            int c = (int)nearbyintf(v[j] * inv);
            c = c > 127 ? 127 : c < -127 ? -127 : c;
            if (split) (j % 2 ? hi : lo)[b * block / 2 + j / 2] = (int8_t)c;
            else lo[b * block + j] = (int8_t)c;
            sum += c;
        }
        if (sums) /* MatMul4K: block b of super-block s at lanes 16s + b % 8 and + 8 */
            sums[MM4K_SUMS * (b / 8) + b % 8] = sums[MM4K_SUMS * (b / 8) + b % 8 + 8] = exact;
        steps[b] = top / 127.0f;
        bias[b] = -(int32_t)zero * sum;
    }
}

/* code i (0..255) of a MatMul6 column's super-block (8 codes in 6 bytes, code i at bit 6i) */
static inline int code6(const uint8_t *c, int64_t i) {
    const uint8_t *g = c + 6 * (i / 8);
    uint64_t v = 0;
    for (int j = 0; j < 6; j++) v |= (uint64_t)g[j] << (8 * j);
    return (int)((v >> (6 * (i % 8))) & 63);
}

#if MM_VECTOR

/* each row's lanes summed into y */
MM_INLINE void mm_finish(__m512 (*f)[MM_ROWS], int64_t r0, int R, float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++)
        for (int m = 0; m < R; m++) y[(r0 + m) * n + r] = _mm512_reduce_add_ps(f[r][m]);
}

/* MatMul4 and MatMul4K: one column r's 64 bytes of codes (4 blocks) at `codes` against rows
 * r0..r0+R-1's `unit`-th 4 blocks, each block's integer sum (from its correction) times SC (the
 * column's scales, a block's in its 4 lanes) and the row's step, added to the row's lanes
 * f[r][m] (a macro: as a function taking f, the compiler kept the sums in memory) */
#define MM4_COLUMN(codes, SC, unit, r)                                                                        \
    do {                                                                                                      \
        __m512i code_ = _mm512_loadu_si512(codes);                                                            \
        __m512i lo_ = _mm512_and_si512(code_, nib), hi_ = _mm512_and_si512(_mm512_srli_epi16(code_, 4), nib); \
        __m512 sc_ = (SC);                                                                                    \
        for (int m = 0; m < R; m++) {                                                                         \
            int64_t row = r0 + m;                                                                             \
            const int8_t *e_ = x->lo + row * x->width + 64 * (unit), *o_ = x->hi + row * x->width + 64 * (unit); \
            __m512i acc = _mm512_maskz_permutexvar_epi32( /* (from the correction) */                         \
                0x1111, spread, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(x->bias + row * x->lanes + 4 * (unit))))); \
            acc = _mm512_dpbusd_epi32(acc, lo_, _mm512_loadu_si512(e_));                                       \
            acc = _mm512_dpbusd_epi32(acc, hi_, _mm512_loadu_si512(o_));                                       \
            __m512 step = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(x->steps + row * x->lanes + 4 * (unit)))); \
            f[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sc_, step), f[r][m]);             \
        }                                                                                                     \
    } while (0)

/* MatMul4: one group of 4 columns for rows r0..r0+R-1 (R a constant, 1..MM_ROWS; each row the
 * same operations whatever R) */
MM_INLINE void group4_vector(const qrows *x, const uint8_t *c, const float *s, int64_t r0, int R, float *y,
                             int64_t n, int64_t units) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); /* block -> its lanes */
    __m512 f[MM_GROUP][MM_ROWS];
    for (int r = 0; r < MM_GROUP; r++)
        for (int m = 0; m < R; m++)
            f[r][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < units; b++, c += 256, s += 16) {
        for (int l = 0; l < 4; l++) MM_PREFETCH(c + MM4_AHEAD * 256 + 64 * l);
        MM_PREFETCH(s + MM4_AHEAD * 16);
        __m512 sc4 = _mm512_loadu_ps(s);
        for (int r = 0; r < MM_GROUP; r++)
            MM4_COLUMN(c + 64 * r, _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(4 * r)), sc4), b, r);
    }
    mm_finish(f, r0, R, y, n);
}

/* byte 8g + i of a vector <- byte 6g + i of 48 loaded ones (i < 6): 8 codes a 64-bit lane */
static const uint8_t UNPACK6[64] = {
    0,  1,  2,  3,  4,  5,  5,  5,  6,  7,  8,  9,  10, 11, 11, 11, 12, 13, 14, 15, 16, 17,
    17, 17, 18, 19, 20, 21, 22, 23, 23, 23, 24, 25, 26, 27, 28, 29, 29, 29, 30, 31, 32, 33,
    34, 35, 35, 35, 36, 37, 38, 39, 40, 41, 41, 41, 42, 43, 44, 45, 46, 47, 47, 47};

/* MatMul6: one group of 4 columns for rows r0..r0+R-1 (as group4_vector) */
MM_INLINE void group6_vector(const qrows *x, const uint8_t *c, const int8_t *mult, const float *base, int64_t r0,
                             int R, float *y, int64_t n, int64_t units) {
    const __m512i perm = _mm512_loadu_si512(UNPACK6);
    const __m512i shifts = _mm512_set1_epi64(0x2A241E18120C0600LL); /* bit 6i for byte i */
    const __m512i six = _mm512_set1_epi8(0x3F);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); /* block -> its lanes */
    __m512 f[MM_GROUP][MM_ROWS];
    for (int r = 0; r < MM_GROUP; r++)
        for (int m = 0; m < R; m++) f[r][m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < units; sb++, c += MM_GROUP * MM6_BYTES, mult += MM_GROUP * 16, base += MM_GROUP) {
        for (int l = 0; l < MM_GROUP * MM6_BYTES / 64; l++) MM_PREFETCH(c + MM6_AHEAD * MM_GROUP * MM6_BYTES + 64 * l);
        MM_PREFETCH(mult + MM6_AHEAD * MM_GROUP * 16);
        /* each column's 16 block scales (base x multiple), once a super-block */
        __m512i mb = _mm512_loadu_si512(mult);
        __m512 scales[MM_GROUP];
        for (int r = 0; r < MM_GROUP; r++)
            scales[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(mb, r))),
                                      _mm512_set1_ps(base[r]));
        for (int s = 0; s < 4; s++) { /* 64 codes (4 blocks) a column */
            /* the 4 columns' codes and scales, then each row against all 4 (its codes, steps
             * and corrections read once) */
            __m512i q[MM_GROUP];
            for (int r = 0; r < MM_GROUP; r++) {
                __m512i raw = _mm512_maskz_loadu_epi8(0x0000FFFFFFFFFFFFULL, c + MM6_BYTES * r + 48 * s);
                q[r] = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(perm, raw)), six);
            }
            int64_t block = sb * (MM6_SUPER / MM6_BLOCK) + 4 * s;
            for (int m = 0; m < R; m++) {
                int64_t row = r0 + m;
                __m512i xv = _mm512_loadu_si512(x->lo + row * x->width + sb * MM6_SUPER + 64 * s);
                __m512 step = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(x->steps + row * x->lanes + block)));
                __m512i bias = _mm512_maskz_permutexvar_epi32(
                    0x1111, spread, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(x->bias + row * x->lanes + block))));
                for (int r = 0; r < MM_GROUP; r++) {
                    __m512i acc = _mm512_dpbusd_epi32(bias, q[r], xv); /* (from the correction) */
                    __m512 sc = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(4 * s)), scales[r]);
                    f[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sc, step), f[r][m]);
                }
            }
        }
    }
    mm_finish(f, r0, R, y, n);
}

/* MatMul8: one group of 4 columns for rows r0..r0+R-1 (as group6_vector: the 4 columns' codes
 * and scales, then each row against all 4) */
MM_INLINE void group8_vector(const qrows *x, const uint8_t *c, const float *s, int64_t r0, int R, float *y,
                             int64_t n, int64_t units) {
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0); /* block -> its 8 lanes */
    __m512 f[MM_GROUP][MM_ROWS];
    for (int r = 0; r < MM_GROUP; r++)
        for (int m = 0; m < R; m++) f[r][m] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++, c += MM_GROUP * MM8_UNIT, s += 2 * MM_GROUP) {
        for (int l = 0; l < MM_GROUP; l++) MM_PREFETCH(c + MM8_AHEAD * MM_GROUP * MM8_UNIT + 64 * l);
        MM_PREFETCH(s + MM8_AHEAD * 2 * MM_GROUP);
        __m512 s8 = _mm512_castps256_ps512(_mm256_loadu_ps(s));
        __m512i q[MM_GROUP];
        __m512 sc[MM_GROUP];
        for (int r = 0; r < MM_GROUP; r++) {
            q[r] = _mm512_loadu_si512(c + MM8_UNIT * r);
            sc[r] = _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(2 * r)), s8);
        }
        for (int m = 0; m < R; m++) {
            int64_t row = r0 + m;
            __m512i xv = _mm512_loadu_si512(x->lo + row * x->width + MM8_UNIT * u);
            __m512 step = _mm512_permutexvar_ps(
                halves, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(x->steps + row * x->lanes + 2 * u)))));
            __m512i bias = _mm512_maskz_permutexvar_epi32(
                0x0101, halves, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(x->bias + row * x->lanes + 2 * u))));
            for (int r = 0; r < MM_GROUP; r++) {
                __m512i acc = _mm512_dpbusd_epi32(bias, q[r], xv); /* (from the correction) */
                f[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sc[r], step), f[r][m]);
            }
        }
    }
    mm_finish(f, r0, R, y, n);
}

/* MatMul4K: one group of 4 columns for rows r0..r0+R-1 (as group4_vector; R up to MM4K_ROWS).
 * A super-block's scales (d sc) and minimum coefficients (8 d sc + e m) are two vectors each,
 * lane 8 (r % 2) + b of vector r / 2 for column r's block b; each row's minimum part gathers in
 * two vectors of its own against the super-block's block sums. */
MM_INLINE void group4k_vector(const qrows *x, const uint8_t *c, const uint8_t *mult, const uint16_t *base,
                              int64_t r0, int R, float *y, int64_t n, int64_t units) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); /* block -> its lanes */
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);   /* lane -> column */
    __m512 f[MM_GROUP][MM_ROWS], minima[2][MM_ROWS];
    for (int m = 0; m < R; m++) {
        for (int r = 0; r < MM_GROUP; r++) f[r][m] = _mm512_setzero_ps();
        minima[0][m] = minima[1][m] = _mm512_setzero_ps();
    }
    for (int64_t sb = 0; sb < units; sb++, c += 512, mult += 64, base += 8) {
        for (int l = 0; l < 8; l++) MM_PREFETCH(c + MM4K_AHEAD * 512 + 64 * l);
        MM_PREFETCH(mult + MM4K_AHEAD * 64);
        MM_PREFETCH(base + MM4K_AHEAD * 8);
        __m512 de = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)base)));
        __m512 scale[2], low[2]; /* (low: the minimum coefficients) */
        for (int h = 0; h < 2; h++) { /* columns 2h, 2h + 1 */
            __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mult + 16 * h))));
            __m512 mm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mult + 32 + 16 * h))));
            __m512 d = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * h)), de);
            __m512 e = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * h + 4)), de);
            scale[h] = _mm512_mul_ps(sc, d);
            low[h] = _mm512_fmadd_ps(scale[h], _mm512_set1_ps(MM4K_SHIFT), _mm512_mul_ps(mm, e));
        }
        for (int s = 0; s < 2; s++) { /* MatMul4's steps of 4 blocks */
            for (int r = 0; r < MM_GROUP; r++)
                MM4_COLUMN(c + 256 * s + 64 * r,
                           _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(8 * (r % 2) + 4 * s)), scale[r / 2]),
                           2 * sb + s, r);
        }
        for (int m = 0; m < R; m++) {
            const float *sums = x->sums + (r0 + m) * x->sum_width + MM4K_SUMS * sb;
            __m512 exact = _mm512_loadu_ps(sums);
            minima[0][m] = _mm512_fmadd_ps(low[0], exact, minima[0][m]);
            minima[1][m] = _mm512_fmadd_ps(low[1], exact, minima[1][m]);
        }
    }
    for (int r = 0; r < MM_GROUP; r++)
        for (int m = 0; m < R; m++)
            y[(r0 + m) * n + r] = _mm512_reduce_add_ps(f[r][m]) +
                                  _mm512_mask_reduce_add_ps(r % 2 ? 0xFF00 : 0x00FF, minima[r / 2][m]);
}
#endif

#if MM_AVX2
#define MM_ROWS_AVX2 4 /* rows a tile (a row's sums for the group: one register) */

/* the four columns' integer sums of blocks A and B (v[r]: column r's, lanes 0-3 block A's
 * parts, 4-7 B's) as [A of columns 0-3 | B of columns 0-3] */
MM_INLINE __m256i mm_gather4(const __m256i *v) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

/* lanes r and r + 4 of a row's sums into y[r] (column r of the group) */
MM_INLINE void mm_finish8(__m256 f, float *y) {
    _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1)));
}

/* MatMul4: one group of 4 columns for rows r0..r0+R-1 (R 1..MM_ROWS_AVX2; each row the same
 * operations whatever R). A column's 32 bytes of codes (blocks A and B) against a row's: the
 * low halves by the even elements, the high by the odd (`vpmaddubsw`: pairs of products in
 * 16 bits, at most 2 x 15 x 127), in pairs to 32 bits, the four columns' gathered into one
 * vector of block sums; plus each block's correction, times the columns' scales and the
 * row's step, added to the row's lanes */
MM_INLINE void group4_avx2(const qrows *x, const uint8_t *c, const float *s, int64_t r0, int R, float *y,
                           int64_t n, int64_t units) {
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    /* scales (column r, block j at 4r + j) -> [block 2h of columns 0-3 | block 2h + 1 of them] */
    const __m256i pick[2] = {_mm256_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13), _mm256_setr_epi32(2, 6, 10, 14, 3, 7, 11, 15)};
    __m256 f[MM_ROWS_AVX2];
    for (int m = 0; m < R; m++) f[m] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; u++, c += 256, s += 16) {
        for (int l = 0; l < 4; l++) MM_PREFETCH(c + MM4_AHEAD * 256 + 64 * l);
        MM_PREFETCH(s + MM4_AHEAD * 16);
        __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        for (int h = 0; h < 2; h++) {
            __m256 sc = _mm256_permutevar8x32_ps(s0, pick[h]); /* (lanes from s0 and s1: two picks) */
            sc = _mm256_blend_ps(sc, _mm256_permutevar8x32_ps(s1, _mm256_sub_epi32(pick[h], _mm256_set1_epi32(8))), 0xCC);
            __m256i lo[MM_GROUP], hi[MM_GROUP];
            for (int r = 0; r < MM_GROUP; r++) {
                __m256i code = _mm256_loadu_si256((const __m256i *)(c + 64 * r + 32 * h));
                lo[r] = _mm256_and_si256(code, nib);
                hi[r] = _mm256_and_si256(_mm256_srli_epi16(code, 4), nib);
            }
            for (int m = 0; m < R; m++) {
                int64_t row = r0 + m, at = row * x->wide_lanes + 8 * (2 * u + h);
                __m256i e = _mm256_loadu_si256((const __m256i *)(x->lo + row * x->width + 64 * u + 32 * h));
                __m256i o = _mm256_loadu_si256((const __m256i *)(x->hi + row * x->width + 64 * u + 32 * h));
                __m256i v[MM_GROUP];
                for (int r = 0; r < MM_GROUP; r++)
                    v[r] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[r], e), _mm256_maddubs_epi16(hi[r], o)), ones);
                __m256i acc = _mm256_add_epi32(mm_gather4(v), _mm256_loadu_si256((const __m256i *)(x->wide_bias + at)));
                f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(sc, _mm256_loadu_ps(x->wide_steps + at)), f[m]);
            }
        }
    }
    for (int m = 0; m < R; m++) mm_finish8(f[m], y + (r0 + m) * n);
}

/* MatMul8: one group of 4 columns for rows r0..r0+R-1 (as group4_avx2). Codes (0..255) and a
 * row's (-127..127, widened once a row) in 16 bits, multiplied in pairs to 32 (`vpmaddwd`: byte
 * products would overflow 16 bits); a unit's blocks A and B of the four columns gathered into
 * one vector */
MM_INLINE void group8_avx2(const qrows *x, const uint8_t *c, const float *s, int64_t r0, int R, float *y,
                           int64_t n, int64_t units) {
    /* scales (column r, block j at 2r + j) -> [block 0 of columns 0-3 | block 1 of them] */
    const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 f[MM_ROWS_AVX2];
    __m256i g8[MM_ROWS_AVX2][2];
    for (int m = 0; m < R; m++) f[m] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; u++, c += MM_GROUP * MM8_UNIT, s += 2 * MM_GROUP) {
        for (int l = 0; l < MM_GROUP; l++) MM_PREFETCH(c + MM8_AHEAD * MM_GROUP * MM8_UNIT + 64 * l);
        MM_PREFETCH(s + MM8_AHEAD * 2 * MM_GROUP);
        __m256 sc = _mm256_permutevar8x32_ps(_mm256_loadu_ps(s), pick);
        for (int half = 0; half < 2; half++) { /* the 4 columns' codes 16 a block at a time */
            __m256i q[MM_GROUP][2];
            for (int r = 0; r < MM_GROUP; r++)
                for (int b = 0; b < 2; b++)
                    q[r][b] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + MM8_UNIT * r + MM8_BLOCK * b + 16 * half)));
            for (int m = 0; m < R; m++) {
                const int16_t *e = x->wide_x + (r0 + m) * x->width + MM8_UNIT * u + 16 * half;
                __m256i x0 = _mm256_loadu_si256((const __m256i *)e), x1 = _mm256_loadu_si256((const __m256i *)(e + MM8_BLOCK));
                __m256i v[MM_GROUP];
                for (int r = 0; r < MM_GROUP; r++) { /* (lanes 0-3: block A's parts, 4-7: B's) */
                    __m256i a = _mm256_madd_epi16(q[r][0], x0), b = _mm256_madd_epi16(q[r][1], x1);
                    v[r] = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
                }
                g8[m][half] = mm_gather4(v);
            }
        }
        for (int m = 0; m < R; m++) {
            int64_t at = (r0 + m) * x->wide_lanes + 8 * u;
            __m256i acc = _mm256_add_epi32(_mm256_add_epi32(g8[m][0], g8[m][1]), _mm256_loadu_si256((const __m256i *)(x->wide_bias + at)));
            f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(sc, _mm256_loadu_ps(x->wide_steps + at)), f[m]);
        }
    }
    for (int m = 0; m < R; m++) mm_finish8(f[m], y + (r0 + m) * n);
}

/* each block's step and correction in each of the lanes of the AVX2 paths' block sums (the
 * four columns' sums of a block: MM_GROUP lanes); MatMul8's codes widened to 16 bits */
static void widen_lanes(qrows *x, int64_t rows) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < x->blocks; b++)
            for (int64_t l = 0; l < MM_GROUP; l++) {
                x->wide_steps[r * x->wide_lanes + b * MM_GROUP + l] = x->steps[r * x->lanes + b];
                x->wide_bias[r * x->wide_lanes + b * MM_GROUP + l] = x->bias[r * x->lanes + b];
            }
    if (x->wide_x)
        for (int64_t i = 0; i < rows * x->width; i++) x->wide_x[i] = x->lo[i];
}
#endif

#if !MM_VECTOR
/* a float16's value */
static float half(uint16_t h) {
    int exp = (h >> 10) & 31, frac = h & 1023;
    float v = exp == 0 ? ldexpf((float)frac, -24) : exp == 31 ? (frac ? NAN : INFINITY) : ldexpf((float)(frac | 1024), exp - 25);
    return h & 0x8000 ? -v : v;
}

/* the same sums in plain C, block by block (one row) */
static void group4_plain(const qrows *x, const uint8_t *c, const float *s, int64_t row, float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < x->blocks; b++) {
            const uint8_t *q = c + (b / MM4_STEP) * 256 + 64 * r + 16 * (b % MM4_STEP);
            const int8_t *e = x->lo + row * x->width + 16 * b, *o = x->hi + row * x->width + 16 * b;
            int32_t dot = x->bias[row * x->lanes + b];
            for (int j = 0; j < 16; j++) dot += (q[j] & 15) * e[j] + (q[j] >> 4) * o[j];
            total += (float)dot * (s[(b / MM4_STEP) * 16 + 4 * r + b % MM4_STEP] * x->steps[row * x->lanes + b]);
        }
        y[row * n + r] = total;
    }
}

static void group6_plain(const qrows *x, const uint8_t *c, const int8_t *mult, const float *base, int64_t row,
                         float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < x->blocks; b++) {
            int64_t sb = b / 16, at = (sb * MM_GROUP + r);
            const int8_t *xq = x->lo + row * x->width + b * MM6_BLOCK;
            int32_t dot = x->bias[row * x->lanes + b];
            for (int j = 0; j < MM6_BLOCK; j++) dot += code6(c + at * MM6_BYTES, (b % 16) * MM6_BLOCK + j) * xq[j];
            total += (float)dot * (((float)mult[at * 16 + b % 16] * base[at]) * x->steps[row * x->lanes + b]);
        }
        y[row * n + r] = total;
    }
}

static void group8_plain(const qrows *x, const uint8_t *c, const float *s, int64_t row, float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < x->blocks; b++) {
            const uint8_t *q = c + (b / 2) * MM_GROUP * MM8_UNIT + MM8_UNIT * r + MM8_BLOCK * (b % 2);
            const int8_t *xq = x->lo + row * x->width + b * MM8_BLOCK;
            int32_t dot = x->bias[row * x->lanes + b];
            for (int j = 0; j < MM8_BLOCK; j++) dot += q[j] * xq[j];
            total += (float)dot * (s[(b / 2) * 2 * MM_GROUP + 2 * r + b % 2] * x->steps[row * x->lanes + b]);
        }
        y[row * n + r] = total;
    }
}

static void group4k_plain(const qrows *x, const uint8_t *c, const uint8_t *mult, const uint16_t *halves,
                          int64_t row, float *y, int64_t n) {
    for (int r = 0; r < MM_GROUP; r++) {
        float total = 0.0f, low = 0.0f;
        for (int64_t b = 0; b < x->blocks; b++) {
            int64_t sb = b / 8;
            const uint8_t *q = c + (b / MM4_STEP) * 256 + 64 * r + 16 * (b % MM4_STEP);
            const int8_t *e = x->lo + row * x->width + 16 * b, *o = x->hi + row * x->width + 16 * b;
            int32_t dot = x->bias[row * x->lanes + b];
            for (int j = 0; j < 16; j++) dot += (q[j] & 15) * e[j] + (q[j] >> 4) * o[j];
            float scale = (float)mult[sb * 64 + 8 * r + b % 8] * half(halves[sb * 8 + r]);
            float minimum = (float)mult[sb * 64 + 32 + 8 * r + b % 8] * half(halves[sb * 8 + 4 + r]);
            total += (float)dot * (scale * x->steps[row * x->lanes + b]);
            low += (scale * MM4K_SHIFT + minimum) * x->sums[row * x->sum_width + MM4K_SUMS * sb + b % 8];
        }
        y[row * n + r] = total + low;
    }
}
#endif

static void *mm_run(void *arg) {
    const mm_part *p = (const mm_part *)arg;
    const qrows *x = p->x;
    /* a group's bytes: MatMul4 codes and scales a step; MatMul6 and MatMul4K codes, multiples,
     * bases a super-block; MatMul8 codes and scales 64 weights */
    int64_t units = p->kind == MM4 ? x->blocks / MM4_STEP
                  : p->kind == MM6 ? x->blocks * MM6_BLOCK / MM6_SUPER
                  : p->kind == MM8 ? x->blocks / 2 : x->blocks * MM4_BLOCK / MM4K_SUPER;
    int64_t unit_bytes = p->kind == MM4 ? 256 : p->kind == MM6 ? MM_GROUP * MM6_BYTES
                       : p->kind == MM8 ? MM_GROUP * MM8_UNIT : 512;
#if MM_VECTOR
    /* rows a band: as many as the second-level cache holds beside the codes (every group reads
     * all of a band's quantized rows: past that cache, each group read them from the third) */
    int64_t row_bytes = 2 * x->width + 2 * x->lanes * (int64_t)sizeof(float) + x->sum_width * (int64_t)sizeof(float);
    int64_t most_band = MM_BAND_BYTES / row_bytes > MM_ROWS ? MM_BAND_BYTES / row_bytes : MM_ROWS;
    int64_t bands = (p->rows + most_band - 1) / most_band; /* (as even as they go) */
    for (int64_t band = 0, b0 = 0; band < bands; band++) {
    int64_t rows = p->rows / bands + (band < p->rows % bands);
    int64_t most = p->kind == MM4K ? MM4K_ROWS : MM_ROWS, tiles = (rows + most - 1) / most;
    for (int64_t g = p->g0; g < p->g1; g++) {
        const uint8_t *c = p->codes + g * units * unit_bytes;
        const float *s4 = (const float *)p->scales + g * units * 16;
        const int8_t *m6 = (const int8_t *)p->scales + g * units * MM_GROUP * 16;
        const float *b6 = (const float *)p->base + g * units * MM_GROUP;
        const uint8_t *m4k = (const uint8_t *)p->scales + g * units * 64;
        const uint16_t *b4k = (const uint16_t *)p->base + g * units * 8;
        const float *s8 = (const float *)p->scales + g * units * 2 * MM_GROUP;
        float *y = p->y + g * MM_GROUP;
        /* rows in tiles of 1-4, as even as they go (a lone row costs nearly what four do: the
         * group's codes are unpacked once a tile) */
        for (int64_t t = 0, r = b0; t < tiles; t++) {
            int64_t size = rows / tiles + (t < rows % tiles);
#define MM_TILE(R)                                                                                  \
    (p->kind == MM4   ? group4_vector(x, c, s4, r, R, y, p->n, units)                               \
     : p->kind == MM6 ? group6_vector(x, c, m6, b6, r, R, y, p->n, units)                           \
     : p->kind == MM8 ? group8_vector(x, c, s8, r, R, y, p->n, units)                               \
                      : group4k_vector(x, c, m4k, b4k, r, R, y, p->n, units))
            switch (size) {
            case 4: MM_TILE(4); break;
            case 3: MM_TILE(3); break;
            case 2: MM_TILE(2); break;
            default: MM_TILE(1); break;
            }
#undef MM_TILE
            r += size;
        }
    }
    b0 += rows;
    }
#else
#if MM_AVX2
    if (p->kind == MM4 || p->kind == MM8) {
        /* rows in bands the second-level cache holds (as the AVX-512 path), tiles of 1-2 */
        int64_t row_bytes = 2 * x->width + 2 * x->wide_lanes * (int64_t)sizeof(float);
        int64_t most_band = MM_BAND_BYTES / row_bytes > MM_ROWS_AVX2 ? MM_BAND_BYTES / row_bytes : MM_ROWS_AVX2;
        for (int64_t b0 = 0; b0 < p->rows; b0 += most_band) {
            int64_t end = b0 + most_band < p->rows ? b0 + most_band : p->rows;
            for (int64_t g = p->g0; g < p->g1; g++) {
                const uint8_t *c = p->codes + g * units * unit_bytes;
                const float *s = (const float *)p->scales + g * units * (p->kind == MM4 ? 16 : 2 * MM_GROUP);
                float *y = p->y + g * MM_GROUP;
                for (int64_t r = b0; r < end; r += MM_ROWS_AVX2) {
                    int64_t size = end - r < MM_ROWS_AVX2 ? end - r : MM_ROWS_AVX2;
#define MM_TILE2(R) (p->kind == MM4 ? group4_avx2(x, c, s, r, R, y, p->n, units) : group8_avx2(x, c, s, r, R, y, p->n, units))
                    switch (size) {
                    case 4: MM_TILE2(4); break;
                    case 3: MM_TILE2(3); break;
                    case 2: MM_TILE2(2); break;
                    default: MM_TILE2(1); break;
                    }
#undef MM_TILE2
                }
            }
        }
        return NULL;
    }
#endif
    for (int64_t g = p->g0; g < p->g1; g++) {
        const uint8_t *c = p->codes + g * units * unit_bytes;
        for (int64_t r = 0; r < p->rows; r++) {
            if (p->kind == MM4) group4_plain(x, c, (const float *)p->scales + g * units * 16, r, p->y + g * MM_GROUP, p->n);
            else if (p->kind == MM8)
                group8_plain(x, c, (const float *)p->scales + g * units * 2 * MM_GROUP, r, p->y + g * MM_GROUP, p->n);
            else if (p->kind == MM4K)
                group4k_plain(x, c, (const uint8_t *)p->scales + g * units * 64,
                              (const uint16_t *)p->base + g * units * 8, r, p->y + g * MM_GROUP, p->n);
            else group6_plain(x, c, (const int8_t *)p->scales + g * units * MM_GROUP * 16,
                              (const float *)p->base + g * units * MM_GROUP,
                              r, p->y + g * MM_GROUP, p->n);
        }
    }
#endif
    return NULL;
}

static void mm_indexed(void *parts, size_t i) { mm_run((mm_part *)parts + i); }

/* whether the weights' shapes fit K and N (the graph is ours: never expected otherwise) */
static int fits(const mm_state *st, const int64_t (*d)[MM_MAX_RANK], const size_t *rank) {
    int64_t k = st->k, n = st->n, groups = n / MM_GROUP;
    if (n % MM_GROUP || d[1][0] != groups || d[1][2] != MM_GROUP) return 0;
    if (st->kind == MM4) {
        int64_t blocks = d[1][1] * MM4_STEP;
        return rank[1] == 4 && rank[2] == 4 && d[1][3] == 64 && blocks * MM4_BLOCK >= k &&
               (blocks - MM4_STEP) * MM4_BLOCK < k && d[2][0] == groups && d[2][1] == d[1][1] &&
               d[2][2] == MM_GROUP && d[2][3] == MM4_STEP;
    }
    if (st->kind == MM8)
        return k % MM8_UNIT == 0 && rank[1] == 4 && rank[2] == 4 && d[1][1] == k / MM8_UNIT && d[1][3] == MM8_UNIT &&
               d[2][0] == groups && d[2][1] == k / MM8_UNIT && d[2][2] == MM_GROUP && d[2][3] == 2 && st->zero >= 0 &&
               st->zero <= 255;
    if (st->kind == MM4K) {
        int64_t supers = k / MM4K_SUPER;
        return k % MM4K_SUPER == 0 && rank[1] == 4 && rank[2] == 5 && rank[3] == 3 && d[1][1] == 2 * supers &&
               d[1][3] == 64 && d[2][0] == groups && d[2][1] == supers && d[2][2] == 2 && d[2][3] == MM_GROUP &&
               d[2][4] == 8 && d[3][0] == groups && d[3][1] == supers && d[3][2] == 8;
    }
    int64_t supers = k / MM6_SUPER;
    return k % MM6_SUPER == 0 && rank[1] == 4 && rank[2] == 4 && rank[3] == 3 && d[1][1] == supers &&
           d[1][3] == MM6_BYTES && d[2][0] == groups && d[2][1] == supers && d[2][2] == MM_GROUP && d[2][3] == 16 &&
           d[3][0] == groups && d[3][1] == supers && d[3][2] == MM_GROUP && st->zero >= 0 && st->zero <= 255;
}

static void mm_compute(void *state, void *ctx) {
    const mm_state *st = (const mm_state *)state;
    api_t api = st->api;
    size_t count = st->kind == MM4 || st->kind == MM8 ? 3 : 4, rank[4] = {0};
    const void *in[4] = {NULL};
    int64_t d[4][MM_MAX_RANK];
    void *data[4] = {NULL};
    for (size_t i = 0; i < count; i++)
        if (!ok(api, CALL(api, INPUT, input_fn)(ctx, i, &in[i])) || !in[i] || !(rank[i] = dims_of(api, in[i], d[i], MM_MAX_RANK)) ||
            !ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(in[i], &data[i])))
            return;
    int64_t rows = 1, k = st->k, n = st->n, out_dims[MM_MAX_RANK];
    for (size_t i = 0; i + 1 < rank[0]; i++) rows *= d[0][i], out_dims[i] = d[0][i];
    out_dims[rank[0] - 1] = n;
    void *out_value = NULL, *y = NULL;
    if (!ok(api, CALL(api, OUTPUT, output_fn)(ctx, 0, out_dims, rank[0], &out_value)) || !out_value ||
        !ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(out_value, &y)))
        return;
    memset(y, 0, (size_t)(rows * n) * sizeof(float));
    if (rows < 1 || d[0][rank[0] - 1] != k || !fits(st, (const int64_t(*)[MM_MAX_RANK])d, rank)) return; /* zeros */
    int split = st->kind == MM4 || st->kind == MM4K, summed = st->kind == MM4K;
    int64_t block = split ? MM4_BLOCK : st->kind == MM8 ? MM8_BLOCK : MM6_BLOCK;
    int64_t blocks = split ? d[1][1] * MM4_STEP : k / block;
    /* each row's codes and steps padded by a cache line: rows a power of two apart would share
     * the first-level cache's sets (K = 8,192: a tile's rows thrashed it) */
    int64_t width = (split ? blocks * MM4_BLOCK / 2 : k) + MM_PAD, lanes = blocks + MM_PAD / 4;
    size_t code_bytes = (size_t)(rows * width), lane_bytes = (size_t)(rows * lanes) * sizeof(float);
    int64_t sum_width = summed ? blocks / 8 * MM4K_SUMS + MM_PAD / 4 : 0;
    size_t sum_bytes = (size_t)(rows * sum_width) * sizeof(float);
    /* (AVX2: each block's step and correction in each of its MM_GROUP lanes) */
    int per = MM_AVX2 && (st->kind == MM4 || st->kind == MM8);
    int64_t wide_lanes = per ? blocks * MM_GROUP + MM_PAD / 4 : 0;
    size_t wide_bytes = (size_t)(rows * wide_lanes) * sizeof(float);
    size_t x16_bytes = MM_AVX2 && st->kind == MM8 ? 2 * code_bytes : 0;
    char *scratch = (char *)malloc(2 * code_bytes + 2 * lane_bytes + sum_bytes + 2 * wide_bytes + x16_bytes);
    if (!scratch) return;
    char *wide = scratch + 2 * code_bytes + 2 * lane_bytes + sum_bytes;
    qrows x = {.lo = (int8_t *)scratch, .hi = (int8_t *)(scratch + code_bytes),
               .steps = (float *)(scratch + 2 * code_bytes), .bias = (int32_t *)(scratch + 2 * code_bytes + lane_bytes),
               .sums = summed ? (float *)(scratch + 2 * code_bytes + 2 * lane_bytes) : NULL,
               .wide_steps = per ? (float *)wide : NULL, .wide_bias = per ? (int32_t *)(wide + wide_bytes) : NULL,
               .wide_lanes = wide_lanes, .wide_x = x16_bytes ? (int16_t *)(wide + 2 * wide_bytes) : NULL, .blocks = blocks, .width = width, .lanes = lanes, .sum_width = sum_width};
    for (int64_t r = 0; r < rows; r++)
        quantize_a((const float *)data[0] + r * k, k, blocks, block, split, split ? 8 : st->zero, x.lo + r * width,
                   x.hi + r * width, x.steps + r * lanes, x.bias + r * lanes,
                   summed ? x.sums + r * sum_width : NULL);
#if MM_AVX2
    if (per) widen_lanes(&x, rows);
#endif
    int64_t groups = n / MM_GROUP, threads = st->threads < MM_THREADS ? st->threads : MM_THREADS;
    threads = rows * n * k < MM_PARALLEL ? 1 : threads < groups ? threads : groups;
    mm_part parts[MM_THREADS];
    for (int64_t t = 0; t < threads; t++)
        parts[t] = (mm_part){&x, st->kind, (const uint8_t *)data[1], data[2], count > 3 ? data[3] : NULL,
                             (float *)y, rows, n, groups * t / threads, groups * (t + 1) / threads};
    run_parts(api, ctx, mm_run, mm_indexed, parts, sizeof(mm_part), threads);
    free(scratch);
}

typedef struct {
    struct custom_op op;
    const char *op_name;
    int kind;
} mm_op;

static int mm_kind(const struct custom_op *op) { return ((const mm_op *)op)->kind; }

static void *mm_create(const struct custom_op *op, api_t api, const void *info) {
    mm_state *st = (mm_state *)calloc(1, sizeof(mm_state));
    if (!st) return NULL;
    st->api = api;
    st->kind = mm_kind(op);
    if (CALL(api, ATTR_INT, attr_int_fn)(info, "K", &st->k) || CALL(api, ATTR_INT, attr_int_fn)(info, "N", &st->n) ||
        st->k < 1 || st->n < 1)
        st->k = st->n = 0; /* compute() then refuses every input (zeros) */
    st->zero = 32;
    (void)CALL(api, ATTR_INT, attr_int_fn)(info, "zero", &st->zero);
    st->threads = 1;
    (void)CALL(api, ATTR_INT, attr_int_fn)(info, "threads", &st->threads);
    st->threads = st->threads < 1 ? 1 : st->threads;
    return st;
}

static void mm_destroy(void *state) { free(state); }
static const char *mm_name(const struct custom_op *op) { return ((const mm_op *)op)->op_name; }
static const char *mm_provider(const struct custom_op *op) { (void)op; return "CPUExecutionProvider"; }
static int mm_input_type(const struct custom_op *op, size_t i) {
    int kind = mm_kind(op);
    return i == 1 ? ELEM_UINT8
         : i == 2 ? (kind == MM4 || kind == MM8 ? ELEM_FLOAT : kind == MM6 ? ELEM_INT8 : ELEM_UINT8)
         : i == 3 && kind == MM4K ? ELEM_FLOAT16 : ELEM_FLOAT;
}
static size_t mm_input_count(const struct custom_op *op) { return mm_kind(op) == MM4 || mm_kind(op) == MM8 ? 3 : 4; }
static int mm_output_type(const struct custom_op *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t mm_output_count(const struct custom_op *op) { (void)op; return 1; }
static int mm_required(const struct custom_op *op, size_t i) { (void)op; (void)i; return 0; }

#define MM_OP(label, kind)                                                                                      \
    {{OP_VERSION, mm_create, mm_name, mm_provider, mm_input_type, mm_input_count, mm_output_type, mm_output_count, \
      mm_compute, mm_destroy, mm_required, mm_required},                                                         \
     label, kind}

static const mm_op matmul_ops[4] = {MM_OP("MatMul4", MM4), MM_OP("MatMul6", MM6), MM_OP("MatMul4K", MM4K),
                                    MM_OP("MatMul8", MM8)};

/* the operators for RegisterCustomOps (engine/attend.c): i < 4, else NULL */
const struct custom_op *matmul_op(int i) { return i >= 0 && i < 4 ? &matmul_ops[i].op : NULL; }
