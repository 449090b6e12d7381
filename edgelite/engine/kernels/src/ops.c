/* edgelite's operators as onnxruntime sees them, and the choice of a path for each.
 *
 * Operators (domain "edgelite"):
 *
 * Attend, Attend16, Attend8 (op_attend.h), MatMul4, MatMul6, MatMul4K, MatMul8 (op_matmul.h),
 * Norm, SkipNorm (op_norm.h): each file gives its operators' inputs, outputs and attributes.
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

#include "op_matmul.h"
#include "op_attend.h"
#include "op_norm.h"

/* the paths this library chose for its operators, e.g. "MatMul4=avx512 ... Attend8=avx512" */
EXPORT const char *edgelite_kernel_paths(void) {
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

/* bit i: product i (MM4, MM6, MM4K, MM8) runs on a vector path here (engine/passes/linear.py rewrites
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
