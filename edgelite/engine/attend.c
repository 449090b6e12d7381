/* edgelite's attention kernel: an onnxruntime custom operator, compiled on the device that
 * runs it (engine/kernel.py) and used by engine/attention.py.
 *
 * Operators (domain "edgelite"): Attend (float32 KV), Attend16 (float16 KV) and Attend8 (int8
 * KV: a row of d codes, then its step as an exponent byte e and a mantissa byte b, the values
 * code * 2^e * (1 + (b + 128) / 256): exact in float32).
 *   inputs:  q      float32 (1, n, heads * d), rotated
 *            key    (1, kv_heads, capacity, d) (int8: d + 2), this step's rows already written
 *            value  (1, kv_heads, capacity, d) (int8: d + 2)
 *            total  int64 (1): the positions valid after this step (the step's rows are the
 *                   last n of them)
 *   output:  float32 (1, n, heads * d)
 *   attributes: num_heads, kv_num_heads, local_window_size (-1: none), scale (0: d^-1/2)
 *
 * Each row attends to its own causal window only and is computed by the same sequence of
 * float operations whatever the step holds (fixed-lane dot products, sums in position order,
 * no fast-math): a row comes out bit for bit the same in any chunking. The rows of a step go
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

#define API_VERSION 12 /* what this file asks onnxruntime for (1.12 and later give it) */
#define OP_VERSION 12  /* the OrtCustomOp layout below (up to the I/O characteristics) */

/* OrtApi entries (indices into its table of function pointers) */
enum {
    CREATE_STATUS = 0,
    CREATE_DOMAIN = 26,
    DOMAIN_ADD = 27,
    ADD_DOMAIN = 28,
    TENSOR_DATA = 51,
    DIMS_COUNT = 61,
    DIMS = 62,
    TYPE_AND_SHAPE = 65,
    ATTR_FLOAT = 85,
    ATTR_INT = 86,
    INPUT = 90,
    OUTPUT = 91,
    RELEASE_STATUS = 93,
    RELEASE_SHAPE = 99,
    PARALLEL_FOR = 274, /* KernelContext_ParallelFor: onnxruntime 1.17 (API 17) on */
};
#define PARALLEL_FOR_SINCE 17 /* the onnxruntime 1.x minor version that has it */
enum { ELEM_FLOAT = 1, ELEM_INT8 = 3, ELEM_INT64 = 7, ELEM_FLOAT16 = 10 };
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 }; /* what a KV row holds */
enum { ERR_FAIL = 1 };

typedef void *status_t;
typedef void *(*const *api_t);
typedef struct {
    api_t (*get_api)(uint32_t version);
    const char *(*version)(void);
} api_base_t;

typedef status_t (*create_status_fn)(int, const char *);
typedef status_t (*create_domain_fn)(const char *, void **);
typedef status_t (*domain_add_fn)(void *, const void *);
typedef status_t (*add_domain_fn)(void *, void *);
typedef status_t (*tensor_data_fn)(const void *, void **);
typedef status_t (*dims_count_fn)(const void *, size_t *);
typedef status_t (*dims_fn)(const void *, int64_t *, size_t);
typedef status_t (*type_and_shape_fn)(const void *, void **);
typedef status_t (*attr_float_fn)(const void *, const char *, float *);
typedef status_t (*attr_int_fn)(const void *, const char *, int64_t *);
typedef status_t (*input_fn)(const void *, size_t, const void **);
typedef status_t (*output_fn)(void *, size_t, const int64_t *, size_t, void **);
typedef void (*release_fn)(void *);
typedef status_t (*parallel_for_fn)(const void *, void (*)(void *, size_t), size_t, size_t, void *);

static int has_pool; /* the loading onnxruntime has KernelContext_ParallelFor */

#define CALL(api, index, type) ((type)(api)[index])

/* 1 when onnxruntime's call succeeded; a failure's status is released */
static int ok(api_t api, status_t status) {
    if (status) CALL(api, RELEASE_STATUS, release_fn)(status);
    return !status;
}

struct custom_op {
    uint32_t version;
    void *(*create)(const struct custom_op *, api_t, const void *);
    const char *(*name)(const struct custom_op *);
    const char *(*provider)(const struct custom_op *);
    int (*input_type)(const struct custom_op *, size_t);
    size_t (*input_count)(const struct custom_op *);
    int (*output_type)(const struct custom_op *, size_t);
    size_t (*output_count)(const struct custom_op *);
    void (*compute)(void *, void *);
    void (*destroy)(void *);
    int (*input_kind)(const struct custom_op *, size_t);
    int (*output_kind)(const struct custom_op *, size_t);
};

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

