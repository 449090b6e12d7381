/* edgelite's operators as onnxruntime sees them, and the choice of a path for each.
 *
 * Operators (domain "edgelite"):
 *
 * Attend (float32 KV), Attend16 (float16 KV), Attend8 (int8 KV: a row of d codes, then its step
 * as an exponent byte e and a mantissa byte b, the values code * 2^e * (1 + (b + 128) / 256):
 * exact in float32). Each does a layer's whole attention step, what GroupQueryAttention does:
 * it turns the step's queries and keys by the rotary tables, writes the keys and values into the
 * KV at the step's positions, and attends (the chosen path's attend function, tile by tile).
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
 *   attributes: num_heads, kv_num_heads, local_window_size (-1: none), scale (0: d^-1/2),
 *               threads
 *
 * MatMul4, MatMul6, MatMul4K, MatMul8: products with narrow weights read as they are stored
 * (engine/linear.py rewrites a fast export's MatMulNBits as a range loads):
 *   MatMul4: 4-bit codes in blocks of 32 (MatMulNBits bits 4, block_size 32, accuracy_level 4,
 *   zero point 8): 4 bits and a float scale a block, where MatMulNBits holds about 6.
 *     inputs:  a       float32 (..., K)
 *              codes   uint8 (N/4, B/4, 4, 64): four columns' codes interleaved, 64 bytes (4
 *                      blocks, two codes a byte: the block's element 2j in byte j's low half,
 *                      2j + 1 in its high half, as MatMulNBits holds them) of each column in
 *                      turn, then the next 4 blocks; B: the blocks of K padded to a multiple of 4
 *              scales  float32 (N/4, B/4, 4, 4): the same order, one a block
 *     output:  float32 (..., N): y[n] = sum over blocks b of scale[n, b] step[b]
 *              sum_j (code[n, b, j] - 8) x[b, j]
 *     attributes: K, N, threads
 *   MatMul6: 6-bit codes in blocks of 16 with a K-quant's scales (Q6_K as the exporter stores
 *   it: each block's scale a float per 256 weights times a signed byte per block): 6.56 bits a
 *   weight, where MatMulNBits holds about 12.
 *     inputs:  a       float32 (..., K)
 *              codes   uint8 (N/4, K/256, 4, 192): each column's 256 codes of a super-block as
 *                      the export's stream holds them (8 codes in 6 bytes, code i at bit 6i),
 *                      four columns in turn, then the next super-block
 *              mult    int8 (N/4, K/256, 4, 16): each block's multiple, the same order
 *              base    float32 (N/4, K/256, 4): each super-block's scale
 *     output:  float32 (..., N): y[n] = sum over blocks b of base[n, b / 16] mult[n, b] step[b]
 *              sum_j (code[n, b, j] - zero) x[b, j]
 *     attributes: K, N, zero (the codes' zero point), threads
 *   MatMul4K: Q4_K's products whole (4-bit codes in blocks of 32, each block's scale d x sc and
 *   minimum dmin x m): 4.625 bits a weight.
 *     inputs:  a       float32 (..., K), K a multiple of 256
 *              codes   uint8 (N/4, K/128, 4, 64): as MatMul4's
 *              mult    uint8 (N/4, K/256, 2, 4, 8): a super-block's 8 scale multiples sc of each
 *                      of the four columns in turn, then their 8 minimum multiples m
 *              base    float16 (N/4, K/256, 8): the four columns' d, then their e (dmin, signed)
 *     output:  float32 (..., N): y[n] = sum over blocks b of d sc[n, b] step[b] sum_j (code[n,
 *              b, j] - 8) x[b, j] + (8 d sc[n, b] + e m[n, b]) sum_j a[b, j]
 *     attributes: K, N, threads
 *   MatMul8: 8-bit codes in blocks of 32 (MatMulNBits bits 8, block_size 32, no zero points).
 *     inputs:  a       float32 (..., K), K a multiple of 64
 *              codes   uint8 (N/4, K/64, 4, 64): each column's 64 codes (2 blocks) in turn, four
 *                      columns, then the next 64
 *              scales  float32 (N/4, K/64, 4, 2): the same order, one a block
 *     output:  float32 (..., N): y[n] = sum over blocks b of scale[n, b] step[b] sum_j (code[n,
 *              b, j] - zero) x[b, j]
 *     attributes: K, N, zero (the codes' zero point: MatMulNBits' is 128), threads
 *   Each row of a is quantized per block here as MatMulNBits' level 4 does: codes round(a x 127
 *   / largest) (to even) and a step, largest / 127 (blocks of 32; MatMul6: 16); the chosen
 *   path's function then sums each block in integers (kernels.h: the canonical order).
 *
 * The onnxruntime C API is used through its function table (ortop.h). Which path runs each
 * operator is chosen once, when onnxruntime registers the library: the best path built into it
 * whose CPU features this CPU has (x86: cpuid and the OS's saved register state; ARM:
 * getauxval), or the one EDGELITE_KERNEL_PATH names (and those below it: tests, benchmarks). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ortop.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif

#define EXPORT __attribute__((visibility("default")))

int has_pool; /* the loading onnxruntime has KernelContext_ParallelFor */

