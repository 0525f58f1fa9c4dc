/* Decode attention on the CPU in fp32, for minirt/kernels.py: each running request's one
   new position attends to the prefix its group holds, if any, then to its own keys, in a
   single online-softmax pass (no second attention, no merge of two halves).

   A unit is the rows of a group behind one held prefix (or a part of them, so that every
   thread has work), or a row in no group. One task is a unit's K/V head: its query rows
   are the query heads sharing that K/V head, for each row of the unit. They run together
   over the prefix, so each tile of it is read once for the unit; then each row's query
   heads go on over its own keys, its running max, sum and output carried on. A score is
   a dot product along head_dim: a key's products with a query row sum into one vector of
   W partial sums, and the partial sums of W keys are folded by a tree of shuffles and
   adds into one vector of their W scores, on which the softmax runs elementwise. Scores
   are kept in base 2, as in attention.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define MAXD 256 /* head_dim at most */
#define MAXDV (MAXD / W) /* vectors a row of head_dim takes at most: arrays of fixed size, held
                            in registers where D is a constant */

#define RBMAX 4  /* query rows a block takes at most: their keys and values are read once */

static inline vf vmax(vf a, vf b) { return pick(a > b, a, b); }

/* The maximum and the sum of a vector's lanes, in every lane. */
static inline vf all_max(vf v) {
    v = vmax(v, SHUF(v, v, XOR1));
    v = vmax(v, SHUF(v, v, XOR2));
#if W >= 8
    v = vmax(v, SHUF(v, v, XOR4));
#endif
#if W == 16
    v = vmax(v, SHUF(v, v, XOR8));
#endif
    return v;
}

static inline vf all_sum(vf v) {
    v += SHUF(v, v, XOR1);
    v += SHUF(v, v, XOR2);
#if W >= 8
    v += SHUF(v, v, XOR4);
#endif
#if W == 16
    v += SHUF(v, v, XOR8);
#endif
    return v;
}

typedef struct {
    const float *q, *k, *v, *pk, *pv;
    float *out;
    const int64_t *own, *plen;   /* keys of each row's own, positions of each prefix */
    const int32_t *order, *start, *prefix; /* unit u: rows order[start[u] .. start[u + 1]),
                                             behind prefix[u] (-1: none) */
    int64_t qs[2], ks[3], vs[3], pks[3], pvs[3], os[2]; /* strides: row or group, head, position */
    int heads, kv_heads, d;
    float scale;
} Args;

/* R query rows (q, scaled to base 2, and acc [R][D]; their running max mx and sum l) go
   on over n keys and values at kb, vb, a position every ks, vs floats, RB rows (at most
   RBMAX) at a time. D, the head_dim, and RB are constants where
   the caller inlines them: the loops over them unroll and a block's rows of q and of the
   output stay in registers. A last block of fewer than RB rows computes its last row
   again in the rows it lacks, and keeps none. */
static inline __attribute__((always_inline)) void
over_(const float *kb, int64_t ks, const float *vb, int64_t vs, int n, const int D,
      const int RB, int R, const float *q, float *acc, float *mx, float *l) {
    const int DV = D / W;
    for (int j0 = 0; j0 < n; j0 += W) {
        const int nj = n - j0 < W ? n - j0 : W;
        const float *kr[W];
        vi real;
        for (int j = 0; j < W; j++) {  /* past the end: the last key again, masked */
            kr[j] = kb + (j0 + (j < nj ? j : nj - 1)) * ks;
            real[j] = -(j < nj);
        }
        for (int r0 = 0; r0 < R; r0 += RB) {
            const int nr = R - r0 < RB ? R - r0 : RB;
            int row[RBMAX];
            for (int i = 0; i < RB; i++) row[i] = r0 + (i < nr ? i : nr - 1);
            vf qv[RBMAX][MAXDV], fours[RBMAX][W / 4];
            for (int i = 0; i < RB; i++)
                for (int x = 0; x < DV; x++) qv[i][x] = ld(q + row[i] * D + x * W);
            for (int j4 = 0; j4 < W; j4 += 4) {
                vf part[RBMAX][4];
                for (int j = 0; j < 4; j++) {  /* a key read once for the block's rows */
                    vf kx[MAXDV];
                    for (int x = 0; x < DV; x++) kx[x] = ld(kr[j4 + j] + x * W);
                    for (int i = 0; i < RB; i++) {
                        vf s = qv[i][0] * kx[0];
                        for (int x = 1; x < DV; x++) s += qv[i][x] * kx[x];
                        part[i][j] = s;
                    }
                }
                for (int i = 0; i < RB; i++) fours[i][j4 / 4] = fold(part[i], 4);
            }
            float p[RBMAX][W];
            vf alpha[RBMAX];
            for (int i = 0; i < RB; i++) {  /* online softmax, row by row */
                const vf s = pick(real, fold(fours[i], W / 4), splat(-INFINITY));
                const vf top = all_max(vmax(s, splat(mx[row[i]])));
                alpha[i] = exp2v(splat(mx[row[i]]) - top);  /* first tile: mx is -inf, 0 */
                const vf e = exp2v(s - top);
                st(p[i], e);
                if (i < nr) {
                    l[row[i]] = l[row[i]] * alpha[i][0] + all_sum(e)[0];
                    mx[row[i]] = top[0];
                }
            }
            vf o[RBMAX][MAXDV];
            for (int i = 0; i < RB; i++)
                for (int x = 0; x < DV; x++) o[i][x] = ld(acc + row[i] * D + x * W) * alpha[i];
            for (int j = 0; j < nj; j++) {  /* a value read once for the block's rows */
                const float *vr = vb + (j0 + j) * vs;
                vf vx[MAXDV];
                for (int x = 0; x < DV; x++) vx[x] = ld(vr + x * W);
                for (int i = 0; i < RB; i++) {
                    const vf pj = splat(p[i][j]);
                    for (int x = 0; x < DV; x++) o[i][x] += pj * vx[x];
                }
            }
            for (int i = 0; i < nr; i++)
                for (int x = 0; x < DV; x++) st(acc + row[i] * D + x * W, o[i][x]);
        }
    }
}

