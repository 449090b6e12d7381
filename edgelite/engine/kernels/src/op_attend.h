/* The attention: Attend, Attend16, Attend8 (ops.c includes this file: the operators compile as one unit, beside the paths).
 *
 * Attend (float32 KV), Attend16 (float16 KV), Attend8 (int8 KV: a row of d codes, then its step
 * as an exponent byte e and a mantissa byte b, the values code * 2^e * (1 + (b + 128) / 256):
 * exact in float32). Each does a layer's whole attention step, what GroupQueryAttention does:
 * it turns the step's queries and keys by the rotary tables, writes the keys and values into the
 * KV at the step's positions, and attends (the chosen path's attend function, tile by tile).
 *   inputs:  q       float32 (B, n, heads * d), not yet turned (B sessions' steps, B >= 1)
 *            k, v    float32 (B, n, kv_heads * d): the step's keys (not yet turned) and values
 *            key     (B, kv_heads, capacity, d) (int8: d + 2): the KV, bound in place
 *            value   (B, kv_heads, capacity, d) (int8: d + 2)
 *            total   int64 (B): each session's positions valid after this step (the step's
 *                    rows are the last n of them); each computed as it would be alone
 *            cos, sin  float32 (positions, rot / 2), optional: the rotary tables (none: no turn)
 *   outputs: float32 (B, n, heads * d); key and value with the step's rows written (where
 *            they are bound to the inputs' buffers, as engine/kv.py binds them, nothing else
 *            is copied)
 *   attributes: num_heads, kv_num_heads, local_window_size (-1: none), scale (0: d^-1/2),
 *               threads
 *
 */
#ifndef EDGELITE_OP_ATTEND_H
#define EDGELITE_OP_ATTEND_H

/* ---- attention ---------------------------------------------------------------------------- */
#define TILE_ROWS 16          /* query rows that share each KV block's reading */
#define TILE_BYTES (1 << 19)  /* a tile's scores at most (fewer rows at long contexts) */
#define MAX_THREADS 16        /* threads a call may use (the session's intra-op threads) */
#define PARALLEL_WORK 65536   /* rows x positions below which a call runs on its caller's thread */
#define MAX_HEADS 1024        /* query heads a layer may have */
#define MAX_POSITIONS (1 << 24) /* positions a KV may hold */
#define MAX_BATCH 256         /* sessions one call may step together */

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
    int failed;         /* its scratch could not be had (its rows left zero) */
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
    if (!scratch) {
        ((part *)arg)->failed = 1;
        return NULL;
    }
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
    for (int64_t t = 0; t < threads; t++) parts[t] = (part){&w, w.items * t / threads, w.items * (t + 1) / threads, 0};
    run_parts(k->api, ctx, run_part, run_indexed, parts, sizeof(part), threads);
    free(qr);
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= parts[t].failed;
    return failed;
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

