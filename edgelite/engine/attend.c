/* edgelite's attention kernel: an onnxruntime custom operator, compiled on the device that
 * runs it (engine/kernel.py) and used by engine/attention.py.
 *
 * Operators (domain "edgelite"): Attend (float32 KV), Attend16 (float16 KV) and Attend8 (int8
 * KV: a row of d codes, then its step as an exponent byte e and a mantissa byte b, the values
 * code * 2^e * (1 + (b + 128) / 256): exact in float32). Each does a layer's whole attention
 * step, what GroupQueryAttention does: it turns the step's queries and keys by the rotary
 * tables, writes the keys and values into the KV at the step's positions (below, before
 * compute()), and attends. RegisterCustomOps, at the end, registers engine/matmul.c's products
 * in the same domain (one library: engine/kernel.py builds both files).
 *   inputs:  q       float32 (1, n, heads * d), not yet turned
 *            k, v    float32 (1, n, kv_heads * d): the step's keys (not yet turned) and values
 *            key     (1, kv_heads, capacity, d) (int8: d + 2): the KV, bound in place
 *            value   (1, kv_heads, capacity, d) (int8: d + 2)
 *            total   int64 (1): the positions valid after this step (the step's rows are the
 *                    last n of them)
 *            cos, sin  float32 (positions, rot / 2), optional: the rotary tables (none: no turn)
 *   outputs: float32 (1, n, heads * d); key and value with the step's rows written (where
 *            they are bound to the inputs' buffers, as engine/kv.py binds them, nothing else
 *            is copied)
 *   attributes: num_heads, kv_num_heads, local_window_size (-1: none), scale (0: d^-1/2)
 *
 * Each row attends to its own causal window only and is computed by the same sequence of
 * float operations whatever the step holds (fixed-lane dot products, sums in position order,
 * no fast-math): a row comes out bit for bit the same in any chunking. Attend8 works in integers
 * (below: query and softmax weights as 8-bit codes against the KV's int8 codes, exact int32
 * sums), so its rows are also the same with or without AVX-512 VNNI, which it uses where the
 * compiler targets it. The rows of a step go
 * in tiles that read each KV position once per tile and KV head (the group's query heads
 * share the read), so a decode step reads the valid KV once and a prompt chunk once a tile.
 *
 * A prompt chunk's tiles run on onnxruntime's own intra-op threads (KernelContext_ParallelFor,
 * onnxruntime 1.17 on), so they never compete with its workers, which spin between a run's
 * operators; with an older onnxruntime, on threads of their own.
 *
 * The onnxruntime C API is used through its function table (OrtApi), whose order is fixed
 * across versions: only the entries named below, all present since onnxruntime 1.x's first
 * API versions but the pool's, used only where the runtime's version has it (this file asks
 * for version 12; 1.29 and 1.32 load it). No onnxruntime header is needed to build this
 * file. */

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ortop.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 }; /* what a KV row holds */
int has_pool; /* the loading onnxruntime has KernelContext_ParallelFor */

typedef struct {
    struct custom_op op;
    const char *op_name;
    int kind; /* KV_* */
} attend_op;

typedef struct {
    api_t api;
    int kind;
    int64_t heads, kv_heads, window, threads;
    float scale;
} kernel;

#define LANES 8 /* float lanes of the vector type below (two registers on 128-bit NEON) */
#define BLOCK 32 /* KV positions widened at a time */
#define MAX_D 256 /* the largest head size */
#define TILE_ROWS 16 /* query rows that share each KV block's reading */
#define TILE_BYTES (1 << 19) /* a tile's scores at most (fewer rows at long contexts) */
#define MAX_THREADS 16 /* threads a call may use (the session's intra-op threads, attribute "threads") */
#define PARALLEL_WORK 65536 /* rows x positions below which a call runs on its caller's thread */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof(v)); }

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }

