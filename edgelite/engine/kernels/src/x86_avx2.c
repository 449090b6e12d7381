/* The AVX2 path (AVX2, FMA, F16C; chosen where cpuid says the CPU and the OS have them):
 * MatMul4 and MatMul8 in 8 lanes (MatMul4K and MatMul6 stay the reference's: onnxruntime's
 * MatMulNBits is faster than them here, and engine/passes/linear.py leaves those), the attention's
 * float tiles compiled for this ISA and the int8 one's whole blocks by i8_avx2.h. The same bits
 * as the reference (kernels.h's canonical order).
 *
 * A product works on a group of 4 columns and a tile of 1-4 rows. A row's running sums are two
 * registers: [s0 | s1] and [s2 | s3] of the four columns (lane 4 h + c: column c's s[2k + h] in
 * register k), each half of a unit (two blocks) fused into one of them. A block's integer sum
 * comes whole out of vpmaddubsw (MatMul4: pairs of code x element products in 16 bits, at most
 * 2 x 15 x 127) or vpmaddwd (MatMul8: each row widened to 16 bits once; byte products would
 * overflow) and the four columns' gathered by vphaddd. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MM_ROWS 4 /* rows a tile */
#define MM_PREFETCH(p) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p)))
#define MM_INLINE static inline __attribute__((always_inline))

/* this path's layout of the rows: each block's step and correction in each of its 4 lanes
 * (wide_steps, wide_bias: `wide` a row); MatMul8: the codes widened to 16 bits (width a row) */
typedef struct {
    float *wide_steps;
    int32_t *wide_bias;
    int16_t *wide_x;
    int64_t wide;
} rows_avx2;

static int prep(qrows *x, int kind) {
    int64_t wide = x->blocks * MM_GROUP + MM_PAD / 4;
    size_t lanes = (size_t)(x->rows * wide), x16 = kind == MM8 ? (size_t)(x->rows * x->width) : 0;
    char *mem = (char *)malloc(sizeof(rows_avx2) + 32 + lanes * 8 + x16 * 2);
    if (!mem) return 0;
    rows_avx2 *own = (rows_avx2 *)mem;
    char *at = (char *)(((uintptr_t)(mem + sizeof(rows_avx2)) + 31) & ~(uintptr_t)31);
    *own = (rows_avx2){(float *)at, (int32_t *)(at + lanes * 4), x16 ? (int16_t *)(at + lanes * 8) : NULL, wide};
    for (int64_t r = 0; r < x->rows; r++)
        for (int64_t b = 0; b < x->blocks; b++)
            for (int64_t l = 0; l < MM_GROUP; l++) {
                own->wide_steps[r * wide + b * MM_GROUP + l] = x->steps[r * x->lanes + b];
                own->wide_bias[r * wide + b * MM_GROUP + l] = x->bias[r * x->lanes + b];
            }
    for (size_t i = 0; i < x16; i++) own->wide_x[i] = x->lo[i];
    x->own = mem;
    return 1;
}

/* the four columns' integer sums of blocks A and B (v[r]: column r's, lanes 0-3 block A's
 * parts, 4-7 B's) as [A of columns 0-3 | B of columns 0-3] */
MM_INLINE __m256i gather4(const __m256i *v) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

/* the canonical end of a row's sums: (s0 + s1) + (s2 + s3) of each column */
MM_INLINE void finish(const __m256 *f, float *y) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(f[0]), _mm256_extractf128_ps(f[0], 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(f[1]), _mm256_extractf128_ps(f[1], 1));
    _mm_storeu_ps(y, _mm_add_ps(a, b));
}

MM_INLINE __m256 fold(__m256 f, __m256i t, const rows_avx2 *w, int64_t row, int64_t b0, __m256 scale) {
    int64_t at = row * w->wide + MM_GROUP * b0;
    __m256i acc = _mm256_add_epi32(t, _mm256_loadu_si256((const __m256i *)(w->wide_bias + at)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(scale, _mm256_loadu_ps(w->wide_steps + at)), f);
}

/* MatMul4: a unit's half h (blocks 2h, 2h + 1 of its 4) into register h of each row */
MM_INLINE void group4(const qrows *x, const uint8_t *c, const float *s, int64_t r0, const int R, float *y, int64_t n,
                      int64_t units) {
    const rows_avx2 *w = (const rows_avx2 *)x->own;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    /* scales (column r, block j at 4r + j) -> [block 2h of columns 0-3 | block 2h + 1 of them] */
    const __m256i pick[2] = {_mm256_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13), _mm256_setr_epi32(2, 6, 10, 14, 3, 7, 11, 15)};
    __m256 f[MM_ROWS][2];
    for (int m = 0; m < R; m++) f[m][0] = f[m][1] = _mm256_setzero_ps();
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
                int64_t row = r0 + m;
                __m256i e = _mm256_loadu_si256((const __m256i *)(x->lo + row * x->width + 64 * u + 32 * h));
                __m256i o = _mm256_loadu_si256((const __m256i *)(x->hi + row * x->width + 64 * u + 32 * h));
                __m256i v[MM_GROUP];
                for (int r = 0; r < MM_GROUP; r++)
                    v[r] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[r], e), _mm256_maddubs_epi16(hi[r], o)), ones);
                f[m][h] = fold(f[m][h], gather4(v), w, row, 4 * u + 2 * h, sc);
            }
        }
    }
    for (int m = 0; m < R; m++) finish(f[m], y + (r0 + m) * n);
}