/* ---- the CPU and the paths ---------------------------------------------------------------- */

static unsigned cpu_features(void) {
    unsigned f = 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int fma = c >> 12 & 1, f16c = c >> 29 & 1, osxsave = c >> 27 & 1, avx = c >> 28 & 1;
    unsigned long long xcr0 = 0;
    if (osxsave) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((unsigned long long)hi << 32) | lo;
    }
    int ymm = avx && (xcr0 & 6) == 6, zmm = ymm && (xcr0 & 0xe0) == 0xe0; /* (the OS saves them) */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (ymm && fma && f16c && (b >> 5 & 1)) f |= FEAT_AVX2;
    int avx512 = (b >> 16 & 1) && (b >> 17 & 1) && (b >> 30 & 1) && (b >> 31 & 1) && /* F DQ BW VL */
                 (c >> 1 & 1) && (c >> 11 & 1);                                       /* VBMI VNNI */
    if (zmm && (f & FEAT_AVX2) && avx512) f |= FEAT_AVX512;
#elif defined(__aarch64__)
    unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if (hw & (1UL << 1)) f |= FEAT_NEON;              /* HWCAP_ASIMD */
    if ((f & FEAT_NEON) && (hw & (1UL << 20))) f |= FEAT_DOTPROD; /* HWCAP_ASIMDDP */
    if ((f & FEAT_DOTPROD) && (hw2 & (1UL << 13))) f |= FEAT_I8MM; /* HWCAP2_I8MM */
#endif
    return f;
}

/* best first: each operator runs on the first of these that is built, usable and has it */
static const kpath *all_paths(int i) {
    const kpath *order[] = {&kpath_avx512, &kpath_avx2, &kpath_i8mm, &kpath_dotprod, &kpath_neon, &kpath_ref};
    return i < (int)(sizeof(order) / sizeof(order[0])) ? order[i] : (const kpath *)-1;
}

static const kpath *mm_path[MM_KINDS], *at_path[KV_KINDS], *nm_path;
static pthread_mutex_t choice_lock = PTHREAD_MUTEX_INITIALIZER;
static int chosen;

/* each operator's path: the best usable one at or below `only` (NULL or "": the best) */
static int choose(const char *only) {
    unsigned have = cpu_features();
    int below = !only || !*only, found = below;
    for (int k = 0; k < MM_KINDS; k++) mm_path[k] = NULL;
    for (int k = 0; k < KV_KINDS; k++) at_path[k] = NULL;
    nm_path = NULL;
    for (int i = 0; all_paths(i) != (const kpath *)-1; i++) {
        const kpath *p = all_paths(i);
        if (!p) continue;
        if (!below && strcmp(p->name, only) == 0) below = found = (p->needs & ~have) == 0;
        if (!below || (p->needs & ~have)) continue;
        if (p->init) p->init();
        for (int k = 0; k < MM_KINDS; k++)
            if (!mm_path[k] && p->matmul[k]) mm_path[k] = p;
        for (int k = 0; k < KV_KINDS; k++)
            if (!at_path[k] && p->attend[k]) at_path[k] = p;
        if (!nm_path && p->norm) nm_path = p;
    }
    chosen = 1;
    return found;
}

static void choose_once(void) {
    pthread_mutex_lock(&choice_lock);
    if (!chosen) choose(getenv("EDGELITE_KERNEL_PATH"));
    pthread_mutex_unlock(&choice_lock);
}