static inline float lanes_sum(vf v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* lane l: lanes_sum(a[l]), the same sums in the same order, for 8 vectors at once */
static inline vf lanes_sum8(const vf *a) {
    vf s[4], u[2];
    for (int i = 0; i < 4; i++)
        s[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = SHUFFLE(s[2 * i], s[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(s[2 * i], s[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

#if defined(__F16C__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

static inline float widen(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* lanes_sum of 4 vectors into out[0..3], the same sums in the same order (with AVX: pairs of
 * neighbours, pairs of those, then the two halves, lanes_sum's tree in three hadds; the
 * generic shuffles below came out as 37 instructions a vector, scalar adds among them) */
static inline void lanes_sum4(const vf *a, float *out) {
#if defined(__AVX__) && defined(__F16C__)
    __m256 h01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), h23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 h = _mm256_hadd_ps(h01, h23);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    vf s0 = SHUFFLE(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
    vf s1 = SHUFFLE(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
    vf u = SHUFFLE(s0, s1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(s0, s1, 2, 3, 10, 11, 6, 7, 14, 15);
    for (int l = 0; l < 4; l++) out[l] = u[l] + u[l + 4];
#endif
}

/* n float16 values as float32 (exact either way: the hardware's conversion where it has one) */
static void widen_n(const uint16_t *h, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
#endif
    for (; i < n; i++) out[i] = widen(h[i]);
}

#define INLINE static inline __attribute__((always_inline))

/* one cache line asked into the core's second-level cache ahead of its use, as an instruction
 * of its own (measured: GCC 12's dead-code pass dropped __builtin_prefetch from these loops) */
#if defined(__x86_64__) || defined(__i386__)
#define PREFETCH(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
#else
#define PREFETCH(p) __builtin_prefetch(p, 0, 2)
#endif
/* blocks of int8 positions asked for ahead (measured at 4,000 positions, 30 layers: 136 us a
 * layer with none beyond the hardware's own, 86 with 4 blocks into the second-level cache, 140
 * into the first; for float16 and float32 rows, 4-8 KB a block, any made it slower) */
#define AHEAD 4

/* the lines of rows `first`..`last` (clipped to `end`) of a plane with `row` bytes a row */
INLINE void prefetch_rows(const void *plane, int64_t first, int64_t last, int64_t end, int64_t row) {
    if (first > end) return;
    last = last < end ? last : end;
    const char *at = (const char *)plane + first * row, *stop = (const char *)plane + (last + 1) * row;
    for (; at < stop; at += 64) PREFETCH(at);
    PREFETCH(stop - 1);
}

/* q . k over d values (a multiple of LANES) */
INLINE float dot(const float *q, const float *k, int64_t d) {
    vf acc = splat(0.0f);
    for (int64_t i = 0; i < d; i += LANES) acc += load(q + i) * load(k + i);
    return lanes_sum(acc);
}

/* an int8 row's step: 2^e (1 + (b + 128) / 256) from its two bytes after the d codes */
INLINE float row_step(const void *plane, int64_t j, int64_t d) {
    const int8_t *row = (const int8_t *)plane + j * (d + 2);
    float m = 1.0f + (float)(row[d + 1] + 128) * (1.0f / 256.0f), p;
    if (row[d] < -126) return ldexpf(m, row[d]); /* (2^e itself would be subnormal) */
    uint32_t bits = (uint32_t)(row[d] + 127) << 23; /* 2^e */
    memcpy(&p, &bits, 4);
    return m * p;
}

/* rows first..first+count-1 of one KV head's plane (float32 or float16) as float32: in place
 * for a float32 KV, else widened into buf */
INLINE const float *rows_f32(const void *plane, int64_t first, int64_t count, int64_t d, int kind, float *buf) {
    if (kind == KV_F32) return (const float *)plane + first * d;
    widen_n((const uint16_t *)plane + first * d, buf, count * d);
    return buf;
}

/* LANES values of a float32 or float16 KV plane from element `at`, as float32 */
INLINE vf load_kv(const void *plane, int64_t at, int kind) {
    if (kind == KV_F32) return load((const float *)plane + at);
    const uint16_t *h = (const uint16_t *)plane + at;
#if defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    float32x4_t lo = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
    float32x4_t hi = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + 4)));
    vf v;
    memcpy(&v, &lo, sizeof(lo));
    memcpy((char *)&v + sizeof(lo), &hi, sizeof(hi));
    return v;
#else
    float t[LANES];
    widen_n(h, t, LANES);
    return load(t);
#endif
}

/* q . (the KV plane's row j of d values) */
INLINE float dot_kv(const float *q, const void *plane, int64_t j, int64_t d, int kind) {
    vf acc = splat(0.0f);
    for (int64_t i = 0; i < d; i += LANES) acc += load(q + i) * load_kv(plane, j * d + i, kind);
    return lanes_sum(acc);
}

/* e^x for x <= 0 (a score less the row's largest), a vector at a time: x = n ln2 + r with
 * |r| <= ln2/2 (ln2 in two parts), e^r by a degree-7 polynomial (Cephes' expf
 * coefficients), times 2^n built in the exponent bits. Below EXP_FLOOR it is exactly 0: such
 * a weight is lost in a sum of at least 1 anyway, and divided by the sum it would make
 * subnormal floats, which cost the products that meet them a hundred cycles each.
 * exps: e^x in place of each of count scores less their largest; returns their sum. One body
 * for two widths: LANES (softmax, the float KVs' rows: the sums they always had) and WIDE
 * (the int8 KV's rows, whose weights become 8-bit codes) */
#define EXP_FLOOR -72.0f /* e^-72 / 2^20 positions is still a normal float */
#define WIDE 16
#define WIDE_HEADS 4 /* query heads a KV head whose value sums take WIDE-lane registers */
typedef float wf __attribute__((vector_size(WIDE * 4)));
typedef int32_t wi __attribute__((vector_size(WIDE * 4)));

static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }
static inline wf wpick(wi mask, wf yes, wf no) { return (wf)(((wi)yes & mask) | ((wi)no & ~mask)); }

static inline wf wsplat(float x) {
    wf v;
    for (int l = 0; l < WIDE; l++) v[l] = x;
    return v;
}

static inline float wsum(wf v) {
    float total = 0.0f;
    for (int l = 0; l < WIDE; l++) total += v[l];
    return total;
}

#define EXPS_FN(EXP, EXPS, V, I, N, SPLAT, PICK, SUM)                                             \
    static inline V EXP(V x) {                                                                    \
        I under = x < SPLAT(EXP_FLOOR);                                                           \
        x = PICK(under, SPLAT(EXP_FLOOR), x);                                                     \
        V t = x * SPLAT(1.44269504088896341f) + SPLAT(0.5f);                                      \
        I n = __builtin_convertvector(t, I); /* toward zero: one too high where t < 0 */         \
        n = n + (I)(__builtin_convertvector(n, V) > t); /* (true is -1): now floor(t) */         \
        V nf = __builtin_convertvector(n, V);                                                     \
        V r = x - nf * SPLAT(0.693359375f);                                                       \
        r = r - nf * SPLAT(-2.12194440e-4f);                                                      \
        V p = SPLAT(1.9875691500e-4f);                                                            \
        p = p * r + SPLAT(1.3981999507e-3f);                                                      \
        p = p * r + SPLAT(8.3334519073e-3f);                                                      \
        p = p * r + SPLAT(4.1665795894e-2f);                                                      \
        p = p * r + SPLAT(1.6666665459e-1f);                                                      \
        p = p * r + SPLAT(5.0000001201e-1f);                                                      \
        p = p * (r * r) + r + SPLAT(1.0f);                                                        \
        return PICK(under, SPLAT(0.0f), p * (V)((n + 127) << 23));                                \
    }                                                                                             \
    static float EXPS(float *s, int64_t count) {                                                  \
        int64_t j = 0;                                                                            \
        V top = SPLAT(-INFINITY), sums = SPLAT(0.0f), x;                                          \
        for (; j + N <= count; j += N) {                                                          \
            memcpy(&x, s + j, sizeof(x));                                                         \
            top = PICK(x > top, x, top);                                                          \
        }                                                                                         \
        float best = -INFINITY;                                                                   \
        for (int l = 0; l < N; l++) best = top[l] > best ? top[l] : best;                         \
        for (; j < count; j++) best = s[j] > best ? s[j] : best;                                  \
        V b = SPLAT(best);                                                                        \
        for (j = 0; j + N <= count; j += N) {                                                     \
            memcpy(&x, s + j, sizeof(x));                                                         \
            V e = EXP(x - b);                                                                     \
            memcpy(s + j, &e, sizeof(e));                                                         \
            sums += e;                                                                            \
        }                                                                                         \
        if (j < count) { /* the tail, padded with -inf (weight 0: counted nowhere) */             \
            float tail[N];                                                                        \
            for (int l = 0; l < N; l++) tail[l] = j + l < count ? s[j + l] : -INFINITY;           \
            memcpy(&x, tail, sizeof(x));                                                          \
            V e = EXP(x - b);                                                                     \
            for (int l = 0; l < N && j + l < count; l++) {                                        \
                s[j + l] = e[l];                                                                  \
                sums[l] += e[l];                                                                  \
            }                                                                                     \
        }                                                                                         \
        return SUM(sums);                                                                         \
    }
EXPS_FN(exp_neg, exps, vf, vi, LANES, splat, pick, lanes_sum)
#if defined(__AVX512F__)
EXPS_FN(exp_neg_wide, exps_wide, wf, wi, WIDE, wsplat, wpick, wsum)
#else
/* exps_wide in two halves of LANES lanes, each lane the same sums and the lanes summed in the
 * same order (measured on AVX2: the compiler's WIDE-lane vectors took 40 % of an int8 step) */
static float exps_wide(float *s, int64_t count) {
    int64_t j = 0;
    vf top[2] = {splat(-INFINITY), splat(-INFINITY)}, sums[2] = {splat(0.0f), splat(0.0f)}, x;
    for (; j + WIDE <= count; j += WIDE)
        for (int h = 0; h < 2; h++) {
            memcpy(&x, s + j + h * LANES, sizeof(x));
            top[h] = pick(x > top[h], x, top[h]);
        }
    float best = -INFINITY;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < LANES; l++) best = top[h][l] > best ? top[h][l] : best;
    for (; j < count; j++) best = s[j] > best ? s[j] : best;
    vf b = splat(best);
    for (j = 0; j + WIDE <= count; j += WIDE)
        for (int h = 0; h < 2; h++) {
            memcpy(&x, s + j + h * LANES, sizeof(x));
            vf e = exp_neg(x - b);
            memcpy(s + j + h * LANES, &e, sizeof(e));
            sums[h] += e;
        }
    if (j < count) { /* the tail, padded with -inf (weight 0: counted nowhere) */
        float tail[WIDE];
        for (int l = 0; l < WIDE; l++) tail[l] = j + l < count ? s[j + l] : -INFINITY;
        for (int h = 0; h < 2; h++) {
            vf e = exp_neg(load(tail + h * LANES) - b);
            for (int l = 0; l < LANES && j + h * LANES + l < count; l++) {
                s[j + h * LANES + l] = e[l];
                sums[h][l] += e[l];
            }
        }
    }
    float total = 0.0f;
    for (int l = 0; l < WIDE; l++) total += sums[l / LANES][l % LANES];
    return total;
}
#endif

/* softmax in place over one head's count scores */
static void softmax(float *s, int64_t count) {
    float inv = 1.0f / exps(s, count);
    for (int64_t j = 0; j < count; j++) s[j] *= inv;
}

/* a tile of rows (consecutive positions pos0..pos0+rows-1) against one KV head: each row r
 * attends to its own positions lo_r..pos_r (lo_r: its window's start, else 0). q: rows x g x d
 * (scaled) -> out: rows x g x d. Every KV block (BLOCK positions from a multiple of BLOCK) is
 * read, and widened, once for all the tile's rows. A row's result does not depend on the tile
 * it is in: its dot products are taken 8 positions at a time over whole groups aligned to
 * multiples of 8 and one by one at its range's ragged ends (both are the same sums), its
 * softmax runs over its own range, and its values are summed in position order.
 * scores: rows x g x span scratch (span: the tile's positions), buf: BLOCK x d scratch.
 * The general tile, inlined with kind constant (attend_head); every row of a model runs the
 * same instance. (For groups of 1-8 heads and head sizes in multiples of 32: attend_tile_g.) */
INLINE void attend_tile(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
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
                        for (int l = 0; l < LANES; l++) acc[l] += qi * load(k + (j - first + l) * d + i);
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
                    for (int64_t i = 0; i < d / LANES; i++) acc[i] += pj * load(v + (j - first) * d + i * LANES);
                }
                for (int64_t i = 0; i < d / LANES; i++) store(o + i * LANES, acc[i]);
            }
        }
    }
#undef LO
}

/* attend_tile for a group of G query heads a KV head (a constant) and d a multiple of
 * 4 LANES: the same results by the same sums, from fewer loads. Keys and values are read
 * (and widened) straight from the KV, once per position for all G heads: QGROUP positions'
 * dot products with every head at once (G x QGROUP running sums in registers), and each
 * value row's 4-vector slices added to every head's output at once. */
#define QGROUP 4
#define VSLICE 4
/* attend_tile_g's value sums for HN heads (weights pr, head h's at pr + h * span from position
 * lo0) over positions lo..hi, columns c..c + VSLICE * LANES - 1 of o (head h's row at o + h * d),
 * each column's sum position by position. With AVX-512 a group's heads all at once; without it
 * two at a time: the 16 vector registers hold 2 heads' sums, the rows and a weight, not more
 * (measured on AVX2 at G = 3: one sum kept in memory made each position wait on a store) */
INLINE void pv_heads(const int HN, const float *pr, int64_t span, int64_t lo0, const void *values, int64_t row,
                     int64_t lo, int64_t hi, int64_t c, int kind, float *o, int64_t d) {
    vf acc[HN][VSLICE];
    for (int h = 0; h < HN; h++)
        for (int v = 0; v < VSLICE; v++) acc[h][v] = load(o + h * d + c + v * LANES);
    for (int64_t j = lo; j <= hi; j++) {
        vf x[VSLICE];
        for (int v = 0; v < VSLICE; v++) x[v] = load_kv(values, j * row + c + v * LANES, kind);
        for (int h = 0; h < HN; h++) {
            vf p = splat(pr[h * span + j - lo0]);
            for (int v = 0; v < VSLICE; v++) acc[h][v] += p * x[v];
        }
    }
    for (int h = 0; h < HN; h++)
        for (int v = 0; v < VSLICE; v++) store(o + h * d + c + v * LANES, acc[h][v]);
}

/* attend_tile_g's value sums from a float16 KV without AVX-512: pv_heads for HN heads over
 * columns c..c + PSLICE * LANES - 1, with the even and the odd positions in sums of their own,
 * the odd ones added to the even ones at the end. Each sum then waits on the one two positions
 * back (one position back, the adds' latency decided the time), and 3 heads fit the registers
 * (measured at G = 3: float16 decode attention 8-9 % faster; the float32 KV's stays with
 * pv_heads, slower this way). A row's sums are the same in any tile: blocks and parities are
 * fixed by the positions. */
#define PSLICE 2
INLINE void pv_pairs(const int HN, const float *pr, int64_t span, int64_t lo0, const void *values, int64_t row,
                     int64_t lo, int64_t hi, int64_t c, int kind, float *o, int64_t d) {
    vf acc[2][HN][PSLICE];
    for (int h = 0; h < HN; h++)
        for (int v = 0; v < PSLICE; v++) {
            acc[0][h][v] = load(o + h * d + c + v * LANES);
            acc[1][h][v] = splat(0.0f);
        }
#define PV_AT(P, J)                                                                           \
    do {                                                                                      \
        vf x[PSLICE];                                                                         \
        for (int v = 0; v < PSLICE; v++) x[v] = load_kv(values, (J) * row + c + v * LANES, kind); \
        for (int h = 0; h < HN; h++) {                                                        \
            vf p = splat(pr[h * span + (J) - lo0]);                                           \
            for (int v = 0; v < PSLICE; v++) acc[P][h][v] += p * x[v];                         \
        }                                                                                     \
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

INLINE void attend_tile_g(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
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
                vf acc[G][QGROUP];
                for (int h = 0; h < G; h++)
                    for (int l = 0; l < QGROUP; l++) acc[h][l] = splat(0.0f);
                for (int64_t i = 0; i < d; i += LANES) {
                    vf k[QGROUP];
                    for (int l = 0; l < QGROUP; l++) k[l] = load_kv(keys, (j + l) * row + i, kind);
                    for (int h = 0; h < G; h++) {
                        vf qi = load(qr + h * d + i);
                        for (int l = 0; l < QGROUP; l++) acc[h][l] += qi * k[l];
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
            const float *pr = scores + r * G * span; /* (position lo0) */
#if defined(__AVX512F__)
            if (G <= WIDE_HEADS && d % (4 * WIDE) == 0) {
                /* the same sums (each column's, position by position) WIDE columns a register */
                for (int64_t c = 0; c < d && lo <= hi; c += 4 * WIDE) {
                    __m512 acc[WIDE_HEADS][4];
                    for (int h = 0; h < G; h++)
                        for (int v = 0; v < 4; v++) acc[h][v] = _mm512_loadu_ps(out + (r * G + h) * d + c + v * WIDE);
                    for (int64_t j = lo; j <= hi; j++) {
                        __m512 x[4];
                        for (int v = 0; v < 4; v++)
                            x[v] = kind == KV_F32 ? _mm512_loadu_ps((const float *)values + j * row + c + v * WIDE)
                                                  : _mm512_cvtph_ps(_mm256_loadu_si256(
                                                        (const __m256i *)((const uint16_t *)values + j * row + c + v * WIDE)));
                        for (int h = 0; h < G; h++) {
                            __m512 p = _mm512_set1_ps(pr[h * span + j - lo0]);
                            for (int v = 0; v < 4; v++) acc[h][v] = _mm512_fmadd_ps(p, x[v], acc[h][v]);
                        }
                    }
                    for (int h = 0; h < G; h++)
                        for (int v = 0; v < 4; v++) _mm512_storeu_ps(out + (r * G + h) * d + c + v * WIDE, acc[h][v]);
                }
                continue;
            }
#else
            if (kind == KV_F16) {
                for (int64_t c = 0; c < d && lo <= hi; c += PSLICE * LANES) {
                    float *o = out + r * G * d;
                    int h0 = 0;
                    for (; h0 + 3 <= G; h0 += 3) pv_pairs(3, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
                    for (; h0 + 2 <= G; h0 += 2) pv_pairs(2, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
                    if (h0 < G) pv_pairs(1, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, o + h0 * d, d);
                }
                continue;
            }
#endif
            for (int64_t c = 0; c < d && lo <= hi; c += VSLICE * LANES) {
#if defined(__AVX512F__)
                pv_heads(G, pr, span, lo0, values, row, lo, hi, c, kind, out + r * G * d, d);
#else
                int h0 = 0;
                for (; h0 + 2 <= G; h0 += 2)
                    pv_heads(2, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, out + (r * G + h0) * d, d);
                if (h0 < G) pv_heads(1, pr + h0 * span, span, lo0, values, row, lo, hi, c, kind, out + (r * G + h0) * d, d);
#endif
            }
        }
    }
#undef LO
}


/* ---- int8 KV in integers ---------------------------------------------------------------
 * A row's queries and its softmax weights become 8-bit codes with a step of their own (the
 * largest magnitude / Q_MAX or W_MAX), and the KV's int8 codes meet them in exact int32 dot products;
 * only the steps are float. Integer sums are the same in any order, so a row comes out bit
 * for bit the same in any tile or chunking, and with or without the vector path below (AVX-512
 * VNNI, where the compiler targets it: whole blocks of positions by byte dot products; the
 * blocks a row only partly covers in plain C). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1
#define EVEN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* round to nearest, even on ties */
#else
#define VNNI 0
#endif
/* (measured over the exporter's text, SmolLM2: KL from the fp32 export 1.28e-3 above float32
 * KV's with 8-bit queries and weights; 0.98e-3 with 16-bit queries; 0.91e-3 with both 16-bit) */
#define Q_MAX 127.0f /* a query code's largest magnitude (int8) */
#define W_MAX 255.0f /* a weight code's largest (uint8) */
#define MAX_GROUP 32 /* query heads a KV head the one-row vector path takes */
#define Q_BIAS 128 /* a query code plus this: an unsigned byte (the vector path) */

/* x[0..n) as codes round(x / step) (to even), step = largest |x| / top_code; returns the
 * step (0: all zero) */
INLINE float codes(const float *x, int64_t n, float top_code, int16_t *out) {
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
INLINE void qk_plain(const int16_t *qc, float qstep, const void *keys, int64_t d, int64_t b, int64_t lo, int64_t hi,
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
INLINE float weights(const float *p, const float *vstep, int64_t b, int64_t lo, int64_t hi, int16_t *wq) {
    float w[BLOCK];
    for (int64_t jj = 0; jj < BLOCK; jj++) w[jj] = b + jj >= lo && b + jj <= hi ? p[jj] * vstep[jj] : 0.0f;
    return codes(w, BLOCK, W_MAX, wq);
}

/* o += (sum over positions lo..hi of wq x the value's codes) x wstep (column i at o[i], or
 * with `slot`, at o[i - i % 64 + slot[i % 64]]: pv_vnni's order) */
INLINE void pv_plain(const int16_t *wq, float wstep, const void *values, int64_t d, int64_t b, int64_t lo, int64_t hi,
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

#if VNNI
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
INLINE void qk_vnni(const uint8_t *qb, float qstep, const __m512i *kt, const __m512i *ksum, int64_t d,
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
INLINE float weights_vnni(const float *p, const float *vstep, uint8_t *wq) {
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
INLINE void qk_vnni_row(const uint8_t *qb, const float *qstep, int64_t g, const void *keys, int64_t b, int64_t d,
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
INLINE void pv_vnni_row(const uint8_t *w8, const float *wstep, int64_t g, const void *values, int64_t b, int64_t d,
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
INLINE void pv_vnni(const uint8_t *wq, float wstep, const __m512i *vt, int64_t d, float *o) {
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
#endif

/* ---- int8 KV with AVX2 (no VNNI): a decode row over whole blocks, the same integer sums ----
 * The block's codes widened to int16 once, and multiplied in pairs (vpmaddwd: exact int32
 * sums, as the plain loops' and VNNI's), so the row comes out bit for bit as theirs. */
#if !VNNI && defined(__AVX2__)
#include <immintrin.h>
#define AVX2_I8 1

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
INLINE void qk_avx2(const int16_t *i16, const float *qstep, int64_t g, const int16_t *kw, int64_t d,
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
INLINE float weights_avx2(const float *p, const float *vstep, int16_t *wq) {
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
INLINE void pv_avx2(const int16_t *wq, float wstep, const __m256i *vp, int64_t d, float *o) {
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
#else
#define AVX2_I8 0
#endif

/* the steps of block b's rows first..end (from position b; 0 for the others) */
INLINE void steps_of(const void *plane, int64_t b, int64_t first, int64_t end, int64_t d, float *step) {
    int64_t jj = 0;
#if VNNI
    if (first == b && end == b + BLOCK - 1) {
        for (; jj < BLOCK; jj += 16) _mm512_storeu_ps(step + jj, steps16(plane, b + jj, d));
        return;
    }
#elif AVX2_I8
    if (first == b && end == b + BLOCK - 1) {
        for (; jj < BLOCK; jj += 8) _mm256_storeu_ps(step + jj, steps8(plane, b + jj, d));
        return;
    }
#endif
    for (; jj < BLOCK; jj++) step[jj] = b + jj >= first && b + jj <= end ? row_step(plane, b + jj, d) : 0.0f;
}

/* the int8 tile: rows x g queries (scaled) against one KV head, as attend_tile.
 * i16: rows x g x d int16 scratch; steps: rows x g floats; buf: BLOCK x d + rows x g x d floats */
INLINE void attend_i8(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                      int64_t window, int64_t g, int64_t d, float *scores, float *buf, float *out, int16_t *i16,
                      float *steps) {
    (void)buf; /* (the vector path's scratch) */
    int64_t lo0 = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    int64_t last = pos0 + rows - 1, span = last - lo0 + 1;
    float kstep[BLOCK];
    int16_t wq[BLOCK] __attribute__((aligned(64)));
#if AVX2_I8
    int16_t kw[BLOCK * MAX_D] __attribute__((aligned(32))); /* a block's keys as int16 */
    __m256i vp[BLOCK / 2 * MAX_D / 8];                       /* a block's values as int16 pairs */
#endif
#define LO(r) (window > 0 && pos0 + (r) - window + 1 > 0 ? pos0 + (r) - window + 1 : 0)
#define WHOLE(r) (LO(r) <= b && pos0 + (r) >= b + BLOCK - 1) /* row r takes every position of block b */
    prefetch_rows(keys, lo0, lo0 - lo0 % BLOCK + AHEAD * BLOCK - 1, last, d + 2);
    for (int64_t r = 0; r < rows * g; r++) steps[r] = codes(q + r * d, d, Q_MAX, i16 + r * d);
#if VNNI
    int vec = d % 64 == 0 && g <= MAX_GROUP;
    __m512i *kt = (__m512i *)(((uintptr_t)buf + 63) & ~(uintptr_t)63); /* BLOCK x d bytes */
    __m512i *ksum = kt + BLOCK * d / 64;                                /* BLOCK x d / 1024 vectors */
    uint8_t *qb = (uint8_t *)(ksum + BLOCK * d / 1024);                 /* rows x g x d bytes */
    if (vec)
        for (int64_t r = 0; r < rows * g; r++)
            for (int64_t c = 0; c < d / 64; c++)
                for (int m = 0; m < 16; m++)
                    for (int i = 0; i < 4; i++) /* (in transpose16's column order) */
                        qb[r * d + c * 64 + 4 * m + i] = (uint8_t)(i16[r * d + 64 * c + 4 * transposed_col[m] + i] + Q_BIAS);
#endif
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        int whole = 0;
        for (int64_t r = 0; r < rows; r++) whole |= WHOLE(r);
        prefetch_rows(keys, b + AHEAD * BLOCK, b + (AHEAD + 1) * BLOCK - 1, last, d + 2);
        steps_of(keys, b, first, end, d, kstep);
#if VNNI
        if (vec && whole && rows > 1) qk_prepare(keys, b, d, kt, ksum);
#endif
#if VNNI
        if (vec && rows == 1 && WHOLE(0)) {
            qk_vnni_row(qb, steps, g, keys, b, d, kstep, scores + (b - lo0), span);
            continue;
        }
#elif AVX2_I8
        int wide = d % 16 == 0 && whole;
        if (wide) keys_avx2(keys, b, d, kw);
#endif
        for (int64_t r = 0; r < rows; r++) {
            int64_t lo = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
#if AVX2_I8
            if (wide && WHOLE(r)) { /* (a whole block lies within the row's scores) */
                qk_avx2(i16 + r * g * d, steps + r * g, g, kw, d, kstep, scores + r * g * span + (b - lo0), span);
                continue;
            }
#endif
            for (int64_t h = 0; h < g && lo <= hi; h++) {
                float *sh = scores + (r * g + h) * span + (b - lo0); /* (position b; written lo..hi) */
#if VNNI
                if (vec && WHOLE(r)) {
                    float dots[BLOCK];
                    qk_vnni(qb + (r * g + h) * d, steps[r * g + h], kt, ksum, d, kstep, dots);
                    memcpy(sh, dots, sizeof(dots)); /* (a whole block lies within the row's scores) */
                    continue;
                }
#endif
                qk_plain(i16 + (r * g + h) * d, steps[r * g + h], keys, d, b, lo, hi, kstep, sh);
            }
        }
    }
    prefetch_rows(values, lo0, lo0 - lo0 % BLOCK + AHEAD * BLOCK - 1, last, d + 2);
    /* e^(score - largest), each row's sum kept: the weights' codes are the same whatever their
     * scale, so the sum divides the output once at the end */
    float *sums = steps; /* (the queries' steps are no longer needed) */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < g; h++) sums[r * g + h] = exps_wide(scores + (r * g + h) * span + LO(r) - lo0, pos0 + r - LO(r) + 1);
    memset(out, 0, (size_t)(rows * g * d) * sizeof(float));
    for (int64_t b = lo0 - lo0 % BLOCK; b <= last; b += BLOCK) {
        int64_t first = b > lo0 ? b : lo0, end = b + BLOCK - 1 < last ? b + BLOCK - 1 : last;
        prefetch_rows(values, b + AHEAD * BLOCK, b + (AHEAD + 1) * BLOCK - 1, last, d + 2);
        steps_of(values, b, first, end, d, kstep);
        int whole = 0;
        for (int64_t r = 0; r < rows; r++) whole |= WHOLE(r);
#if VNNI
        if (vec && rows == 1 && WHOLE(0)) {
            uint8_t w8[MAX_GROUP * BLOCK];
            float wsteps[MAX_GROUP];
            for (int64_t h = 0; h < g; h++)
                wsteps[h] = weights_vnni(scores + h * span + (b - lo0), kstep, w8 + h * BLOCK);
            pv_vnni_row(w8, wsteps, g, values, b, d, out);
            continue;
        }
        if (vec && whole) pv_prepare(values, b, d, kt);
#elif AVX2_I8
        int wide = d % 16 == 0 && whole;
        if (wide) pv_prepare_avx2(values, b, d, vp);
#endif
        for (int64_t r = 0; r < rows; r++) {
            int64_t lo = LO(r) > first ? LO(r) : first, hi = end < pos0 + r ? end : pos0 + r;
            for (int64_t h = 0; h < g && lo <= hi; h++) {
                /* (a row's scores from position LO(r); b - lo0 may point before them: read lo..hi only) */
                const float *p = scores + (r * g + h) * span + (b - lo0);
                float *o = out + (r * g + h) * d;
#if AVX2_I8
                if (wide && WHOLE(r)) {
                    float wstep = weights_avx2(p, kstep, wq);
                    if (wstep != 0.0f) pv_avx2(wq, wstep, vp, d, o);
                    continue;
                }
#endif
#if VNNI
                if (vec && WHOLE(r)) {
                    uint8_t w8[BLOCK];
                    float wstep = weights_vnni(p, kstep, w8);
                    if (wstep != 0.0f) pv_vnni(w8, wstep, kt, d, o);
                    continue;
                }
#endif
                float wstep = weights(p, kstep, b, lo, hi, wq);
#if VNNI
                if (wstep != 0.0f) pv_plain(wq, wstep, values, d, b, lo, hi, vec ? pv_slot : NULL, o);
#else
                if (wstep != 0.0f) pv_plain(wq, wstep, values, d, b, lo, hi, NULL, o);
#endif
            }
        }
    }
    for (int64_t r = 0; r < rows * g; r++) {
        float *o = out + r * d, inv = 1.0f / sums[r];
#if VNNI
        if (vec) /* (pv_vnni's column order back to the columns') */
            for (int64_t c = 0; c < d; c += 64) {
                float t[64];
                memcpy(t, o + c, sizeof(t));
                for (int i = 0; i < 64; i++) o[c + i] = t[pv_slot[i]];
            }
#endif
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

#define HEAD(KIND) attend_tile(q, keys, values, pos0, rows, window, g, d, KIND, scores, buf, out)
#define GROUP(G, KIND) attend_tile_g(q, keys, values, pos0, rows, window, G, d, KIND, scores, out)
#define GROUPS(KIND)                                                                                 \
    switch (g) {                                                                                     \
        case 1: GROUP(1, KIND); return;                                                              \
        case 2: GROUP(2, KIND); return;                                                              \
        case 3: GROUP(3, KIND); return;                                                              \
        case 4: GROUP(4, KIND); return;                                                              \
        case 5: GROUP(5, KIND); return;                                                              \
        case 6: GROUP(6, KIND); return;                                                              \
        case 7: GROUP(7, KIND); return;                                                              \
        case 8: GROUP(8, KIND); return;                                                              \
        default: break;                                                                              \
    }

/* a decode row without a window (the common step): attend_tile_g with rows and window
 * constants, in a function of its own (the same sums; on AVX2, with them read at run time, the
 * key loop kept some of the group's sums on the stack) */
#define ROW_FN(NAME, KIND)                                                                          \
    static __attribute__((noinline)) void NAME(const float *q, const void *keys, const void *values, \
                                               int64_t pos0, int64_t g, int64_t d, float *scores, float *out) { \
        const int64_t rows = 1, window = -1;                                                         \
        GROUPS(KIND)                                                                                 \
    }
ROW_FN(attend_f32_row, KV_F32)
ROW_FN(attend_f16_row, KV_F16)

/* attend_tile_g for this model's group size and head size where it takes them, else
 * attend_tile: one function a KV dtype, each compiled on its own (how one
 * instance is laid out then does not move another's: measured, 40 % on a float16 decode) */
#define HEAD_FN(NAME, ROW, KIND)                                                                     \
    static __attribute__((noinline)) void NAME(const float *q, const void *keys, const void *values, \
                                               int64_t pos0, int64_t rows, int64_t window, int64_t g, \
                                               int64_t d, float *scores, float *buf, float *out) {   \
        if (d % (VSLICE * LANES) == 0) {                                                             \
            if (rows == 1 && window < 0 && g >= 1 && g <= 8) {                                       \
                ROW(q, keys, values, pos0, g, d, scores, out);                                       \
                return;                                                                              \
            }                                                                                        \
            GROUPS(KIND)                                                                             \
        }                                                                                            \
        HEAD(KIND);                                                                                  \
    }
HEAD_FN(attend_f32, attend_f32_row, KV_F32)
HEAD_FN(attend_f16, attend_f16_row, KV_F16)

static void attend_head(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                        int64_t window, int64_t g, int64_t d, int kind, float *scores, float *buf, float *out,
                        int16_t *i16, float *steps) {
    if (kind == KV_I8)
        (d == 64 && g <= 8 ? attend_i8_d64[g] : attend_i8_any)(q, keys, values, pos0, rows, window, g, d, scores, buf,
                                                                out, i16, steps);
    else if (kind == KV_F16) attend_f16(q, keys, values, pos0, rows, window, g, d, scores, buf, out);
    else attend_f32(q, keys, values, pos0, rows, window, g, d, scores, buf, out);
}

static int shape(api_t api, const void *value, int64_t *dims, size_t want) {
    return dims_of(api, value, dims, want) == want;
}

/* one operator call's work: its tiles are (KV head, rows r0..r0+rows-1) items */
typedef struct {
    const kernel *k;
    const float *q;
    const void *keys, *values;
    float *out;
    int64_t n, heads, kv, g, d, start;
    float scale;
    size_t plane;
    int64_t rows, items;
} work;

typedef struct {
    const work *w;
    int64_t first, end; /* items first..end-1 */
} part;

static void *run_part(void *arg);
static void run_indexed(void *parts, size_t i) { run_part((part *)parts + i); }

/* a run of items, with scratch of its own */
static void *run_part(void *arg) {
    const part *p = (const part *)arg;
    const work *w = p->w;
    int64_t g = w->g, d = w->d, rows = w->rows, span = w->start + w->n;
    float *scratch = (float *)malloc(((size_t)(rows * g * span) + (size_t)(4 * rows * g * d) + (size_t)(BLOCK * d) +
                                      (size_t)(rows * g)) * sizeof(float));
    if (!scratch) return NULL; /* (those rows stay zero) */
    float *scores = scratch, *qs = scores + rows * g * span, *acc = qs + rows * g * d, *buf = acc + rows * g * d;
    /* buf: BLOCK x d floats and rows x g x d more (the int8 path's query bytes); then the int8
     * path's query codes and their steps */
    int16_t *i16 = (int16_t *)(buf + BLOCK * d + rows * g * d);
    float *steps = buf + BLOCK * d + 2 * rows * g * d;
    int64_t tiles = (w->n + rows - 1) / rows;
    for (int64_t item = p->first; item < p->end; item++) {
        int64_t h = item / tiles, r0 = item % tiles * rows, m = w->n - r0 < rows ? w->n - r0 : rows;
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < g * d; i++) qs[r * g * d + i] = w->q[((r0 + r) * w->heads + h * g) * d + i] * w->scale;
        attend_head(qs, (const char *)w->keys + (size_t)h * w->plane, (const char *)w->values + (size_t)h * w->plane,
                    w->start + r0, m, w->k->window, g, d, w->k->kind, scores, buf, acc, i16, steps);
        for (int64_t r = 0; r < m; r++)
            memcpy(w->out + ((r0 + r) * w->heads + h * g) * d, acc + r * g * d, (size_t)(g * d) * sizeof(float));
    }
    free(scratch);
    return NULL;
}

/* ---- the step's rows into the KV ----------------------------------------------------------
 * An int8 row: its d codes round(x / step) (to even) in -127..127, then its step as an exponent
 * byte e and a mantissa byte b, step = 2^e (1 + (b + 128) / 256): the least such at or above
 * the row's largest magnitude / 127 (rows of zeros: of QUANT_SMALLEST), found exactly from the
 * float's own exponent and mantissa. A float16 row: each value rounded to the nearest (to even),
 * as onnxruntime's Cast and numpy round it. */
#define QUANT_SMALLEST 1e-30f

static void quantize_row(const float *x, int64_t d, int8_t *out) {
    float top = QUANT_SMALLEST;
    for (int64_t i = 0; i < d; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    int ex;
    float f = frexpf(top / 127.0f, &ex); /* top / 127 = f 2^ex, f in [0.5, 1) */
    int e = ex - 1, m = (int)ceilf((2.0f * f - 1.0f) * 256.0f); /* (2f - 1: [0, 1), exact) */
    if (m > 255) m = 0, e += 1;
    float step = ldexpf(1.0f + (float)m / 256.0f, e);
    for (int64_t i = 0; i < d; i++) {
        float c = nearbyintf(x[i] / step);
        out[i] = (int8_t)(c > 127.0f ? 127 : c < -127.0f ? -127 : c);
    }
    out[d] = (int8_t)e, out[d + 1] = (int8_t)(m - 128);
}

/* a float as float16, rounded to the nearest (ties to even) */
static uint16_t narrow(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return (uint16_t)(sign | 0x7e00);          /* NaN */
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);         /* 65520 and up: infinity */
    if (ax < 0x38800000)                                            /* below 2^-14: subnormal (exact scaling) */
        return (uint16_t)(sign | (uint32_t)nearbyintf(fabsf(f) * 16777216.0f));
    return (uint16_t)(sign | ((ax + 0xfff + ((ax >> 13) & 1) - (112u << 23)) >> 13));
}

static void narrow_n(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = narrow(x[i]);
}

/* x (d values) at position pos turned by the rotary tables (rows of half = rot / 2 values): the
 * first rot values in two halves, a = x[i], b = x[i + half]: a cos - b sin, b cos + a sin
 * (onnxruntime's RotaryEmbedding, not interleaved); the rest as they are */
static void rotate(const float *x, const float *cos, const float *sin, int64_t half, int64_t pos, int64_t d,
                   float *out) {
    const float *c = cos + pos * half, *s = sin + pos * half;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        out[i] = a * c[i] - b * s[i];
        out[i + half] = b * c[i] + a * s[i];
    }
    for (int64_t i = 2 * half; i < d; i++) out[i] = x[i];
}

/* one KV row (d float32 values) stored as the KV holds it */
static void store_row(const float *x, int64_t d, int kind, void *row) {
    if (kind == KV_I8) quantize_row(x, d, (int8_t *)row);
    else if (kind == KV_F16) narrow_n(x, (uint16_t *)row, d);
    else memcpy(row, x, (size_t)d * sizeof(float));
}

enum { IN_Q, IN_K, IN_V, IN_PAST_K, IN_PAST_V, IN_TOTAL, IN_COS, IN_SIN, INPUTS };

static void compute(void *state, void *ctx) {
    kernel *k = (kernel *)state;
    api_t api = k->api;
    const void *in[INPUTS] = {0};
    for (size_t i = 0; i < INPUTS; i++)
        if (!ok(api, CALL(api, INPUT, input_fn)(ctx, i, &in[i])) || (!in[i] && i < IN_COS)) return;
    int64_t qd[3], nd[3], vnd[3], kd[4], vd[4], td[1], cd[2] = {0, 0}, sd[2] = {0, 0};
    int rotary = in[IN_COS] && in[IN_SIN];
    if (!shape(api, in[IN_Q], qd, 3) || !shape(api, in[IN_K], nd, 3) || !shape(api, in[IN_V], vnd, 3) ||
        !shape(api, in[IN_PAST_K], kd, 4) || !shape(api, in[IN_PAST_V], vd, 4) || !shape(api, in[IN_TOTAL], td, 1) ||
        (rotary && (!shape(api, in[IN_COS], cd, 2) || !shape(api, in[IN_SIN], sd, 2))))
        return;
    void *outs[3] = {NULL, NULL, NULL};
    if (!ok(api, CALL(api, OUTPUT, output_fn)(ctx, 0, qd, 3, &outs[0])) || !outs[0] ||
        !ok(api, CALL(api, OUTPUT, output_fn)(ctx, 1, kd, 4, &outs[1])) || !outs[1] ||
        !ok(api, CALL(api, OUTPUT, output_fn)(ctx, 2, vd, 4, &outs[2])) || !outs[2])
        return;
    void *data[INPUTS] = {0}, *o_data[3];
    for (int i = 0; i < INPUTS; i++)
        if (in[i] && !ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(in[i], &data[i]))) return;
    for (int i = 0; i < 3; i++)
        if (!ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(outs[i], &o_data[i]))) return;
    size_t item = k->kind == KV_F32 ? 4 : k->kind == KV_F16 ? 2 : 1;
    /* the KV is bound in place (engine/kv.py): present is past's own buffer; else past is copied */
    if (o_data[1] != data[IN_PAST_K]) memcpy(o_data[1], data[IN_PAST_K], (size_t)(kd[0] * kd[1] * kd[2] * kd[3]) * item);
    if (o_data[2] != data[IN_PAST_V]) memcpy(o_data[2], data[IN_PAST_V], (size_t)(vd[0] * vd[1] * vd[2] * vd[3]) * item);
    int64_t n = qd[1], heads = k->heads, kv = k->kv_heads, d = kd[3] - 2 * (k->kind == KV_I8), cap = kd[2];
    int64_t total = td[0] == 1 ? ((const int64_t *)data[IN_TOTAL])[0] : -1, half = cd[1]; /* (-1: refused below) */
    float *o = (float *)o_data[0];
    memset(o, 0, (size_t)(qd[0] * qd[1] * qd[2]) * sizeof(float));
    /* a step that does not fit the KV it is given (the graph is ours: never expected) leaves
     * zeros and the KV as it was rather than reading or writing outside the buffers */
    if (qd[0] != 1 || kd[0] != 1 || kd[1] != kv || memcmp(kd, vd, sizeof(kd)) || qd[2] != heads * d ||
        nd[0] != 1 || nd[1] != n || nd[2] != kv * d || memcmp(nd, vnd, sizeof(nd)) || heads % kv || td[0] != 1 ||
        total < n || total > cap || d < 1 || d % LANES || d > MAX_D ||
        (rotary && (memcmp(cd, sd, sizeof(cd)) || cd[0] < total || half < 1 || 2 * half > d)))
        return;
    size_t row_bytes = (size_t)kd[3] * item, plane = (size_t)cap * row_bytes;
    float *qr = (float *)malloc((size_t)(n * heads * d + d) * sizeof(float)), *tmp = qr + n * heads * d;
    if (!qr) return;
    const float *q = (const float *)data[IN_Q], *kn = (const float *)data[IN_K], *vn = (const float *)data[IN_V];
    const float *cos = (const float *)data[IN_COS], *sin = (const float *)data[IN_SIN];
    for (int64_t r = 0; r < n; r++) {
        int64_t pos = total - n + r;
        for (int64_t h = 0; h < heads; h++) {
            const float *x = q + (r * heads + h) * d;
            if (rotary) rotate(x, cos, sin, half, pos, d, qr + (r * heads + h) * d);
            else memcpy(qr + (r * heads + h) * d, x, (size_t)d * sizeof(float));
        }
        for (int64_t h = 0; h < kv; h++) {
            const float *x = kn + (r * kv + h) * d;
            if (rotary) rotate(x, cos, sin, half, pos, d, tmp), x = tmp;
            store_row(x, d, k->kind, (char *)o_data[1] + h * plane + (size_t)pos * row_bytes);
            store_row(vn + (r * kv + h) * d, d, k->kind, (char *)o_data[2] + h * plane + (size_t)pos * row_bytes);
        }
    }
    work w = {k, qr, o_data[1], o_data[2], o, n, heads, kv, heads / kv, d, total - n,
              k->scale > 0.0f ? k->scale : 1.0f / sqrtf((float)d), plane, 0, 0};
    /* rows a tile: as many as keep its scores within TILE_BYTES (any count gives the same) */
    w.rows = (int64_t)(TILE_BYTES / sizeof(float)) / (w.g * total);
    w.rows = w.rows < 1 ? 1 : w.rows > TILE_ROWS ? TILE_ROWS : w.rows;
    w.rows = w.rows > n ? n : w.rows;
    w.items = kv * ((n + w.rows - 1) / w.rows);
    /* a prompt chunk's tiles spread over the session's threads (each row's result is the
     * same whichever thread computes it); a decode step's few stay on this one */
    int64_t threads = k->threads < MAX_THREADS ? k->threads : MAX_THREADS;
    threads = n * total < PARALLEL_WORK ? 1 : threads < w.items ? threads : w.items;
    part parts[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) parts[t] = (part){&w, w.items * t / threads, w.items * (t + 1) / threads};
    run_parts(api, ctx, run_part, run_indexed, parts, sizeof(part), threads);
    free(qr);
}

static void *create(const struct custom_op *op, api_t api, const void *info) {
    kernel *k = (kernel *)calloc(1, sizeof(kernel));
    if (!k) return NULL;
    k->api = api;
    k->kind = ((const attend_op *)op)->kind;
    k->window = -1;
    if (CALL(api, ATTR_INT, attr_int_fn)(info, "num_heads", &k->heads) ||
        CALL(api, ATTR_INT, attr_int_fn)(info, "kv_num_heads", &k->kv_heads) || k->heads < 1 ||
        k->kv_heads < 1) {
        k->heads = k->kv_heads = 1; /* compute() then refuses every step (zeros) */
    }
    (void)CALL(api, ATTR_INT, attr_int_fn)(info, "local_window_size", &k->window);
    k->threads = 1;
    (void)CALL(api, ATTR_INT, attr_int_fn)(info, "threads", &k->threads);
    k->threads = k->threads < 1 ? 1 : k->threads;
    (void)CALL(api, ATTR_FLOAT, attr_float_fn)(info, "scale", &k->scale);
    return k;
}

static void destroy(void *state) { free(state); }
static const char *op_name(const struct custom_op *op) { return ((const attend_op *)op)->op_name; }
static const char *provider(const struct custom_op *op) { (void)op; return "CPUExecutionProvider"; }
static int kind_of(const struct custom_op *op) { return ((const attend_op *)op)->kind; }
static size_t input_count(const struct custom_op *op) { (void)op; return INPUTS; }
static size_t output_count(const struct custom_op *op) { (void)op; return 3; }
static int kv_type(const struct custom_op *op) {
    int kind = kind_of(op);
    return kind == KV_I8 ? ELEM_INT8 : kind == KV_F16 ? ELEM_FLOAT16 : ELEM_FLOAT;
}
static int output_type(const struct custom_op *op, size_t i) { return i ? kv_type(op) : ELEM_FLOAT; }
enum { REQUIRED = 0, OPTIONAL = 1 }; /* onnxruntime's OrtCustomOpInputOutputCharacteristic */
static int input_kind(const struct custom_op *op, size_t i) { (void)op; return i >= IN_COS ? OPTIONAL : REQUIRED; }
static int output_kind(const struct custom_op *op, size_t i) { (void)op; (void)i; return REQUIRED; }

static int input_type(const struct custom_op *op, size_t i) {
    if (i == IN_TOTAL) return ELEM_INT64;
    return i == IN_PAST_K || i == IN_PAST_V ? kv_type(op) : ELEM_FLOAT;
}

#define ATTEND_OP(label, kind)                                                                    \
    {{OP_VERSION, create, op_name, provider, input_type, input_count, output_type, output_count, compute, \
      destroy, input_kind, output_kind},                                                                 \
     label, kind}

const struct custom_op *matmul_op(int i); /* engine/matmul.c's operators (NULL past the last) */

#define OPS 3
static attend_op ops[OPS] = {ATTEND_OP("Attend", KV_F32), ATTEND_OP("Attend16", KV_F16), ATTEND_OP("Attend8", KV_I8)};

status_t RegisterCustomOps(void *options, const api_base_t *base) {
    api_t api = base->get_api(API_VERSION);
    if (!api) return NULL; /* cannot even report it; the session then fails on the unknown op */
    const char *v = base->version ? base->version() : NULL; /* "1.29.0" */
    if (v) {
        char *rest = NULL;
        long major = strtol(v, &rest, 10), minor = rest && *rest == '.' ? strtol(rest + 1, NULL, 10) : 0;
        has_pool = major > 1 || (major == 1 && minor >= PARALLEL_FOR_SINCE);
    }
#if VNNI
    transpose16_init();
    pv_slot_init();
#endif
    void *domain = NULL;
    status_t status = CALL(api, CREATE_DOMAIN, create_domain_fn)("edgelite", &domain);
    for (int i = 0; !status && i < OPS; i++) status = CALL(api, DOMAIN_ADD, domain_add_fn)(domain, &ops[i].op);
    for (int i = 0; !status && matmul_op(i); i++) status = CALL(api, DOMAIN_ADD, domain_add_fn)(domain, matmul_op(i));
    if (!status) status = CALL(api, ADD_DOMAIN, add_domain_fn)(options, domain);
    return status;
}
