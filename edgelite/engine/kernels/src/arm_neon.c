/* The ARMv8.0 path (NEON without dot products: Cortex-A53/A55/A72/A73 phones): the products of
 * arm_dot.h with each 16-byte dot made of widening multiplies (SMULL, SMLAL into 16 bits: at
 * most 2 x 128 x 127, then SADALP into 32), the float attention compiled for this ISA; the int8
 * attention is the reference's. The same bits as the reference: a block's integer sum is the
 * same whatever lanes its products went through. */
#include <arm_neon.h>

#define ARM_DOT16 1
/* acc + the byte products of a and b, pairwise into 32-bit lanes (lane l: bytes 2l, 2l + 1,
 * 2l + 8, 2l + 9: other parts than SDOT's, the same whole once a block's lanes are added) */
static inline __attribute__((always_inline)) int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    return vpadalq_s16(acc, vmlal_high_s8(p, a, b));
}

/* MatMul6's 4 blocks from the phases (arm_dot.h): the four phases' products of a group summed
 * in 16 bits (at most 4 x 63 x 127), then pairs of groups, then blocks */
static inline __attribute__((always_inline)) int32x4_t dots6(const int8x16_t *q, int8x16x4_t xv) {
    int16x8_t lo = vmull_s8(vget_low_s8(q[0]), vget_low_s8(xv.val[0]));
    int16x8_t hi = vmull_high_s8(q[0], xv.val[0]);
    for (int k = 1; k < 4; k++) {
        lo = vmlal_s8(lo, vget_low_s8(q[k]), vget_low_s8(xv.val[k]));
        hi = vmlal_high_s8(hi, q[k], xv.val[k]);
    }
    return vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
}

#include "arm_dot.h"

#define ATTEND_SPECIALIZE 1
#include "attend_float.h"
#include "norm.h"

const kpath kpath_neon = {
    .name = "neon",
    .needs = FEAT_NEON,
    .matmul = {matmul_dot, matmul_dot, matmul_dot, matmul_dot},
    .prep = {[MM8] = prep8},
    .attend = {attend_f32, attend_f16},
    .norm = norm_rows,
};