/* the paths this library chose for its operators, e.g. "MatMul4=avx512 ... Attend8=avx512" */
EXPORT const char *edgelite_kernel_paths(void) {
    static const char *mm_names[MM_KINDS] = {"MatMul4", "MatMul6", "MatMul4K", "MatMul8"};
    static const char *at_names[KV_KINDS] = {"Attend", "Attend16", "Attend8"};
    static char text[256];
    choose_once();
    pthread_mutex_lock(&choice_lock);
    size_t used = 0;
    for (int k = 0; k < MM_KINDS; k++)
        used += (size_t)snprintf(text + used, sizeof(text) - used, "%s=%s ", mm_names[k], mm_path[k]->name);
    for (int k = 0; k < KV_KINDS; k++)
        used += (size_t)snprintf(text + used, sizeof(text) - used, "%s=%s ", at_names[k], at_path[k]->name);
    snprintf(text + used, sizeof(text) - used, "Norm=%s", nm_path->name);
    pthread_mutex_unlock(&choice_lock);
    return text;
}

/* bit i: product i (MM4, MM6, MM4K, MM8) runs on a vector path here (engine/linear.py rewrites
 * only those: elsewhere onnxruntime's MatMulNBits is the faster) */
EXPORT int edgelite_matmul_fast(void) {
    choose_once();
    int mask = 0;
    for (int k = 0; k < MM_KINDS; k++) mask |= (mm_path[k] != &kpath_ref) << k;
    return mask;
}

/* run every operator on the path named (and those below it for what it lacks): 1, or 0 when
 * it is not in the library or this CPU cannot run it (tests and benchmarks) */
EXPORT int edgelite_kernel_use(const char *name) {
    pthread_mutex_lock(&choice_lock);
    int found = choose(name);
    pthread_mutex_unlock(&choice_lock);
    return found;
}

/* ---- products ----------------------------------------------------------------------------- */
#define MM_THREADS 16         /* threads a call may use */
#define MM_PARALLEL (1 << 20) /* rows x weights below which a call stays on its caller's thread */
#define MM_MAX_RANK 8

typedef struct {
    api_t api;
    int kind;
    int64_t k, n, zero, threads;
} mm_state;

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
        if (sums) /* MatMul4K: block b of super-block s at 16s + b % 8 and + 8 */
            sums[MM4K_SUMS * (b / 8) + b % 8] = sums[MM4K_SUMS * (b / 8) + b % 8 + 8] = exact;
        steps[b] = top / 127.0f;
        bias[b] = -(int32_t)zero * sum;
    }
}

static void *mm_run(void *arg) {
    const mm_job *job = (const mm_job *)arg;
    mm_path[job->kind]->matmul[job->kind](job);
    return NULL;
}

static void mm_indexed(void *parts, size_t i) { mm_run((mm_job *)parts + i); }

/* the product of `rows` rows of a (K values each) by the weights: y (rows x N). Returns 0, or
 * 1 when scratch could not be had (y then zeros) */
static int mm_core(const mm_state *st, const float *a, int64_t rows, const void *codes, const void *scales,
                   const void *base, int64_t blocks, float *y, void *ctx) {
    int kind = st->kind, split = kind == MM4 || kind == MM4K, summed = kind == MM4K;
    int64_t k = st->k, n = st->n, block = split ? MM4_BLOCK : kind == MM8 ? MM8_BLOCK : MM6_BLOCK;
    int64_t width = (split ? blocks * MM4_BLOCK / 2 : k) + MM_PAD, lanes = blocks + MM_PAD / 4;
    size_t code_bytes = (size_t)(rows * width), lane_bytes = (size_t)(rows * lanes) * sizeof(float);
    int64_t sum_width = summed ? blocks / 8 * MM4K_SUMS + MM_PAD / 4 : 0;
    size_t sum_bytes = (size_t)(rows * sum_width) * sizeof(float);
    char *scratch = (char *)malloc(2 * code_bytes + 2 * lane_bytes + sum_bytes + 64);
    memset(y, 0, (size_t)(rows * n) * sizeof(float));
    if (!scratch) return 1;
    qrows x = {.lo = (int8_t *)scratch, .hi = (int8_t *)(scratch + code_bytes),
               .steps = (float *)(scratch + 2 * code_bytes), .bias = (int32_t *)(scratch + 2 * code_bytes + lane_bytes),
               .sums = summed ? (float *)(scratch + 2 * code_bytes + 2 * lane_bytes) : NULL, .rows = rows,
               .blocks = blocks, .width = width, .lanes = lanes, .sum_width = sum_width, .own = NULL};
    for (int64_t r = 0; r < rows; r++)
        quantize_a(a + r * k, k, blocks, block, split, split ? 8 : st->zero, x.lo + r * width, x.hi + r * width,
                   x.steps + r * lanes, x.bias + r * lanes, summed ? x.sums + r * sum_width : NULL);
    const kpath *path = mm_path[kind];
    if (path->prep[kind] && !path->prep[kind](&x, kind)) {
        free(x.own);
        free(scratch);
        return 1;
    }
    int64_t groups = n / MM_GROUP, threads = st->threads < MM_THREADS ? st->threads : MM_THREADS;
    threads = rows * n * k < MM_PARALLEL ? 1 : threads < groups ? threads : groups;
    mm_job parts[MM_THREADS];
    for (int64_t t = 0; t < threads; t++)
        parts[t] = (mm_job){&x, kind, (const uint8_t *)codes, scales, base, y, rows, n, mm_units(kind, blocks),
                            mm_unit_bytes(kind), groups * t / threads, groups * (t + 1) / threads};
    run_parts(st->api, ctx, mm_run, mm_indexed, parts, sizeof(mm_job), threads);
    free(x.own);
    free(scratch);
    return 0;
}

