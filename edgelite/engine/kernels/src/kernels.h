/* edgelite's operators: what every compile unit of the library shares.
 *
 * The library is a few compile units that engine/kernels/build.py compiles on the device, each
 * with its own flags, and links into one shared object:
 *   ops.c         the operators as onnxruntime sees them (inputs, shapes, attributes, threads),
 *                 the step's KV rows written, a product's rows quantized; which path runs each
 *                 operator (chosen once from the CPU's features: cpuid, getauxval); plain C
 *                 entry points the tests and the ARM harness call without onnxruntime
 *   ref.c         the reference path: every operator in plain C (and GCC vector extensions),
 *                 its sums in the order every other path gives bit for bit
 *   x86_avx2.c    AVX2 + FMA + F16C            arm_neon.c     ARMv8.0 NEON
 *   x86_avx512.c  AVX-512 VNNI + VBMI          arm_dotprod.c  ARMv8.2 dotprod (SDOT)
 *                                              arm_i8mm.c     ARMv8.2 dotprod + i8mm (SMMLA)
 * A path is a `kpath`: a function for each operator it has (NULL: a lower path's runs). Every
 * unit is built with -ffp-contract=off (no multiply-add fused unless written so), so the same
 * source gives the same bits on every compiler and ISA, and each path's own code is written to
 * give the reference's: one golden digest (tests/test_kernel_paths.py) holds for all of them.
 *
 * Canonical order of a product's row (every kind): each block b's exact integer sum, plus its
 * correction, becomes a float t_b = (float)(dot_b + bias_b) and is fused into one of four
 * running sums, s[b % 4] = fmaf(t_b, scale_b * step_b, s[b % 4]), blocks in order; the row's
 * value is (s0 + s1) + (s2 + s3). MatMul4K adds (m0 + m1) + (m2 + m3) of four more, m[b % 4] =
 * fmaf(low_b, sum_b, m[b % 4]) (below). Integer sums are the
 * same in any order, so a path may take a block's products in any order and any lanes. */
#ifndef EDGELITE_KERNELS_H
#define EDGELITE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define HIDDEN __attribute__((visibility("hidden")))
#define KINLINE static inline __attribute__((always_inline))

/* ---- products ---------------------------------------------------------------------------- */
enum { MM4 = 0, MM6 = 1, MM4K = 2, MM8 = 3, MM_KINDS = 4 };
#define MM_GROUP 4         /* columns interleaved together */
#define MM_PAD 64          /* bytes after each quantized row (rows a power of two apart would share cache sets) */
#define MM_BAND_BYTES (512 << 10) /* quantized rows' bytes a band of rows holds at most (the second-level cache) */
#define MM4_BLOCK 32       /* MatMul4: weights a block (one scale) */
#define MM4_STEP 4         /* blocks a column holds in 64 bytes (a unit) */
#define MM4_AHEAD 8        /* units (256 bytes of codes) asked for ahead */
#define MM6_BLOCK 16       /* MatMul6: weights a block (one multiple) */
#define MM6_SUPER 256      /* weights a super-block (one base scale) */
#define MM6_BYTES 192      /* a column's codes of a super-block */
#define MM6_AHEAD 2        /* super-blocks asked for ahead */
#define MM4K_SUPER 256     /* MatMul4K: weights a super-block (one d and e) */
#define MM4K_SHIFT 8.0f    /* its codes' centre */
#define MM4K_SUMS 16       /* floats a super-block of a row's block sums (8, twice) */
#define MM4K_AHEAD 4       /* super-blocks asked for ahead */
#define MM8_BLOCK 32       /* MatMul8: weights a block (one scale) */
#define MM8_UNIT 64        /* its codes a column's unit holds (2 blocks) */
#define MM8_AHEAD 8        /* units asked for ahead */

/* rows of a, quantized per block (ops.c, the same for every path): per row `width` bytes of
 * codes in lo (MatMul4, MatMul4K: a block's even elements; the others: all, in order) and hi
 * (MatMul4, MatMul4K: its odd elements), and each block's step (largest / 127) and correction
 * (bias: minus the zero point times the sum of its codes), `lanes` a row; MatMul4K: each
 * block's exact float sum of a, 8 a super-block, twice (sums, `sum_width` a row). A path that
 * wants the rows laid out otherwise makes its own copy (its prep) in `own`. */
