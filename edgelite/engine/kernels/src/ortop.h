/* The onnxruntime C API as edgelite's operators use it (engine/attend.c, engine/matmul.c):
 * OrtApi entries by index into its table of function pointers, whose order is fixed across
 * versions, and the OrtCustomOp layout. No onnxruntime header is needed. */
#ifndef EDGELITE_ORTOP_H
#define EDGELITE_ORTOP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#define API_VERSION 12 /* what this file asks onnxruntime for (1.12 and later give it) */
#define OP_VERSION 16  /* the OrtCustomOp layout below (up to KernelComputeV2: a step that does not fit
                        * its operator fails with a status naming it; onnxruntime 1.16 and later) */

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
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT8 = 3, ELEM_INT64 = 7, ELEM_FLOAT16 = 10 };
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

/* the loading onnxruntime has KernelContext_ParallelFor (set by RegisterCustomOps) */
extern int has_pool __attribute__((visibility("hidden")));

#define CALL(api, index, type) ((type)(api)[index])

/* 1 when onnxruntime's call succeeded; a failure's status is released */
static inline int ok(api_t api, status_t status) {
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
    void (*compute)(void *, void *); /* (NULL: compute_v2 from version 16) */
    void (*destroy)(void *);
    int (*input_kind)(const struct custom_op *, size_t);
    int (*output_kind)(const struct custom_op *, size_t);
    int (*input_memory)(const struct custom_op *, size_t); /* 13: OrtMemType (0: the default) */
    int (*variadic_in_arity)(const struct custom_op *);    /* 14: asked of variadic inputs only */
    int (*variadic_in_same)(const struct custom_op *);
    int (*variadic_out_arity)(const struct custom_op *);
    int (*variadic_out_same)(const struct custom_op *);
    status_t (*create_v2)(const struct custom_op *, api_t, const void *, void **); /* 16 (NULL: create) */
    status_t (*compute_v2)(void *, void *);                                        /* 16 */
};

/* the custom_op fields from version 13 on, the same for every operator here (compute_v2 apart) */
static inline int default_memory(const struct custom_op *op, size_t i) { (void)op; (void)i; return 0; }
static inline int not_variadic(const struct custom_op *op) { (void)op; return 0; }
#define OP_TAIL(compute_v2) default_memory, not_variadic, not_variadic, not_variadic, not_variadic, NULL, compute_v2

/* a failed step's status: "<op>: <what>" (onnxruntime fails the run with it) */
static inline status_t fail(api_t api, const char *op, const char *what) {
    char text[256];
    snprintf(text, sizeof(text), "%s: %s", op, what);
    return CALL(api, CREATE_STATUS, create_status_fn)(ERR_FAIL, text);
}

/* the status of an onnxruntime call that failed (returned as it is), or NULL */
#define TRY(call)                      \
    do {                               \
        status_t failed_ = (call);     \
        if (failed_) return failed_;   \
    } while (0)

/* a value's dims into dims[0..max) and its rank; 0 when onnxruntime cannot say or its rank is
 * over max */
static inline size_t dims_of(api_t api, const void *value, int64_t *dims, size_t max) {
    void *info = NULL;
    size_t rank = 0;
    if (!ok(api, CALL(api, TYPE_AND_SHAPE, type_and_shape_fn)(value, &info))) return 0;
    int good = ok(api, CALL(api, DIMS_COUNT, dims_count_fn)(info, &rank)) && rank <= max &&
               ok(api, CALL(api, DIMS, dims_fn)(info, dims, rank));
    CALL(api, RELEASE_SHAPE, release_fn)(info);
    return good ? rank : 0;
}

#define RUN_PARTS_MAX 16 /* parts run_parts takes (an operator's threads at most) */

/* fn over `count` parts (each `size` bytes from `parts`): on onnxruntime's intra-op pool where it
 * has one (`indexed(parts, i)` runs part i: KernelContext_ParallelFor; a part that ran twice
 * after a failed call writes the same results again), else on threads of our own, the first
 * on the caller's (a part no thread could be had for: there too) */
static inline void run_parts(api_t api, void *ctx, void *(*fn)(void *), void (*indexed)(void *, size_t),
                             void *parts, size_t size, int64_t count) {
    if (count > 1 && has_pool &&
        ok(api, CALL(api, PARALLEL_FOR, parallel_for_fn)(ctx, indexed, (size_t)count, 0, parts)))
        return;
    pthread_t ids[RUN_PARTS_MAX];
    int started[RUN_PARTS_MAX] = {0};
    count = count < RUN_PARTS_MAX ? count : RUN_PARTS_MAX;
    for (int64_t t = 1; t < count; t++) started[t] = !pthread_create(&ids[t], NULL, fn, (char *)parts + t * size);
    fn(parts);
    for (int64_t t = 1; t < count; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else fn((char *)parts + t * size);
    }
}

#endif