/* the blocks of K the weights hold when their shapes fit K and N (0: they do not) */
static int64_t mm_blocks(const mm_state *st, const int64_t (*d)[MM_MAX_RANK], const size_t *rank) {
    int64_t k = st->k, n = st->n, groups = n / MM_GROUP;
    if (n % MM_GROUP || d[1][0] != groups || d[1][2] != MM_GROUP) return 0;
    if (st->kind == MM4) {
        int64_t blocks = d[1][1] * MM4_STEP;
        int fits = rank[1] == 4 && rank[2] == 4 && d[1][3] == 64 && blocks * MM4_BLOCK >= k &&
                   (blocks - MM4_STEP) * MM4_BLOCK < k && d[2][0] == groups && d[2][1] == d[1][1] &&
                   d[2][2] == MM_GROUP && d[2][3] == MM4_STEP;
        return fits ? blocks : 0;
    }
    if (st->kind == MM8) {
        int fits = k % MM8_UNIT == 0 && rank[1] == 4 && rank[2] == 4 && d[1][1] == k / MM8_UNIT &&
                   d[1][3] == MM8_UNIT && d[2][0] == groups && d[2][1] == k / MM8_UNIT && d[2][2] == MM_GROUP &&
                   d[2][3] == 2 && st->zero >= 0 && st->zero <= 255;
        return fits ? k / MM8_BLOCK : 0;
    }
    if (st->kind == MM4K) {
        int64_t supers = k / MM4K_SUPER;
        int fits = k % MM4K_SUPER == 0 && rank[1] == 4 && rank[2] == 5 && rank[3] == 3 && d[1][1] == 2 * supers &&
                   d[1][3] == 64 && d[2][0] == groups && d[2][1] == supers && d[2][2] == 2 && d[2][3] == MM_GROUP &&
                   d[2][4] == 8 && d[3][0] == groups && d[3][1] == supers && d[3][2] == 8;
        return fits ? k / MM4_BLOCK : 0;
    }
    int64_t supers = k / MM6_SUPER;
    int fits = k % MM6_SUPER == 0 && rank[1] == 4 && rank[2] == 4 && rank[3] == 3 && d[1][1] == supers &&
               d[1][3] == MM6_BYTES && d[2][0] == groups && d[2][1] == supers && d[2][2] == MM_GROUP &&
               d[2][3] == 16 && d[3][0] == groups && d[3][1] == supers && d[3][2] == MM_GROUP && st->zero >= 0 &&
               st->zero <= 255;
    return fits ? k / MM6_BLOCK : 0;
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
    int64_t rows = 1, out_dims[MM_MAX_RANK];
    for (size_t i = 0; i + 1 < rank[0]; i++) {
        if (d[0][i] < 0 || __builtin_mul_overflow(rows, d[0][i], &rows)) return;
        out_dims[i] = d[0][i];
    }
    out_dims[rank[0] - 1] = st->n;
    void *out_value = NULL, *y = NULL;
    if (!ok(api, CALL(api, OUTPUT, output_fn)(ctx, 0, out_dims, rank[0], &out_value)) || !out_value ||
        !ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(out_value, &y)))
        return;
    int64_t blocks = st->k > 0 && d[0][rank[0] - 1] == st->k ? mm_blocks(st, (const int64_t(*)[MM_MAX_RANK])d, rank) : 0;
    if (rows < 1 || !blocks) { /* (the graph is ours: never expected) zeros */
        if (rows > 0) memset(y, 0, (size_t)(rows * st->n) * sizeof(float));
        return;
    }
    mm_core(st, (const float *)data[0], rows, data[1], data[2], count > 3 ? data[3] : NULL, blocks, (float *)y, ctx);
}