/* over_ with the head_dims models have most often as constants, and blocks of 3 rows
   where R is a multiple of 3 but not of 4 (a request's 3 query heads per K/V head, as in
   SmolLM2: no block computes a row it keeps none of). */
static void over(const float *kb, int64_t ks, const float *vb, int64_t vs, int n, int d,
                 int R, const float *q, float *acc, float *mx, float *l) {
#define OVER(D, RB) over_(kb, ks, vb, vs, n, D, RB, R, q, acc, mx, l)
    const int threes = R % 3 == 0 && R % 4 != 0;
    if (d == 64)
        threes ? OVER(64, 3) : OVER(64, 4);
    else if (d == 128)
        threes ? OVER(128, 3) : OVER(128, 4);
    else
        threes ? OVER(d, 3) : OVER(d, 4);
#undef OVER
}

static void task(const Args *a, int u, int h, float *scratch) {
    const int G = a->heads / a->kv_heads, d = a->d;
    const int32_t *rows = a->order + a->start[u];
    const int m = a->start[u + 1] - a->start[u], R = m * G;
    const float c = a->scale * 1.4426950408889634f;  /* scores in base 2 */
    float *q = scratch, *acc = q + R * d, *mx = acc + R * d, *l = mx + R;
    for (int t = 0; t < m; t++)  /* query row t * G + g: query head h * G + g of row t */
        for (int g = 0; g < G; g++) {
            const float *src = a->q + rows[t] * a->qs[0] + (h * G + g) * a->qs[1];
            for (int x = 0; x < d; x++) {
                q[(t * G + g) * d + x] = src[x] * c;
                acc[(t * G + g) * d + x] = 0.0f;
            }
            mx[t * G + g] = -INFINITY;
            l[t * G + g] = 0.0f;
        }
    const int g = a->prefix[u];
    if (g >= 0)
        over(a->pk + g * a->pks[0] + h * a->pks[1], a->pks[2],
             a->pv + g * a->pvs[0] + h * a->pvs[1], a->pvs[2], a->plen[g], d, R, q, acc, mx, l);
    for (int t = 0; t < m; t++)
        over(a->k + rows[t] * a->ks[0] + h * a->ks[1], a->ks[2],
             a->v + rows[t] * a->vs[0] + h * a->vs[1], a->vs[2], a->own[rows[t]], d, G,
             q + t * G * d, acc + t * G * d, mx + t * G, l + t * G);
    for (int t = 0; t < m; t++)
        for (int g = 0; g < G; g++) {
            float *dst = a->out + rows[t] * a->os[0] + (h * G + g) * a->os[1];
            const float inv = 1.0f / l[t * G + g];
            for (int x = 0; x < d; x++) dst[x] = acc[(t * G + g) * d + x] * inv;
        }
}

/* The tasks on OpenMP threads (torch's, as in attention.c), each thread's scratch kept and
   grown to the largest unit it has met. */
static int run(const Args *a, int units, int threads) {
    const int G = a->heads / a->kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(|: failed)
    for (int t = 0; t < units * a->kv_heads; t++) {
        const int u = t / a->kv_heads;
        const int64_t R = (int64_t)(a->start[u + 1] - a->start[u]) * G;
        float *scratch = thread_scratch(R * (2 * a->d + 2));
        if (!scratch) { failed = 1; continue; }
        task(a, u, t % a->kv_heads, scratch);
    }
    return failed ? -2 : 0;
}

