/* A linear layer on one row in fp32, y = W x + b, for minirt/kernels.py: a decode step of
   one request, where each weight is read once and used once, so the product runs at the
   speed the weights stream from memory. W is the layer's own [N, K] matrix, rows
   contiguous: each output is a dot product along K, and the partial sums of W outputs
   fold into one vector of W results (vec.h's fold), four rows at a time. Threads split
   the outputs. */
#include <stdint.h>

#include "vec.h"

/* The W outputs of rows r[0 .. W) of the weight (K floats each) for x. */
static inline vf outputs(const float *x, const float *const *r, int64_t K) {
    vf fours[W / 4];
    for (int g = 0; g < W / 4; g++) {
        vf part[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
        for (int64_t k = 0; k < K; k += W) {
            const vf xv = ld(x + k);
            for (int j = 0; j < 4; j++) part[j] += ld(r[4 * g + j] + k) * xv;
        }
        fours[g] = fold(part, 4);
    }
    return fold(fours, W / 4);
}

/* y[N] = w[N, K] x[K] + bias (bias may be NULL), w's rows ws floats apart. Returns 0; -1
   where K is not a multiple of the vector width. */
int minirt_gemv(const float *x, const float *w, const float *bias, float *y, int64_t N,
                int64_t K, int64_t ws, int threads) {
    if (K % W || K < 1 || N < 1) return -1;
    const int64_t blocks = (N + W - 1) / W;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * W, nn = N - n0 < W ? N - n0 : W;
        const float *r[W];
        for (int j = 0; j < W; j++) r[j] = w + (n0 + (j < nn ? j : nn - 1)) * ws;
        const vf out = outputs(x, r, K);
        for (int j = 0; j < nn; j++) y[n0 + j] = out[j] + (bias ? bias[n0 + j] : 0.0f);
    }
    return 0;
}
