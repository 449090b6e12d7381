/* The generic vector type of the attention code (GCC vector extensions: 8 floats, one AVX
 * register or two NEON ones) and the few shims whose best form differs by ISA; each shim gives
 * the same bits on every ISA (fused multiply-adds are written as such: VFMA). Included by every
 * unit that compiles the attention code (its own flags decide which form a shim takes). */
#ifndef EDGELITE_SIMD_H
#define EDGELITE_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

KINLINE vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

KINLINE void store(float *p, vf v) { memcpy(p, &v, sizeof(v)); }

KINLINE vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }

/* c + a b, rounded once, in every lane */
KINLINE vf VFMA(vf a, vf b, vf c) {
#if defined(__FMA__) && defined(__AVX__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
    float32x4_t a2[2], b2[2], c2[2];
    memcpy(a2, &a, sizeof(a)), memcpy(b2, &b, sizeof(b)), memcpy(c2, &c, sizeof(c));
    c2[0] = vfmaq_f32(c2[0], a2[0], b2[0]);
    c2[1] = vfmaq_f32(c2[1], a2[1], b2[1]);
    vf out;
    memcpy(&out, c2, sizeof(out));
    return out;
#else
    vf out;
    for (int l = 0; l < LANES; l++) out[l] = fmaf(a[l], b[l], c[l]);
    return out;
#endif
}

/* the lanes' sum: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) */
KINLINE float lanes_sum(vf v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* lane l: lanes_sum(a[l]), the same sums in the same order, for 8 vectors at once */
KINLINE vf lanes_sum8(const vf *a) {
    vf s[4], u[2];
    for (int i = 0; i < 4; i++)
        s[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = SHUFFLE(s[2 * i], s[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(s[2 * i], s[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* lanes_sum of 4 vectors into out[0..3], the same sums in the same order (with AVX: pairs of
 * neighbours, pairs of those, then the two halves: lanes_sum's tree in three hadds; the
 * generic shuffles came out as 37 instructions a vector, scalar adds among them) */
KINLINE void lanes_sum4(const vf *a, float *out) {
#if defined(__AVX__) && defined(__F16C__)
    __m256 h01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), h23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 h = _mm256_hadd_ps(h01, h23);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    vf s0 = SHUFFLE(a[0], a[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a[0], a[1], 1, 9, 3, 11, 5, 13, 7, 15);
    vf s1 = SHUFFLE(a[2], a[3], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a[2], a[3], 1, 9, 3, 11, 5, 13, 7, 15);
    vf u = SHUFFLE(s0, s1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(s0, s1, 2, 3, 10, 11, 6, 7, 14, 15);
    for (int l = 0; l < 4; l++) out[l] = u[l] + u[l + 4];
#endif
}

/* n float16 values as float32 (exact either way: the hardware's conversion where it has one) */
KINLINE void widen_n(const uint16_t *h, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#elif defined(__aarch64__)
    for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
#endif
    for (; i < n; i++) out[i] = half_value(h[i]);
}

/* LANES values of a float32 or float16 KV plane from element `at`, as float32 */
KINLINE vf load_kv(const void *plane, int64_t at, int kind) {
    if (kind == KV_F32) return load((const float *)plane + at);
    const uint16_t *h = (const uint16_t *)plane + at;
#if defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#elif defined(__aarch64__)
    float32x4_t two[2] = {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h))),
                          vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + 4)))};
    vf v;
    memcpy(&v, two, sizeof(v));
    return v;
#else
    float t[LANES];
    widen_n(h, t, LANES);
    return load(t);
#endif
}

/* one cache line asked into the core's second-level cache ahead of its use, as an instruction
 * of its own (measured: GCC 12's dead-code pass dropped __builtin_prefetch from these loops) */
#if defined(__x86_64__) || defined(__i386__)
#define PREFETCH(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
#elif defined(__aarch64__)
#define PREFETCH(p) __asm__ volatile("prfm pldl2keep, %0" : : "Q"(*(const char *)(p)))
#else
#define PREFETCH(p) __builtin_prefetch(p, 0, 2)
#endif

#endif
