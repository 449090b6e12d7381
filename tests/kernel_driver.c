/* Runs the kernel library's check cases (tests/kernel_cases.py writes them) on one path, in a
 * process of any ISA (under qemu-user for ARM): kernel_driver LIBRARY PATH CASES OUT. Exit 0,
 * 2 on a bad use or file, 3 when the library lacks the path or this CPU cannot run it. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*matmul_fn)(int, const float *, int64_t, int64_t, int64_t, int64_t, const void *, const void *,
                         const void *, float *);
typedef int (*norm_fn)(const float *, const float *, const float *, float, int64_t, int64_t, float *, float *);
typedef int (*attend_fn)(int, int64_t, int64_t, int64_t, float, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const float *, const float *, const float *, void *, void *, const float *, const float *,
                         float *);

static void *take(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "kernel_driver: the case file ends early\n");
        exit(2);
    }
    return p;
}

static void put(FILE *f, const void *p, size_t bytes) {
    if (fwrite(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "kernel_driver: cannot write the outputs\n");
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: kernel_driver LIBRARY PATH CASES OUT\n");
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "kernel_driver: %s\n", dlerror());
        return 2;
    }
    int (*use)(const char *) = (int (*)(const char *))dlsym(lib, "edgelite_kernel_use");
    matmul_fn matmul = (matmul_fn)dlsym(lib, "edgelite_matmul");
    attend_fn attend = (attend_fn)dlsym(lib, "edgelite_attend");
    norm_fn norm = (norm_fn)dlsym(lib, "edgelite_norm");
    if (!use || !matmul || !attend || !norm) return 2;
    if (!use(argv[2])) return 3;
    FILE *in = fopen(argv[3], "rb"), *out = fopen(argv[4], "wb");
    if (!in || !out) return 2;
    int64_t tag;
    while (fread(&tag, 8, 1, in) == 1) {
        if (tag == 0) {
            int64_t h[8];
            if (fread(h, 8, 8, in) != 8) return 2;
            int64_t kind = h[0], rows = h[1], k = h[2], n = h[3], zero = h[4];
            float *a = take(in, (size_t)(rows * k) * 4), *y = calloc((size_t)(rows * n), 4);
            void *w[3];
            for (int i = 0; i < 3; i++) w[i] = h[5 + i] ? take(in, (size_t)h[5 + i]) : NULL;
            if (matmul((int)kind, a, rows, k, n, zero, w[0], w[1], w[2], y)) return 2;
            put(out, y, (size_t)(rows * n) * 4);
            free(a), free(y), free(w[0]), free(w[1]), free(w[2]);
        } else if (tag == 1) {
            int64_t h[10];
            if (fread(h, 8, 10, in) != 10) return 2;
            int64_t kind = h[0], heads = h[1], kv = h[2], window = h[3], n = h[4], total = h[5], cap = h[6], d = h[7],
                    half = h[8], one = h[9];
            size_t item = kind == 0 ? 4 : kind == 1 ? 2 : 1, row = (size_t)(d + 2 * (kind == 2)) * item;
            float *q = take(in, (size_t)(n * heads * d) * 4), *kn = take(in, (size_t)(n * kv * d) * 4);
            float *vn = take(in, (size_t)(n * kv * d) * 4);
            void *kc = take(in, (size_t)(kv * cap) * row), *vc = take(in, (size_t)(kv * cap) * row);
            float *cs = take(in, (size_t)(cap * half) * 4), *sn = take(in, (size_t)(cap * half) * 4);
            float *o = calloc((size_t)(n * heads * d), 4);
            int64_t step = one ? 1 : n;
            for (int64_t r = 0; r < n; r += step)
                if (attend((int)kind, heads, kv, window, 0.0f, step, total - n + r + step, cap, d, half, q + r * heads * d,
                           kn + r * kv * d, vn + r * kv * d, kc, vc, cs, sn, o + r * heads * d))
                    return 2;
            put(out, o, (size_t)(n * heads * d) * 4);
            put(out, kc, (size_t)(kv * cap) * row);
            put(out, vc, (size_t)(kv * cap) * row);
            free(q), free(kn), free(vn), free(kc), free(vc), free(cs), free(sn), free(o);
        } else if (tag == 2) {
            int64_t h[3];
            float eps;
            if (fread(h, 8, 3, in) != 3 || fread(&eps, 4, 1, in) != 1) return 2;
            int64_t rows = h[0], d = h[1], skip = h[2];
            size_t bytes = (size_t)(rows * d) * 4;
            float *x = take(in, bytes), *s = skip ? take(in, bytes) : NULL, *g = take(in, (size_t)d * 4);
            float *y = calloc((size_t)(rows * d), 4), *sum = skip ? calloc((size_t)(rows * d), 4) : NULL;
            if (norm(x, s, g, eps, rows, d, y, sum)) return 2;
            put(out, y, bytes);
            if (sum) put(out, sum, bytes);
            free(x), free(s), free(g), free(y), free(sum);
        } else {
            return 2;
        }
    }
    fclose(in);
    return fclose(out) ? 2 : 0;
}
