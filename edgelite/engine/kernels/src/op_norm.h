/* The norms: Norm, SkipNorm (ops.c includes this file: the operators compile as one unit, beside the paths).
 *
 * Their inputs and attributes: below.
 */
#ifndef EDGELITE_OP_NORM_H
#define EDGELITE_OP_NORM_H

/* ---- norms -------------------------------------------------------------------------------- *
 * Norm (x, scale; epsilon) -> y, and SkipNorm (x, skip, scale; epsilon) -> y, sum: RMS norms
 * over the last axis, d (a multiple of 8) values; scale (d); skip as x. What
 * SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization compute (engine/passes/norms.py
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

static status_t norm_compute_v2(void *state, void *ctx) {
    const norm_state *st = (const norm_state *)state;
    api_t api = st->api;
    const char *name = st->skip ? "SkipNorm" : "Norm";
    size_t count = st->skip ? 3 : 2, rank[3] = {0};
    int64_t d[3][MM_MAX_RANK];
    void *data[3] = {NULL};
    TRY(ranked_inputs(api, ctx, name, count, d, rank, data));
    int64_t rows = 1, dim = d[0][rank[0] - 1];
    for (size_t i = 0; i + 1 < rank[0]; i++)
        if (d[0][i] < 0 || __builtin_mul_overflow(rows, d[0][i], &rows)) return fail(api, name, "x's rows overflow");
    int scale_at = st->skip ? 2 : 1;
    int fits = dim >= LANES && dim % LANES == 0 && dim <= NORM_MAX_D && rank[scale_at] == 1 && d[scale_at][0] == dim &&
               (!st->skip || (rank[1] == rank[0] && !memcmp(d[1], d[0], rank[0] * sizeof(int64_t))));
    if (!fits) {
        char what[120];
        snprintf(what, sizeof(what), "x's last axis %lld and the scale's do not fit (a multiple of %d up to %d)",
                 (long long)dim, LANES, NORM_MAX_D);
        return fail(api, name, what);
    }
    void *outs[2] = {NULL, NULL}, *y = NULL, *sum = NULL;
    TRY(CALL(api, OUTPUT, output_fn)(ctx, 0, d[0], rank[0], &outs[0]));
    if (!outs[0]) return fail(api, name, "onnxruntime gave no output");
    TRY(CALL(api, TENSOR_DATA, tensor_data_fn)(outs[0], &y));
    if (st->skip && ok(api, CALL(api, OUTPUT, output_fn)(ctx, 1, d[0], rank[0], &outs[1])) && outs[1])
        TRY(CALL(api, TENSOR_DATA, tensor_data_fn)(outs[1], &sum));
    if (rows > 0)
        nm_path->norm((const float *)data[0], st->skip ? (const float *)data[1] : NULL, (const float *)data[scale_at],
                      st->eps, rows, dim, (float *)y, (float *)sum);
    return NULL;
}

static void *norm_create(const struct custom_op *op, api_t api, const void *info) {
    choose_once();
    norm_state *st = (norm_state *)calloc(1, sizeof(norm_state));
    if (!st) return NULL;
    st->api = api;
    st->skip = ((const norm_op *)op)->skip;
    st->eps = 1e-6f;
    (void)ok(api, CALL(api, ATTR_FLOAT, attr_float_fn)(info, "epsilon", &st->eps));
    return st;
}

static const char *norm_name(const struct custom_op *op) { return ((const norm_op *)op)->op_name; }
static int norm_type(const struct custom_op *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t norm_inputs(const struct custom_op *op) { return ((const norm_op *)op)->skip ? 3 : 2; }
static size_t norm_outputs(const struct custom_op *op) { return ((const norm_op *)op)->skip ? 2 : 1; }
static int norm_output_kind(const struct custom_op *op, size_t i) { (void)op; return i ? 1 : 0; /* (sum optional) */ }

#define NORM_OP(label, skip)                                                                                    \
    {{OP_VERSION, norm_create, norm_name, mm_provider, norm_type, norm_inputs, norm_type, norm_outputs,         \
      NULL, mm_destroy, mm_required, norm_output_kind, OP_TAIL(norm_compute_v2)},                        \
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

#endif