static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

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

/* lanes_sum of 4 vectors into out[0..3], the same sums in the same order */
static inline void lanes_sum4(const vf *a, float *out) {
    vf s0 = SHUFFLE(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
    vf s1 = SHUFFLE(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
    vf u = SHUFFLE(s0, s1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(s0, s1, 2, 3, 10, 11, 6, 7, 14, 15);
    for (int l = 0; l < 4; l++) out[l] = u[l] + u[l + 4];
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

/* e^x for x <= 0 (a score less the row's largest), LANES at a time: x = n ln2 + r with
 * |r| <= ln2/2 (ln2 in two parts), e^r by a degree-7 polynomial (Cephes' expf
 * coefficients), times 2^n built in the exponent bits. Below EXP_FLOOR it is exactly 0: such
 * a weight is lost in a sum of at least 1 anyway, and divided by the sum it would make
 * subnormal floats, which cost the products that meet them a hundred cycles each */
#define EXP_FLOOR -72.0f /* e^-72 / 2^20 positions is still a normal float */
static inline vf exp_neg(vf x) {
    vi under = x < splat(EXP_FLOOR);
    x = pick(under, splat(EXP_FLOOR), x);
    vf t = x * splat(1.44269504088896341f) + splat(0.5f);
    vi n = __builtin_convertvector(t, vi); /* toward zero: one too high where t < 0 */
    n = n + (vi)(__builtin_convertvector(n, vf) > t); /* (true is -1): now floor(t) */
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * splat(0.693359375f);
    r = r - nf * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    return pick(under, splat(0.0f), p * (vf)((n + 127) << 23));
}

#define INLINE static inline __attribute__((always_inline))

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

/* rows first..first+count-1 of one KV head's plane as float32: in place for a float32 KV,
 * else widened into buf (int8: each row's codes times its step, exactly) */
INLINE const float *rows_f32(const void *plane, int64_t first, int64_t count, int64_t d, int kind, float *buf) {
    if (kind == KV_F32) return (const float *)plane + first * d;
    if (kind == KV_F16) {
        widen_n((const uint16_t *)plane + first * d, buf, count * d);
        return buf;
    }
    for (int64_t r = 0; r < count; r++) {
        const int8_t *row = (const int8_t *)plane + (first + r) * (d + 2);
        float step = row_step(plane, first + r, d);
        for (int64_t i = 0; i < d; i++) buf[r * d + i] = (float)row[i] * step;
    }
    return buf;
}

/* LANES values of a KV plane from element `at`, as float32 (int8: the codes, not yet times
 * their row's step) */
INLINE vf load_kv(const void *plane, int64_t at, int kind) {
    if (kind == KV_F32) return load((const float *)plane + at);
    if (kind == KV_I8) {
        const int8_t *c = (const int8_t *)plane + at;
#if defined(__AVX2__)
        return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
#else
        vf v;
        for (int l = 0; l < LANES; l++) v[l] = (float)c[l];
        return v;
#endif
    }
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
    if (kind == KV_I8) {
        vf step = splat(row_step(plane, j, d));
        for (int64_t i = 0; i < d; i += LANES) acc += load(q + i) * (load_kv(plane, j * (d + 2) + i, kind) * step);
    } else {
        for (int64_t i = 0; i < d; i += LANES) acc += load(q + i) * load_kv(plane, j * d + i, kind);
    }
    return lanes_sum(acc);
}

/* softmax in place over one head's count scores */
static void softmax(float *s, int64_t count) {
    int64_t j = 0;
    vf top = splat(-INFINITY), sums = splat(0.0f);
    for (; j + LANES <= count; j += LANES) {
        vf x = load(s + j);
        top = pick(x > top, x, top);
    }
    float best = -INFINITY;
    for (int l = 0; l < LANES; l++) best = top[l] > best ? top[l] : best;
    for (; j < count; j++) best = s[j] > best ? s[j] : best;
    vf b = splat(best);
    for (j = 0; j + LANES <= count; j += LANES) {
        vf e = exp_neg(load(s + j) - b);
        store(s + j, e);
        sums += e;
    }
    if (j < count) { /* the tail, padded with -inf (weight 0: counted nowhere) */
        float tail[LANES];
        for (int l = 0; l < LANES; l++) tail[l] = j + l < count ? s[j + l] : -INFINITY;
        vf e = exp_neg(load(tail) - b);
        for (int l = 0; l < LANES && j + l < count; l++) {
            s[j + l] = e[l];
            sums[l] += e[l];
        }
    }
    float inv = 1.0f / lanes_sum(sums);
    for (j = 0; j < count; j++) s[j] *= inv;
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
INLINE void attend_tile_g(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                          int64_t window, const int G, int64_t d, int kind, float *scores, float *out) {
    int64_t row = d + 2 * (kind == KV_I8); /* a position's values in the plane */
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
                vf st[QGROUP];
                for (int l = 0; l < QGROUP; l++) st[l] = splat(kind == KV_I8 ? row_step(keys, j + l, d) : 1.0f);
                for (int64_t i = 0; i < d; i += LANES) {
                    vf k[QGROUP];
                    for (int l = 0; l < QGROUP; l++) {
                        k[l] = load_kv(keys, (j + l) * row + i, kind);
                        if (kind == KV_I8) k[l] *= st[l];
                    }
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
            for (int64_t c = 0; c < d && lo <= hi; c += VSLICE * LANES) {
                vf acc[G][VSLICE];
                for (int h = 0; h < G; h++)
                    for (int v = 0; v < VSLICE; v++) acc[h][v] = load(out + (r * G + h) * d + c + v * LANES);
                for (int64_t j = lo; j <= hi; j++) {
                    vf x[VSLICE], st = splat(kind == KV_I8 ? row_step(values, j, d) : 1.0f);
                    for (int v = 0; v < VSLICE; v++) {
                        x[v] = load_kv(values, j * row + c + v * LANES, kind);
                        if (kind == KV_I8) x[v] *= st;
                    }
                    for (int h = 0; h < G; h++) {
                        vf p = splat(pr[h * span + j - lo0]);
                        for (int v = 0; v < VSLICE; v++) acc[h][v] += p * x[v];
                    }
                }
                for (int h = 0; h < G; h++)
                    for (int v = 0; v < VSLICE; v++) store(out + (r * G + h) * d + c + v * LANES, acc[h][v]);
            }
        }
    }
#undef LO
}

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

/* attend_tile_g for this model's group size and head size where it takes them, else
 * attend_tile: one function a KV dtype, each compiled on its own (how one
 * instance is laid out then does not move another's: measured, 40 % on a float16 decode) */
#define HEAD_FN(NAME, KIND)                                                                          \
    static __attribute__((noinline)) void NAME(const float *q, const void *keys, const void *values, \
                                               int64_t pos0, int64_t rows, int64_t window, int64_t g, \
                                               int64_t d, float *scores, float *buf, float *out) {   \
        if (d % (VSLICE * LANES) == 0) {                                                             \
            GROUPS(KIND)                                                                             \
        }                                                                                            \
        HEAD(KIND);                                                                                  \
    }
HEAD_FN(attend_f32, KV_F32)
HEAD_FN(attend_f16, KV_F16)
HEAD_FN(attend_i8, KV_I8)

static void attend_head(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                        int64_t window, int64_t g, int64_t d, int kind, float *scores, float *buf, float *out) {
    if (kind == KV_I8) attend_i8(q, keys, values, pos0, rows, window, g, d, scores, buf, out);
    else if (kind == KV_F16) attend_f16(q, keys, values, pos0, rows, window, g, d, scores, buf, out);
    else attend_f32(q, keys, values, pos0, rows, window, g, d, scores, buf, out);
}

static int shape(api_t api, const void *value, int64_t *dims, size_t want) {
    void *info = NULL;
    size_t count = 0;
    if (!ok(api, CALL(api, TYPE_AND_SHAPE, type_and_shape_fn)(value, &info))) return 0;
    int good = ok(api, CALL(api, DIMS_COUNT, dims_count_fn)(info, &count)) && count == want &&
               ok(api, CALL(api, DIMS, dims_fn)(info, dims, want));
    CALL(api, RELEASE_SHAPE, release_fn)(info);
    return good;
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
    float *scratch = (float *)malloc(((size_t)(rows * g * span) + (size_t)(2 * rows * g * d) + (size_t)(BLOCK * d)) *
                                     sizeof(float));
    if (!scratch) return NULL; /* (those rows stay zero) */
    float *scores = scratch, *qs = scores + rows * g * span, *acc = qs + rows * g * d, *buf = acc + rows * g * d;
    int64_t tiles = (w->n + rows - 1) / rows;
    for (int64_t item = p->first; item < p->end; item++) {
        int64_t h = item / tiles, r0 = item % tiles * rows, m = w->n - r0 < rows ? w->n - r0 : rows;
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < g * d; i++) qs[r * g * d + i] = w->q[((r0 + r) * w->heads + h * g) * d + i] * w->scale;
        attend_head(qs, (const char *)w->keys + (size_t)h * w->plane, (const char *)w->values + (size_t)h * w->plane,
                    w->start + r0, m, w->k->window, g, d, w->k->kind, scores, buf, acc);
        for (int64_t r = 0; r < m; r++)
            memcpy(w->out + ((r0 + r) * w->heads + h * g) * d, acc + r * g * d, (size_t)(g * d) * sizeof(float));
    }
    free(scratch);
    return NULL;
}

static void compute(void *state, void *ctx) {
    kernel *k = (kernel *)state;
    api_t api = k->api;
    const void *in[4];
    for (size_t i = 0; i < 4; i++)
        if (!ok(api, CALL(api, INPUT, input_fn)(ctx, i, &in[i])) || !in[i]) return;
    int64_t qd[3], kd[4], vd[4], td[1];
    if (!shape(api, in[0], qd, 3) || !shape(api, in[1], kd, 4) || !shape(api, in[2], vd, 4) ||
        !shape(api, in[3], td, 1))
        return;
    void *out_value = NULL;
    if (!ok(api, CALL(api, OUTPUT, output_fn)(ctx, 0, qd, 3, &out_value)) || !out_value) return;
    void *data[5];
    const void *values[5] = {in[0], in[1], in[2], in[3], out_value};
    for (int i = 0; i < 5; i++)
        if (!ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(values[i], &data[i]))) return;
    void *q_data = data[0], *k_data = data[1], *v_data = data[2], *t_data = data[3], *o_data = data[4];
    int64_t n = qd[1], heads = k->heads, kv = k->kv_heads, d = kd[3] - 2 * (k->kind == KV_I8), cap = kd[2];
    int64_t total = td[0] == 1 ? ((const int64_t *)t_data)[0] : -1;
    float *o = (float *)o_data;
    memset(o, 0, (size_t)(qd[0] * qd[1] * qd[2]) * sizeof(float));
    /* a step that does not fit the KV it is given (the graph is ours: never expected) leaves
     * zeros rather than reading outside the buffers */
    if (qd[0] != 1 || kd[0] != 1 || kd[1] != kv || memcmp(kd, vd, sizeof(kd)) || qd[2] != heads * d ||
        heads % kv || total < n || total > cap || d < 1 || d % LANES || d > MAX_D)
        return;
    work w = {k, (const float *)q_data, k_data, v_data, o, n, heads, kv, heads / kv, d, total - n,
              k->scale > 0.0f ? k->scale : 1.0f / sqrtf((float)d), (size_t)cap * (k->kind == KV_I8 ? (size_t)d + 2 : (size_t)d * (k->kind == KV_F16 ? 2 : 4)), 0, 0};
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
    /* onnxruntime's pool runs the parts where it can (a part that ran twice after a failed
     * call writes the same rows again) */
    if (threads > 1 && has_pool &&
        ok(api, CALL(api, PARALLEL_FOR, parallel_for_fn)(ctx, run_indexed, (size_t)threads, 0, parts)))
        return;
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 1; t < threads; t++) started[t] = !pthread_create(&ids[t], NULL, run_part, &parts[t]);
    run_part(&parts[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_part(&parts[t]); /* (no thread to be had: done here) */
    }
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
static size_t input_count(const struct custom_op *op) { (void)op; return 4; }
static size_t output_count(const struct custom_op *op) { (void)op; return 1; }
static int output_type(const struct custom_op *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static int required(const struct custom_op *op, size_t i) { (void)op; (void)i; return 0; }

static int input_type(const struct custom_op *op, size_t i) {
    if (i == 0) return ELEM_FLOAT;
    if (i == 3) return ELEM_INT64;
    int kind = ((const attend_op *)op)->kind;
    return kind == KV_I8 ? ELEM_INT8 : kind == KV_F16 ? ELEM_FLOAT16 : ELEM_FLOAT;
}

#define ATTEND_OP(label, kind)                                                                    \
    {{OP_VERSION, create, op_name, provider, input_type, input_count, output_type, output_count, compute, \
      destroy, required, required},                                                                 \
     label, kind}

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
    void *domain = NULL;
    status_t status = CALL(api, CREATE_DOMAIN, create_domain_fn)("edgelite", &domain);
    for (int i = 0; !status && i < OPS; i++) status = CALL(api, DOMAIN_ADD, domain_add_fn)(domain, &ops[i].op);
    if (!status) status = CALL(api, ADD_DOMAIN, add_domain_fn)(options, domain);
    return status;
}
