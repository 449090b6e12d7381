/* The products: MatMul4, MatMul6, MatMul4K, MatMul8 (ops.c includes this file: the operators compile as one unit, beside the paths).
 *
 * MatMul4, MatMul6, MatMul4K, MatMul8: products with narrow weights read as they are stored
 * (engine/passes/linear.py rewrites a fast export's MatMulNBits as a range loads):
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
 */
#ifndef EDGELITE_OP_MATMUL_H
#define EDGELITE_OP_MATMUL_H

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

static const char *const mm_names[MM_KINDS] = {"MatMul4", "MatMul6", "MatMul4K", "MatMul8"};

/* the first `count` inputs' dims (rank 1 to MM_MAX_RANK) and data; NULL, or a status naming
 * what was wrong (the products' and the norms') */
static status_t ranked_inputs(api_t api, void *ctx, const char *name, size_t count, int64_t (*d)[MM_MAX_RANK],
                              size_t *rank, void **data) {
    for (size_t i = 0; i < count; i++) {
        const void *in = NULL;
        TRY(CALL(api, INPUT, input_fn)(ctx, i, &in));
        if (!in) return fail(api, name, "a required input is missing");
        if (!(rank[i] = dims_of(api, in, d[i], MM_MAX_RANK)))
            return fail(api, name, "an input is a scalar or of rank over 8");
        TRY(CALL(api, TENSOR_DATA, tensor_data_fn)(in, &data[i]));
    }
    return NULL;
}

static status_t mm_compute_v2(void *state, void *ctx) {
    const mm_state *st = (const mm_state *)state;
    api_t api = st->api;
    const char *name = mm_names[st->kind];
    size_t count = st->kind == MM4 || st->kind == MM8 ? 3 : 4, rank[4] = {0};
    int64_t d[4][MM_MAX_RANK];
    void *data[4] = {NULL};
    TRY(ranked_inputs(api, ctx, name, count, d, rank, data));
    int64_t rows = 1, out_dims[MM_MAX_RANK], values;
    for (size_t i = 0; i + 1 < rank[0]; i++) {
        if (d[0][i] < 0 || __builtin_mul_overflow(rows, d[0][i], &rows)) return fail(api, name, "a's rows overflow");
        out_dims[i] = d[0][i];
    }
    out_dims[rank[0] - 1] = st->n;
    /* weights that do not fit K and N (a graph edgelite's exporter did not write) fail before
     * anything is allocated or read */
    int64_t blocks = st->k > 0 && d[0][rank[0] - 1] == st->k ? mm_blocks(st, (const int64_t(*)[MM_MAX_RANK])d, rank) : 0;
    if (!blocks || __builtin_mul_overflow(rows, st->n, &values)) {
        char what[160];
        snprintf(what, sizeof(what), "the weights do not fit K %lld and N %lld (a's last axis %lld)", (long long)st->k,
                 (long long)st->n, (long long)d[0][rank[0] - 1]);
        return fail(api, name, what);
    }
    void *out_value = NULL, *y = NULL;
    TRY(CALL(api, OUTPUT, output_fn)(ctx, 0, out_dims, rank[0], &out_value));
    if (!out_value) return fail(api, name, "onnxruntime gave no output");
    TRY(CALL(api, TENSOR_DATA, tensor_data_fn)(out_value, &y));
    if (rows == 0) return NULL; /* (no rows: an empty output) */
    if (mm_core(st, (const float *)data[0], rows, data[1], data[2], count > 3 ? data[3] : NULL, blocks, (float *)y, ctx))
        return fail(api, name, "out of memory for the product's scratch");
    return NULL;
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
    if (!ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "K", &st->k)) ||
        !ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "N", &st->n)) || st->k < 1 || st->n < 1 ||
        st->k > (1 << 24) || st->n > (1 << 24))
        st->k = st->n = 0; /* mm_compute_v2() then fails every call, naming them */
    st->zero = 32;
    (void)ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "zero", &st->zero));
    st->threads = 1;
    (void)ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "threads", &st->threads));
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
      NULL, mm_destroy, mm_required, mm_required, OP_TAIL(mm_compute_v2)},                                 \
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

#endif