/* MatMul8: unit u's two blocks into register u % 2 of each row. Codes (0..255) and a row's
 * (-127..127) in 16 bits, multiplied in pairs to 32 */
MM_INLINE void group8(const qrows *x, const uint8_t *c, const float *s, int64_t r0, const int R, float *y, int64_t n,
                      int64_t units) {
    const rows_avx2 *w = (const rows_avx2 *)x->own;
    /* scales (column r, block j at 2r + j) -> [block 0 of columns 0-3 | block 1 of them] */
    const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 f[MM_ROWS][2];
    __m256i g8[MM_ROWS][2];
    for (int m = 0; m < R; m++) f[m][0] = f[m][1] = _mm256_setzero_ps();
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
                const int16_t *e = w->wide_x + (r0 + m) * x->width + MM8_UNIT * u + 16 * half;
                __m256i x0 = _mm256_loadu_si256((const __m256i *)e), x1 = _mm256_loadu_si256((const __m256i *)(e + MM8_BLOCK));
                __m256i v[MM_GROUP];
                for (int r = 0; r < MM_GROUP; r++) { /* (lanes 0-3: block A's parts, 4-7: B's) */
                    __m256i a = _mm256_madd_epi16(q[r][0], x0), b = _mm256_madd_epi16(q[r][1], x1);
                    v[r] = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
                }
                g8[m][half] = gather4(v);
            }
        }
        for (int m = 0; m < R; m++)
            f[m][u % 2] = fold(f[m][u % 2], _mm256_add_epi32(g8[m][0], g8[m][1]), w, r0 + m, 2 * u, sc);
    }
    for (int m = 0; m < R; m++) finish(f[m], y + (r0 + m) * n);
}

/* a thread's column groups over its rows: in bands the second-level cache holds, tiles of
 * 1-4 rows */
static void matmul_avx2(const mm_job *p) {
    const qrows *x = p->x;
    const rows_avx2 *w = (const rows_avx2 *)x->own;
    int64_t row_bytes = 2 * x->width + 2 * w->wide * (int64_t)sizeof(float);
    int64_t most_band = MM_BAND_BYTES / row_bytes > MM_ROWS ? MM_BAND_BYTES / row_bytes : MM_ROWS;
    for (int64_t b0 = 0; b0 < p->rows; b0 += most_band) {
        int64_t end = b0 + most_band < p->rows ? b0 + most_band : p->rows;
        for (int64_t g = p->g0; g < p->g1; g++) {
            const uint8_t *c = p->codes + g * p->units * p->unit_bytes;
            const float *s = (const float *)p->scales + g * p->units * (p->kind == MM4 ? 16 : 2 * MM_GROUP);
            float *y = p->y + g * MM_GROUP;
            for (int64_t r = b0; r < end; r += MM_ROWS) {
                int64_t size = end - r < MM_ROWS ? end - r : MM_ROWS;
#define TILE(R) (p->kind == MM4 ? group4(x, c, s, r, R, y, p->n, p->units) : group8(x, c, s, r, R, y, p->n, p->units))
                switch (size) {
                case 4: TILE(4); break;
                case 3: TILE(3); break;
                case 2: TILE(2); break;
                default: TILE(1); break;
                }
#undef TILE
            }
        }
    }
}

/* ---- attention ---------------------------------------------------------------------------- */
#define ATTEND_SPECIALIZE 1
#include "attend_float.h"
#include "i8_avx2.h"
#include "attend_i8.h"
#include "norm.h"

const kpath kpath_avx2 = {
    .name = "avx2",
    .needs = FEAT_AVX2,
    .matmul = {[MM4] = matmul_avx2, [MM8] = matmul_avx2},
    .prep = {[MM4] = prep, [MM8] = prep},
    .attend = {attend_f32, attend_f16, attend_i8_kv},
    .norm = norm_rows,
};