static status_t compute_v2(void *state, void *ctx) {
    kernel *k = (kernel *)state;
    api_t api = k->api;
    const char *name = k->kind == KV_I8 ? "Attend8" : k->kind == KV_F16 ? "Attend16" : "Attend";
    const void *in[INPUTS] = {0};
    for (size_t i = 0; i < INPUTS; i++) {
        TRY(CALL(api, INPUT, input_fn)(ctx, i, &in[i]));
        if (!in[i] && i < IN_COS) return fail(api, name, "a required input is missing");
    }
    int64_t qd[3], nd[3], vnd[3], kd[4], vd[4], td[1], cd[2] = {0, 0}, sd[2] = {0, 0};
    int rotary = in[IN_COS] && in[IN_SIN];
    if (!shape(api, in[IN_Q], qd, 3) || !shape(api, in[IN_K], nd, 3) || !shape(api, in[IN_V], vnd, 3) ||
        !shape(api, in[IN_PAST_K], kd, 4) || !shape(api, in[IN_PAST_V], vd, 4) || !shape(api, in[IN_TOTAL], td, 1) ||
        (rotary && (!shape(api, in[IN_COS], cd, 2) || !shape(api, in[IN_SIN], sd, 2))))
        return fail(api, name, "an input's rank is not the operator's (q, k, v 3; the KV 4; total 1; cos, sin 2)");
    void *data[INPUTS] = {0};
    for (int i = 0; i < INPUTS; i++)
        if (in[i]) TRY(CALL(api, TENSOR_DATA, tensor_data_fn)(in[i], &data[i]));
    int64_t extra = 2 * (k->kind == KV_I8);
    /* a batch of B sessions' steps (B >= 1): row b's q, k, v, out and KV slot (kv_heads x cap
     * rows each), its own total; each row computed as it would be alone */
    int64_t batch = qd[0];
    const int64_t *totals = (const int64_t *)data[IN_TOTAL];
    step_shape s = {qd[1], td[0] == batch && batch >= 1 ? totals[0] : -1, kd[2], kd[3] - extra, cd[1], rotary};
    /* a step that does not fit the KV it is given or the operator's heads (a graph edgelite's
     * exporter did not write) fails before anything is allocated, read or written */
    int64_t q_values;
    int fits = batch >= 1 && batch <= MAX_BATCH && step_fits(k, &s) && kd[0] == batch && kd[1] == k->kv_heads &&
               !memcmp(kd, vd, sizeof(kd)) && !__builtin_mul_overflow(k->heads, s.d, &q_values) && qd[2] == q_values &&
               nd[0] == batch && nd[1] == s.n && nd[2] == k->kv_heads * s.d && !memcmp(nd, vnd, sizeof(nd)) &&
               td[0] == batch;
    for (int64_t b = 0; fits && b < batch; b++) {
        step_shape sb = s;
        sb.total = totals[b];
        fits = step_fits(k, &sb) && (!rotary || (!memcmp(cd, sd, sizeof(cd)) && cd[0] >= sb.total));
    }
    if (!fits) {
        char what[200];
        snprintf(what, sizeof(what),
                 "the step does not fit: q (%lld, %lld, %lld), KV (%lld, %lld, %lld, %lld), total %lld, num_heads %lld, "
                 "kv_num_heads %lld",
                 (long long)qd[0], (long long)qd[1], (long long)qd[2], (long long)kd[0], (long long)kd[1],
                 (long long)kd[2], (long long)kd[3], (long long)s.total, (long long)k->heads, (long long)k->kv_heads);
        return fail(api, name, what);
    }
    void *outs[3] = {NULL, NULL, NULL}, *o_data[3];
    const int64_t *dims[3] = {qd, kd, vd};
    for (int i = 0; i < 3; i++) {
        TRY(CALL(api, OUTPUT, output_fn)(ctx, (size_t)i, dims[i], i ? 4 : 3, &outs[i]));
        if (!outs[i]) return fail(api, name, "onnxruntime gave no output");
        TRY(CALL(api, TENSOR_DATA, tensor_data_fn)(outs[i], &o_data[i]));
    }
    size_t item = k->kind == KV_F32 ? 4 : k->kind == KV_F16 ? 2 : 1;
    /* the KV is bound in place (engine/kv.py): present is past's own buffer; else past is copied
     * (its size checked by step_fits) */
    if (o_data[1] != data[IN_PAST_K]) memcpy(o_data[1], data[IN_PAST_K], (size_t)(kd[0] * kd[1] * kd[2] * kd[3]) * item);
    if (o_data[2] != data[IN_PAST_V]) memcpy(o_data[2], data[IN_PAST_V], (size_t)(vd[0] * vd[1] * vd[2] * vd[3]) * item);
    size_t slot = (size_t)(kd[1] * kd[2] * kd[3]) * item, q_row = (size_t)(s.n * qd[2]), kv_row = (size_t)(s.n * nd[2]);
    for (int64_t b = 0; b < batch; b++) {
        step_shape sb = s;
        sb.total = totals[b];
        if (attend_core(k, &sb, (const float *)data[IN_Q] + b * q_row, (const float *)data[IN_K] + b * kv_row,
                        (const float *)data[IN_V] + b * kv_row, (char *)o_data[1] + b * slot, (char *)o_data[2] + b * slot,
                        (const float *)data[IN_COS], (const float *)data[IN_SIN], (float *)o_data[0] + b * q_row, ctx))
            return fail(api, name, "out of memory for the step's scratch");
    }
    return NULL;
}

static void *create(const struct custom_op *op, api_t api, const void *info) {
    choose_once();
    kernel *k = (kernel *)calloc(1, sizeof(kernel));
    if (!k) return NULL;
    k->api = api;
    k->kind = ((const attend_op *)op)->kind;
    k->window = -1;
    /* heads out of range (step_fits) fail every step, naming them */
    if (!ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "num_heads", &k->heads)) ||
        !ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "kv_num_heads", &k->kv_heads)))
        k->heads = k->kv_heads = 0;
    (void)ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "local_window_size", &k->window));
    k->threads = 1;
    (void)ok(api, CALL(api, ATTR_INT, attr_int_fn)(info, "threads", &k->threads));
    k->threads = k->threads < 1 ? 1 : k->threads;
    (void)ok(api, CALL(api, ATTR_FLOAT, attr_float_fn)(info, "scale", &k->scale));
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
    {{OP_VERSION, create, op_name, provider, input_type, input_count, output_type, output_count, NULL, \
      destroy, input_kind, output_kind, OP_TAIL(compute_v2)},                                            \
     label, kind}

static attend_op attend_ops[KV_KINDS] = {ATTEND_OP("Attend", KV_F32), ATTEND_OP("Attend16", KV_F16),
                                         ATTEND_OP("Attend8", KV_I8)};

#endif