typedef struct {
    struct custom_op op;
    const char *op_name;
    int kind;
} mm_op;

static int mm_kind(const struct custom_op *op) { return ((const mm_op *)op)->kind; }

static void *mm_create(const struct custom_op *op, api_t api, const void *info) {
    choose_once();
    mm_state *st = (mm_state *)calloc(1, sizeof(mm_state));
    if (!st) return NULL;
    st->api = api;
    st->kind = mm_kind(op);
    if (CALL(api, ATTR_INT, attr_int_fn)(info, "K", &st->k) || CALL(api, ATTR_INT, attr_int_fn)(info, "N", &st->n) ||
        st->k < 1 || st->n < 1 || st->k > (1 << 24) || st->n > (1 << 24))
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

static const mm_op matmul_ops[MM_KINDS] = {MM_OP("MatMul4", MM4), MM_OP("MatMul6", MM6), MM_OP("MatMul4K", MM4K),
                                           MM_OP("MatMul8", MM8)};

/* a product without onnxruntime (tests, the ARM harness): a (rows x k) by weights laid out as
 * the operator takes them, y (rows x n); 0, or -1 when the shapes are not the operator's */
EXPORT int edgelite_matmul(int kind, const float *a, int64_t rows, int64_t k, int64_t n, int64_t zero,
                           const void *codes, const void *scales, const void *base, float *y) {
    choose_once();
    if (kind < 0 || kind >= MM_KINDS || rows < 1 || k < 1 || n < 1 || n % MM_GROUP) return -1;
    mm_state st = {NULL, kind, k, n, zero, 1};
    int64_t blocks = kind == MM4 ? (k + 4 * MM4_BLOCK - 1) / (4 * MM4_BLOCK) * 4
                   : kind == MM8 ? (k % MM8_UNIT ? 0 : k / MM8_BLOCK)
                   : kind == MM4K ? (k % MM4K_SUPER ? 0 : k / MM4_BLOCK) : (k % MM6_SUPER ? 0 : k / MM6_BLOCK);
    if (!blocks) return -1;
    return mm_core(&st, a, rows, codes, scales, base, blocks, y, NULL) ? -1 : 0;
}

/* ---- attention ---------------------------------------------------------------------------- */
#define TILE_ROWS 16          /* query rows that share each KV block's reading */
#define TILE_BYTES (1 << 19)  /* a tile's scores at most (fewer rows at long contexts) */
#define MAX_THREADS 16        /* threads a call may use (the session's intra-op threads) */
#define PARALLEL_WORK 65536   /* rows x positions below which a call runs on its caller's thread */
#define MAX_HEADS 1024        /* query heads a layer may have */
#define MAX_POSITIONS (1 << 24) /* positions a KV may hold */

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

/* one step's shape, checked */
typedef struct {
    int64_t n, total, cap, d, half;
    int rotary;
} step_shape;

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
                                      (size_t)(rows * g) + 16) * sizeof(float));
    if (!scratch) return NULL; /* (those rows stay zero) */
    float *scores = scratch, *qs = scores + rows * g * span, *acc = qs + rows * g * d, *buf = acc + rows * g * d;
    /* buf: BLOCK x d floats and rows x g x d more (a path's scratch); then the int8 path's query
     * codes and their steps */
    int16_t *i16 = (int16_t *)(buf + BLOCK * d + rows * g * d + 16);
    float *steps = buf + BLOCK * d + 2 * rows * g * d + 16;
    attend_fn attend = at_path[w->k->kind]->attend[w->k->kind];
    int64_t tiles = (w->n + rows - 1) / rows;
    for (int64_t item = p->first; item < p->end; item++) {
        int64_t h = item / tiles, r0 = item % tiles * rows, m = w->n - r0 < rows ? w->n - r0 : rows;
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < g * d; i++) qs[r * g * d + i] = w->q[((r0 + r) * w->heads + h * g) * d + i] * w->scale;
        attend(qs, (const char *)w->keys + (size_t)h * w->plane, (const char *)w->values + (size_t)h * w->plane,
               w->start + r0, m, w->k->window, g, d, scores, buf, acc, i16, steps);
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
    else if (kind == KV_F16)
        for (int64_t i = 0; i < d; i++) ((uint16_t *)row)[i] = narrow(x[i]);
    else memcpy(row, x, (size_t)d * sizeof(float));
}

/* the step: its rows turned and written into the KV (kc, vc: planes of cap rows), then each
 * query row attends (out: n x heads x d). Returns 0, or 1 when scratch could not be had (out
 * then zeros) */
