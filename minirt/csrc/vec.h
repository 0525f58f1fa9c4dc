/* What minirt's CPU kernels share: a vector of W floats (16 with AVX-512, 8 with AVX, else
   4), written with GCC/Clang vector extensions, which the compiler lowers to the widest
   vectors the CPU has (-march=native); unaligned loads and stores; 2^x on a vector; lane
   shuffles and the fold of dot products' partial sums; and each thread's scratch. */
#ifndef MINIRT_VEC_H
#define MINIRT_VEC_H
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define W 16
#elif defined(__AVX__)
#define W 8
#else
#define W 4
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef float vf_mem __attribute__((vector_size(W * 4), aligned(4), may_alias));
typedef int32_t vi_mem __attribute__((vector_size(W * 4), aligned(4), may_alias));

static inline vf splat(float x) { return x - (vf){0}; }  /* exact: folds to a broadcast */
static inline vf pick(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf ld(const float *p) { return *(const vf_mem *)p; }  /* unaligned */
static inline void st(float *p, vf x) { *(vf_mem *)p = x; }

/* 2^x as 2^n * p(x - n), n = round(x), p a degree-6 fit on [-1/2, 1/2]; 0 below -126,
   -inf included. */
static inline vf exp2v(vf x) {
    const vi low = x < splat(-126.0f);
    const vf xc = pick(low, splat(-126.0f), x);
    const vf n = (xc + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
    const vf f = xc - n;
    vf p = splat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)e) & ~low);
}

/* Lane permutations, as index lists for __builtin_shufflevector: the even and odd lanes
   of two vectors, and lane i from lane i ^ k of one. */
#define EVEN_4 0, 2, 4, 6
#define EVEN_8 EVEN_4, 8, 10, 12, 14
#define EVEN_16 EVEN_8, 16, 18, 20, 22, 24, 26, 28, 30
#define ODD_4 1, 3, 5, 7
#define ODD_8 ODD_4, 9, 11, 13, 15
#define ODD_16 ODD_8, 17, 19, 21, 23, 25, 27, 29, 31
#define XOR1_4 1, 0, 3, 2
#define XOR1_8 XOR1_4, 5, 4, 7, 6
#define XOR1_16 XOR1_8, 9, 8, 11, 10, 13, 12, 15, 14
#define XOR2_4 2, 3, 0, 1
#define XOR2_8 XOR2_4, 6, 7, 4, 5
#define XOR2_16 XOR2_8, 10, 11, 8, 9, 14, 15, 12, 13
#define XOR4_8 4, 5, 6, 7, 0, 1, 2, 3
#define XOR4_16 XOR4_8, 12, 13, 14, 15, 8, 9, 10, 11
#define XOR8_16 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define LANES_(name, w) name##_##w
#define LANES(name, w) LANES_(name, w)
#define SHUF(a, b, name) __builtin_shufflevector(a, b, LANES(name, W))

/* n vectors of partial sums (n a power of 2, at most W) folded into one: each round adds
   the neighbouring lanes of two vectors into one, halving the lanes per vector, their
   order kept. W dot products' vectors folded in fours, then the fours, give one vector
   of the W sums, lane j the sum of vector j's lanes, in the same order of additions as
   folding all W at once, with fewer vectors held. part is overwritten. */
static inline vf fold(vf *part, int n) {
    for (; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++)
            part[i] = SHUF(part[2 * i], part[2 * i + 1], EVEN) +
                      SHUF(part[2 * i], part[2 * i + 1], ODD);
    return part[0];
}

/* This thread's scratch of at least n floats, 64-byte aligned: kept from call to call
   (an OpenMP thread of torch's lives as long as the process) and grown when a task needs
   more; NULL when out of memory. Each source that includes this has its own. */
static inline float *thread_scratch(int64_t n) {
    static __thread float *buf;
    static __thread int64_t have;
    if (n > have) {
        free(buf);
        n = (n + 15) / 16 * 16;
        buf = aligned_alloc(64, sizeof(float) * n);
        have = buf ? n : 0;
    }
    return buf;
}

#endif