/* out[b, heads, d] for q[b, heads, d]: each row's query over the prefix its group holds,
   if any, then over its own keys. The prefixes pk, pv[groups, kv_heads, P, d]: group g is
   rows index[g * width .. + sizes[g]) and reads the first plen[g] positions of prefix g;
   the rows in no group read none. Row r's own keys are the first own[r] of k, v[b,
   kv_heads, n, d]; shape: b, heads, kv_heads, d, groups, width, n, P. The last
   dimension contiguous; strides: q 2 (row, head), k, v, pk, pv
   3 (row or group, head, position), out 2. Returns 0; -1 for what it does not take
   (head_dim not a multiple of W or over MAXD, a row in two groups or out of range, a row
   with no keys at all or more than there are); -2 when out of memory. */
int minirt_decode(const float *q, const float *k, const float *v, const float *pk,
                  const float *pv, float *out, const int64_t *own, const int64_t *index,
                  const int64_t *sizes, const int64_t *plen, const int64_t *strides,
                  const int *shape, float scale, int nthreads) {
    Args a = {.q = q, .k = k, .v = v, .pk = pk, .pv = pv, .out = out, .own = own,
              .plen = plen, .heads = shape[1], .kv_heads = shape[2], .d = shape[3],
              .scale = scale};
    const int b = shape[0], groups = shape[4], width = shape[5], n = shape[6], P = shape[7];
    for (int i = 0; i < 2; i++) a.qs[i] = strides[i], a.os[i] = strides[14 + i];
    for (int i = 0; i < 3; i++)
        a.ks[i] = strides[2 + i], a.vs[i] = strides[5 + i], a.pks[i] = strides[8 + i],
        a.pvs[i] = strides[11 + i];
    if (b < 1 || a.kv_heads < 1 || a.heads % a.kv_heads || a.d < W || a.d % W || a.d > MAXD)
        return -1;
    int threads = nthreads < 1 ? 1 : nthreads;
    /* order: each group's rows, then the rows in no group; seen[r]: row r's group */
    int32_t *order = malloc(sizeof(int32_t) * (4 * b + 2 * groups + 2));
    if (!order) return -2;
    int32_t *start = order + b, *prefix = start + b + 1, *seen = prefix + b;
    int32_t *first = seen + b, *parts = first + groups + 1; /* group g: order[first[g] ..) */
    int next = 0, bad = 0;
    for (int r = 0; r < b; r++) seen[r] = -1;
    for (int g = 0; g < groups; g++) {
        first[g] = next;
        for (int i = 0; i < sizes[g] && !bad; i++) {
            const int64_t r = index[g * width + i];
            bad = sizes[g] > width || r < 0 || r >= b || seen[r] >= 0 || plen[g] < 0 ||
                  plen[g] > P;
            if (!bad) seen[r] = g, order[next++] = (int32_t)r;
        }
    }
    first[groups] = next;
    for (int r = 0; r < b; r++) {
        bad |= own[r] < 0 || own[r] > n || own[r] + (seen[r] >= 0 ? plen[seen[r]] : 0) < 1;
        if (seen[r] < 0) order[next++] = r;
    }
    /* units: a group's rows in parts[g] runs, then each row in no group on its own. While
       there are fewer than two tasks a thread, the group with the most rows a part splits
       once more (each part reads the prefix: from the cache the first part brought it to) */
    int units = b - first[groups];
    for (int g = 0; g < groups; g++) parts[g] = 1, units += first[g + 1] > first[g];
    while (units * a.kv_heads < 2 * threads) {
        int most = -1;
        for (int g = 0; g < groups; g++)
            if ((first[g + 1] - first[g]) / parts[g] >= 2 &&
                (most < 0 || (first[g + 1] - first[g]) * parts[most] >
                             (first[most + 1] - first[most]) * parts[g]))
                most = g;
        if (most < 0) break;
        parts[most]++, units++;
    }
    units = 0;
    for (int g = 0; g < groups; g++) {
        const int rows = first[g + 1] - first[g];
        for (int i = 0; i < parts[g] && rows; i++)
            start[units] = first[g] + rows * i / parts[g], prefix[units++] = g;
    }
    for (int i = first[groups]; i < b; i++) start[units] = i, prefix[units++] = -1;
    start[units] = b;
    a.order = order, a.start = start, a.prefix = prefix;
    if (threads > units * a.kv_heads) threads = units * a.kv_heads;
    const int rc = bad ? -1 : run(&a, units, threads);
    free(order);
    return rc;
}