static int attend_core(const kernel *k, const step_shape *s, const float *q, const float *kn, const float *vn,
                       void *kc, void *vc, const float *cos, const float *sin, float *o, void *ctx) {
    int64_t n = s->n, heads = k->heads, kv = k->kv_heads, d = s->d, total = s->total;
    size_t item = k->kind == KV_F32 ? 4 : k->kind == KV_F16 ? 2 : 1, row_bytes = (size_t)(d + 2 * (k->kind == KV_I8)) * item;
    size_t plane = (size_t)s->cap * row_bytes;
    memset(o, 0, (size_t)(n * heads * d) * sizeof(float));
    float *qr = (float *)malloc((size_t)(n * heads * d + d) * sizeof(float)), *tmp = qr + n * heads * d;
    if (!qr) return 1;
    for (int64_t r = 0; r < n; r++) {
        int64_t pos = total - n + r;
        for (int64_t h = 0; h < heads; h++) {
            const float *x = q + (r * heads + h) * d;
            if (s->rotary) rotate(x, cos, sin, s->half, pos, d, qr + (r * heads + h) * d);
            else memcpy(qr + (r * heads + h) * d, x, (size_t)d * sizeof(float));
        }
        for (int64_t h = 0; h < kv; h++) {
            const float *x = kn + (r * kv + h) * d;
            if (s->rotary) rotate(x, cos, sin, s->half, pos, d, tmp), x = tmp;
            store_row(x, d, k->kind, (char *)kc + h * plane + (size_t)pos * row_bytes);
            store_row(vn + (r * kv + h) * d, d, k->kind, (char *)vc + h * plane + (size_t)pos * row_bytes);
        }
    }
    work w = {k, qr, kc, vc, o, n, heads, kv, heads / kv, d, total - n,
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
    run_parts(k->api, ctx, run_part, run_indexed, parts, sizeof(part), threads);
    free(qr);
    return 0;
}

/* whether a step of n rows, `total` positions after it, fits a KV of cap rows of head size d
 * and the operator's heads (every size below computed without overflow) */
static int step_fits(const kernel *k, const step_shape *s) {
    int64_t dummy;
    return s->n >= 1 && s->total >= s->n && s->total <= s->cap && s->cap <= MAX_POSITIONS && s->d >= LANES &&
           s->d % LANES == 0 && s->d <= MAX_D && k->heads >= 1 && k->heads <= MAX_HEADS && k->kv_heads >= 1 &&
           k->heads % k->kv_heads == 0 && (!s->rotary || (s->half >= 1 && 2 * s->half <= s->d)) &&
           !__builtin_mul_overflow(s->n, k->heads * s->d, &dummy) &&
           !__builtin_mul_overflow(s->cap, k->kv_heads * (s->d + 2) * 4, &dummy);
}

static int shape(api_t api, const void *value, int64_t *dims, size_t want) {
    return dims_of(api, value, dims, want) == want;
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
    int64_t extra = 2 * (k->kind == KV_I8);
    step_shape s = {qd[1], td[0] == 1 ? ((const int64_t *)data[IN_TOTAL])[0] : -1, kd[2], kd[3] - extra, cd[1], rotary};
    /* a step that does not fit the KV it is given (the graph is ours: never expected) leaves
     * zeros and the KV as it was rather than reading or writing outside the buffers */
    int64_t q_values;
    int fits = step_fits(k, &s) && qd[0] == 1 && kd[0] == 1 && kd[1] == k->kv_heads && !memcmp(kd, vd, sizeof(kd)) &&
               !__builtin_mul_overflow(k->heads, s.d, &q_values) && qd[2] == q_values && nd[0] == 1 && nd[1] == s.n &&
               nd[2] == k->kv_heads * s.d && !memcmp(nd, vnd, sizeof(nd)) && td[0] == 1 &&
               (!rotary || (!memcmp(cd, sd, sizeof(cd)) && cd[0] >= s.total));
    if (!fits) {
        int64_t count;
        if (qd[0] >= 0 && qd[1] >= 0 && qd[2] >= 0 && !__builtin_mul_overflow(qd[0] * qd[1], qd[2], &count))
            memset(o_data[0], 0, (size_t)count * sizeof(float));
        return;
    }
    size_t item = k->kind == KV_F32 ? 4 : k->kind == KV_F16 ? 2 : 1;
    /* the KV is bound in place (engine/kv.py): present is past's own buffer; else past is copied */
    if (o_data[1] != data[IN_PAST_K]) memcpy(o_data[1], data[IN_PAST_K], (size_t)(kd[0] * kd[1] * kd[2] * kd[3]) * item);
    if (o_data[2] != data[IN_PAST_V]) memcpy(o_data[2], data[IN_PAST_V], (size_t)(vd[0] * vd[1] * vd[2] * vd[3]) * item);
    attend_core(k, &s, (const float *)data[IN_Q], (const float *)data[IN_K], (const float *)data[IN_V], o_data[1],
                o_data[2], (const float *)data[IN_COS], (const float *)data[IN_SIN], (float *)o_data[0], ctx);
}

static void *create(const struct custom_op *op, api_t api, const void *info) {
    choose_once();
    kernel *k = (kernel *)calloc(1, sizeof(kernel));
    if (!k) return NULL;
    k->api = api;
    k->kind = ((const attend_op *)op)->kind;
    k->window = -1;
    if (CALL(api, ATTR_INT, attr_int_fn)(info, "num_heads", &k->heads) ||
        CALL(api, ATTR_INT, attr_int_fn)(info, "kv_num_heads", &k->kv_heads) || k->heads < 1 ||
        k->kv_heads < 1 || k->heads > MAX_HEADS || k->heads % k->kv_heads) {
        k->heads = k->kv_heads = 0; /* compute() then refuses every step (zeros) */
    }
    (void)CALL(api, ATTR_INT, attr_int_fn)(info, "local_window_size", &k->window);
    k->threads = 1;
    (void)CALL(api, ATTR_INT, attr_int_fn)(info, "threads", &k->threads);
    k->threads = k->threads < 1 ? 1 : k->threads;
    (void)CALL(api, ATTR_FLOAT, attr_float_fn)(info, "scale", &k->scale);
    if (!(k->scale >= 0.0f && k->scale < 1e30f)) k->scale = 0.0f;
    return k;
}

/* one attention step without onnxruntime (tests, the ARM harness): the KV planes kc and vc
 * (kv heads x cap rows) get the step's rows; out n x heads x d. 0, or -1 when the shapes do
 * not fit */
EXPORT int edgelite_attend(int kind, int64_t heads, int64_t kv_heads, int64_t window, float scale, int64_t n,
                           int64_t total, int64_t cap, int64_t d, int64_t half, const float *q, const float *k_new,
                           const float *v_new, void *kc, void *vc, const float *cos, const float *sin, float *out) {
    choose_once();
    if (kind < 0 || kind >= KV_KINDS) return -1;
    kernel k = {NULL, kind, heads, kv_heads, window, 1, scale};
    step_shape s = {n, total, cap, d, half, cos && sin};
    if (!step_fits(&k, &s)) return -1;
    return attend_core(&k, &s, q, k_new, v_new, kc, vc, cos, sin, out, NULL) ? -1 : 0;
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

static attend_op attend_ops[KV_KINDS] = {ATTEND_OP("Attend", KV_F32), ATTEND_OP("Attend16", KV_F16),
                                         ATTEND_OP("Attend8", KV_I8)};

/* ---- norms -------------------------------------------------------------------------------- *
 * Norm (x, scale; epsilon) -> y, and SkipNorm (x, skip, scale; epsilon) -> y, sum: RMS norms
 * over the last axis, d (a multiple of 8) values; scale (d); skip as x. What
 * SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization compute (engine/norms.py
 * rewrites them), the same bits on every ISA. */
#define NORM_MAX_D (1 << 16)

typedef struct {
    struct custom_op op;
    const char *op_name;
    int skip;
} norm_op;

typedef struct {
    api_t api;
    int skip;
    float eps;
} norm_state;

static void norm_compute(void *state, void *ctx) {
    const norm_state *st = (const norm_state *)state;
    api_t api = st->api;
    size_t count = st->skip ? 3 : 2, rank[3] = {0};
    const void *in[3] = {NULL};
    int64_t d[3][MM_MAX_RANK];
    void *data[3] = {NULL};
    for (size_t i = 0; i < count; i++)
        if (!ok(api, CALL(api, INPUT, input_fn)(ctx, i, &in[i])) || !in[i] || !(rank[i] = dims_of(api, in[i], d[i], MM_MAX_RANK)) ||
            !ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(in[i], &data[i])))
            return;
    int64_t rows = 1, dim = d[0][rank[0] - 1];
    for (size_t i = 0; i + 1 < rank[0]; i++)
        if (d[0][i] < 0 || __builtin_mul_overflow(rows, d[0][i], &rows)) return;
    void *outs[2] = {NULL, NULL}, *y = NULL, *sum = NULL;
    if (!ok(api, CALL(api, OUTPUT, output_fn)(ctx, 0, d[0], rank[0], &outs[0])) || !outs[0] ||
        !ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(outs[0], &y)))
        return;
    if (st->skip && ok(api, CALL(api, OUTPUT, output_fn)(ctx, 1, d[0], rank[0], &outs[1])) && outs[1])
        (void)ok(api, CALL(api, TENSOR_DATA, tensor_data_fn)(outs[1], &sum));
    int scale_at = st->skip ? 2 : 1;
    int fits = dim >= LANES && dim % LANES == 0 && dim <= NORM_MAX_D && rank[scale_at] == 1 && d[scale_at][0] == dim &&
               (!st->skip || (rank[1] == rank[0] && !memcmp(d[1], d[0], rank[0] * sizeof(int64_t))));
    if (!fits) { /* (the graph is ours: never expected) zeros */
        if (rows > 0 && dim > 0) memset(y, 0, (size_t)(rows * dim) * sizeof(float));
        return;
    }
    nm_path->norm((const float *)data[0], st->skip ? (const float *)data[1] : NULL, (const float *)data[scale_at],
                  st->eps, rows, dim, (float *)y, (float *)sum);
}

