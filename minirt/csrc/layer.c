/* A Llama layer's small elementwise operations on the CPU in fp32, for minirt/kernels.py:
   RMSNorm with the residual add before it, RoPE in place on q and k, and SiLU(gate) * up.
   Torch runs each of them as several operators (RMSNorm alone is five: pow, mean, add,
   rsqrt and two products), each a pass over memory and a dispatch; in a decode step the
   dispatches cost more than the arithmetic. Here each is one pass, a row at a time. A row
   is computed alone, in a fixed order, whatever the rows beside it or the threads: the
   same bits for a request alone or in a batch. */
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define PARALLEL_AT 65536 /* floats a call touches before it is worth a second thread */

/* The sum of a vector's lanes, lane 0 first. */
static inline float lanes_sum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < W; i++) s += v[i];
    return s;
}

/* out[r] = h[r] * (1 / sqrt(mean(h[r]^2) + eps)) * w for each of rows rows of dim floats,
   after h[r] += delta[r] where delta is not NULL (the residual add the norm follows, in
   place). Row strides hs, ds, os; the last dimension contiguous. out may be h. */
void minirt_rms_norm(float *h, const float *delta, const float *w, float *out, int64_t rows,
                     int64_t dim, int64_t hs, int64_t ds, int64_t os, float eps, int threads) {
    const int64_t body = dim - dim % W;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PARALLEL_AT)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * hs, *y = out + r * os;
        if (delta) {
            const float *e = delta + r * ds;
            for (int64_t i = 0; i < body; i += W) st(x + i, ld(x + i) + ld(e + i));
            for (int64_t i = body; i < dim; i++) x[i] += e[i];
        }
        vf acc = splat(0.0f);
        for (int64_t i = 0; i < body; i += W) acc += ld(x + i) * ld(x + i);
        float ss = lanes_sum(acc);
        for (int64_t i = body; i < dim; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < body; i += W) st(y + i, ld(x + i) * inv * ld(w + i));
        for (int64_t i = body; i < dim; i++) y[i] = x[i] * inv * w[i];
    }
}

/* RoPE in place on x[tokens, heads, d] (strides ts, hs; d contiguous): x * cos +
   rolled(x) * sin, rolled(x) the two halves of x swapped, with cos and sin [tokens, d]
   (row stride cs) the tables minirt's forward makes, sin's first half negated. Products
   and sum rounded one at a time, never fused: the bits of torch's four operations. */
#if defined(__clang__)
#define NO_FMA
#else
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#endif
NO_FMA void minirt_rope(float *x, int64_t tokens, int64_t heads, int64_t d, int64_t ts,
                        int64_t hs, const float *cos, const float *sin, int64_t cs,
                        int threads) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int64_t half = d / 2, body = half - half % W;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (tokens * heads * d >= PARALLEL_AT)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * cs, *s = sin + t * cs;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * ts + h * hs, *b = a + half;
            for (int64_t i = 0; i < body; i += W) {
                const vf lo = ld(a + i), hi = ld(b + i);
                const vf lo_c = lo * ld(c + i), hi_s = hi * ld(s + i);
                const vf hi_c = hi * ld(c + half + i), lo_s = lo * ld(s + half + i);
                st(a + i, lo_c + hi_s);
                st(b + i, hi_c + lo_s);
            }
            for (int64_t i = body; i < half; i++) {
                const float lo = a[i], hi = b[i];
                const float lo_c = lo * c[i], hi_s = hi * s[i];
                const float hi_c = hi * c[half + i], lo_s = lo * s[half + i];
                a[i] = lo_c + hi_s;
                b[i] = hi_c + lo_s;
            }
        }
    }
}

/* out[r] = silu(gate[r]) * up[r] = gate / (1 + e^-gate) * up, for rows rows of dim floats
   (row strides gs, us, os; the last dimension contiguous). out may be gate. */
void minirt_silu_mul(const float *gate, const float *up, float *out, int64_t rows,
                     int64_t dim, int64_t gs, int64_t us, int64_t os, int threads) {
    const int64_t body = dim - dim % W;
    const float log2e = 1.4426950408889634f;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PARALLEL_AT)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gs, *u = up + r * us;
        float *y = out + r * os;
        for (int64_t i = 0; i < body; i += W) {
            const vf x = ld(g + i), z = -x * log2e;  /* e^-x = 2^z, z held under 2^127 */
            st(y + i, x / (1.0f + exp2v(pick(z > splat(127.0f), splat(127.0f), z))) * ld(u + i));
        }
        for (int64_t i = body; i < dim; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