typedef struct {
    int8_t *lo, *hi;
    float *steps;
    int32_t *bias;
    float *sums;
    int64_t rows, blocks, width, lanes, sum_width;
    void *own; /* a path's layout of these rows, freed with them */
} qrows;

/* one thread's share of a product: column groups g0..g1-1 of every row */
typedef struct {
    const qrows *x;
    int kind;
    const uint8_t *codes;
    const void *scales; /* MatMul4, MatMul8: float scales; MatMul6: int8 multiples; MatMul4K: uint8 ones */
    const void *base;   /* MatMul6: float32 bases; MatMul4K: float16 d and e */
    float *y;
    int64_t rows, n, units, unit_bytes, g0, g1;
} mm_job;

typedef void (*mm_fn)(const mm_job *job);
typedef int (*mm_prep_fn)(qrows *x, int kind); /* 0: no memory */

/* a group's bytes per unit and the units of a row (units: MatMul4 4 blocks, MatMul6 and
 * MatMul4K a super-block, MatMul8 2 blocks) */
KINLINE int64_t mm_units(int kind, int64_t blocks) {
    return kind == MM4 ? blocks / MM4_STEP : kind == MM6 ? blocks * MM6_BLOCK / MM6_SUPER
         : kind == MM8 ? blocks / 2 : blocks * MM4_BLOCK / MM4K_SUPER;
}
KINLINE int64_t mm_unit_bytes(int kind) {
    return kind == MM4 ? 256 : kind == MM6 ? MM_GROUP * MM6_BYTES : kind == MM8 ? MM_GROUP * MM8_UNIT : 512;
}

/* ---- attention --------------------------------------------------------------------------- */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2, KV_KINDS = 3 }; /* what a KV row holds */
#define BLOCK 32      /* KV positions widened (int8: scored) at a time */
#define MAX_D 256     /* the largest head size */
#define LANES 8       /* float lanes of the generic vector type (two registers on 128-bit NEON) */

/* a tile of query rows (positions pos0..pos0+rows-1, g heads of one KV head, scaled and
 * turned: q rows x g x d) against one KV head's planes; out: rows x g x d. Scratch: scores
 * rows x g x (the tile's span), buf BLOCK x d + rows x g x d floats, i16 rows x g x d, steps
 * rows x g (ops.c's run_part sizes them) */
typedef void (*attend_fn)(const float *q, const void *keys, const void *values, int64_t pos0, int64_t rows,
                          int64_t window, int64_t g, int64_t d, float *scores, float *buf, float *out,
                          int16_t *i16, float *steps);

/* ---- norms ------------------------------------------------------------------------------- */
/* rows of d values: y = RMS-normed (x + skip) times g (skip may be NULL; sum, where not NULL,
 * gets x + skip) */
typedef void (*norm_fn)(const float *x, const float *skip, const float *g, float eps, int64_t rows, int64_t d,
                        float *y, float *sum);

/* ---- paths ------------------------------------------------------------------------------- */
enum { FEAT_AVX2 = 1, FEAT_AVX512 = 2, FEAT_NEON = 4, FEAT_DOTPROD = 8, FEAT_I8MM = 16 };

typedef struct {
    const char *name;
    unsigned needs;              /* FEAT_* the CPU must have */
    mm_fn matmul[MM_KINDS];      /* NULL: not this path's */
    mm_prep_fn prep[MM_KINDS];   /* the rows' own layout, before matmul (NULL: none) */
    attend_fn attend[KV_KINDS];  /* NULL: not this path's */
    norm_fn norm;                /* NULL: not this path's */
    void (*init)(void);          /* once, before the first call (tables) */
} kpath;

/* each unit's path (a unit that was not built is a null address: weak) */
extern const kpath kpath_ref HIDDEN;
extern const kpath kpath_avx2 HIDDEN __attribute__((weak));
extern const kpath kpath_avx512 HIDDEN __attribute__((weak));
extern const kpath kpath_neon HIDDEN __attribute__((weak));
extern const kpath kpath_dotprod HIDDEN __attribute__((weak));
extern const kpath kpath_i8mm HIDDEN __attribute__((weak));

/* ---- shared arithmetic ------------------------------------------------------------------- */
/* a float16's value (exact) */
KINLINE float half_value(uint16_t h) {
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
    union {
        uint32_t u;
        float f;
    } v = {bits};
    return v.f;
}

/* the canonical end of a row's product: (s0 + s1) + (s2 + s3) */
KINLINE float mm_sum4(const float *s) { return (s[0] + s[1]) + (s[2] + s[3]); }

#endif
