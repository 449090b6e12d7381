/* RMS norms (Norm, SkipNorm: what onnxruntime's SimplifiedLayerNormalization and
 * SkipSimplifiedLayerNormalization compute), in the generic vector type: each unit compiles it
 * with its own flags, the same bits everywhere (onnxruntime's own SimplifiedLayerNormalization
 * differs between its x86 and ARM builds: measured, 1.29.0). Defines norm_rows (norm_fn). */
#ifndef EDGELITE_NORM_H
#define EDGELITE_NORM_H

#include "simd.h"

/* rows of d values (d a multiple of LANES): s = x (+ skip), written to sum where asked; y = (s
 * times 1 / sqrt(mean(s^2) + eps)) times g. The squares' sum runs in LANES running sums (fused),
 * added as lanes_sum does */
static void norm_rows(const float *x, const float *skip, const float *g, float eps, int64_t rows, int64_t d,
                      float *y, float *sum) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d, *s = sum ? sum + r * d : yr; /* (s then y in place) */
        if (skip)
            for (int64_t i = 0; i < d; i += LANES) store(s + i, load(xr + i) + load(skip + r * d + i));
        else s = (float *)xr;
        vf acc = splat(0.0f);
        for (int64_t i = 0; i < d; i += LANES) {
            vf v = load(s + i);
            acc = VFMA(v, v, acc);
        }
        float inv = 1.0f / sqrtf(lanes_sum(acc) / (float)d + eps);
        for (int64_t i = 0; i < d; i += LANES) store(yr + i, load(s + i) * splat(inv) * load(g + i));
    }
}

#endif
