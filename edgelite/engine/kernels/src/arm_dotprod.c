/* The ARMv8.2 dotprod path (SDOT; built with -march=armv8.2-a+dotprod, chosen where getauxval
 * says the CPU has it: Cortex-A76/A77/A78, Tensor G2 and later): every product by SDOT
 * (arm_dot.h), the float attention compiled for this ISA and the int8 attention's whole blocks
 * by SDOT (i8_dot.h). The same bits as the reference (kernels.h's canonical order). */
#include "arm_dot.h"

#define ATTEND_SPECIALIZE 1
#include "attend_float.h"
#include "i8_dot.h"
#include "attend_i8.h"
#include "norm.h"

const kpath kpath_dotprod = {
    .name = "dotprod",
    .needs = FEAT_DOTPROD,
    .matmul = {matmul_dot, matmul_dot, matmul_dot, matmul_dot},
    .prep = {[MM8] = prep8},
    .attend = {attend_f32, attend_f16, attend_i8_kv},
    .norm = norm_rows,
};