static void *norm_create(const struct custom_op *op, api_t api, const void *info) {
    choose_once();
    norm_state *st = (norm_state *)calloc(1, sizeof(norm_state));
    if (!st) return NULL;
    st->api = api;
    st->skip = ((const norm_op *)op)->skip;
    st->eps = 1e-6f;
    (void)CALL(api, ATTR_FLOAT, attr_float_fn)(info, "epsilon", &st->eps);
    return st;
}

static const char *norm_name(const struct custom_op *op) { return ((const norm_op *)op)->op_name; }
static int norm_type(const struct custom_op *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t norm_inputs(const struct custom_op *op) { return ((const norm_op *)op)->skip ? 3 : 2; }
static size_t norm_outputs(const struct custom_op *op) { return ((const norm_op *)op)->skip ? 2 : 1; }
static int norm_output_kind(const struct custom_op *op, size_t i) { (void)op; return i ? 1 : 0; /* (sum optional) */ }

#define NORM_OP(label, skip)                                                                                    \
    {{OP_VERSION, norm_create, norm_name, mm_provider, norm_type, norm_inputs, norm_type, norm_outputs,         \
      norm_compute, mm_destroy, mm_required, norm_output_kind},                                                  \
     label, skip}

static const norm_op norm_ops[2] = {NORM_OP("Norm", 0), NORM_OP("SkipNorm", 1)};

/* a norm without onnxruntime (tests, the ARM harness): rows x d (skip and sum may be NULL) */
EXPORT int edgelite_norm(const float *x, const float *skip, const float *g, float eps, int64_t rows, int64_t d,
                         float *y, float *sum) {
    choose_once();
    if (rows < 1 || d < LANES || d % LANES || d > NORM_MAX_D) return -1;
    nm_path->norm(x, skip, g, eps, rows, d, y, sum);
    return 0;
}

/* ---- registration ------------------------------------------------------------------------- */
EXPORT status_t RegisterCustomOps(void *options, const api_base_t *base) {
    api_t api = base->get_api(API_VERSION);
    if (!api) return NULL; /* cannot even report it; the session then fails on the unknown op */
    const char *v = base->version ? base->version() : NULL; /* "1.29.0" */
    if (v) {
        char *rest = NULL;
        long major = strtol(v, &rest, 10), minor = rest && *rest == '.' ? strtol(rest + 1, NULL, 10) : 0;
        has_pool = major > 1 || (major == 1 && minor >= PARALLEL_FOR_SINCE);
    }
    choose_once();
    void *domain = NULL;
    status_t status = CALL(api, CREATE_DOMAIN, create_domain_fn)("edgelite", &domain);
    for (int i = 0; !status && i < KV_KINDS; i++) status = CALL(api, DOMAIN_ADD, domain_add_fn)(domain, &attend_ops[i].op);
    for (int i = 0; !status && i < MM_KINDS; i++) status = CALL(api, DOMAIN_ADD, domain_add_fn)(domain, &matmul_ops[i].op);
    for (int i = 0; !status && i < 2; i++) status = CALL(api, DOMAIN_ADD, domain_add_fn)(domain, &norm_ops[i].op);
    if (!status) status = CALL(api, ADD_DOMAIN, add_domain_fn)(options, domain);
    return status;
}
