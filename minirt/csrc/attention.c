/* Softmax attention on the CPU in fp32, flash style, for minirt/kernels.py.

   One task is BQ query positions of the query heads that share one K/V head: their rows
   run together against each tile of BK keys, so a key is read once for the group. The
   rows sit along the vector (`ld` of W rows, vec.h), the keys and head dimensions along
   broadcasts, so both matrix products are outer products of a row vector with a
   broadcast scalar, and the online softmax (max, exp, sum per row) is elementwise over
   vectors too. Scores are kept in base 2 (q scaled by scale * log2 e): exp2 is a
   rounding, a polynomial and an exponent shift. A cached prefix can come first: keys
   every row of a sequence sees, read where they lie in the KV pool (by slot), before its
   new keys, in the same pass. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* KB keys (or head dims) a register block broadcasts: KB * RV accumulators fit the CPU's
   vector registers (32 with AVX-512 or NEON, 16 with AVX2). */
#if W == 16
#define KB 8
#elif W == 8
#define KB 4
#else
#define KB 8
#endif
#define BQ 32                /* query positions a task takes */
#define BK 64                /* keys a tile holds */
#define RV 2                 /* vectors of rows one register block holds */
#define MAXD 256             /* head_dim at most */
#define MAXROWS (8 * BQ)     /* at most 8 query heads per K/V head */

typedef struct {
    const float *q, *k, *v, *mask, *pk, *pv;
    const int64_t *slots, *plen;  /* sequence i's prefix: plen[i] slots of pk, pv at */
    int64_t ss;                   /* slots + i * ss (ss 0: one prefix for all) */
    float *out, *lse;
    int64_t qs[3], ks[3], vs[3], ms[2], os[3], ls[2]; /* strides: batch, head, position */
    int64_t pks[2], pvs[2];                           /* pool strides: slot, head */
    int b, heads, kv_heads, m, n, d, causal, tasks;
    float scale;
} Args;

/* A task's rows and their running softmax, which every tile of keys updates. */
typedef struct {
    int R, RP, np, p0;
    float *mx, *l;
    const int32_t *last;  /* causal: the last own key row r sees (-1 for padding) */
} Rows;

/* A task's scratch: q transposed [d][rows], its output transposed [d][rows], and a
   tile's scores, then probabilities, transposed [BK][rows]. */
typedef struct { float *qt, *ot, *pt; } Scratch;

/* One tile of nk keys and values against the task's rows: scores, the online softmax's
   update, the values' products. Key j is row idx[j] of kb, vb (rows ks, vs floats apart),
   or row j where idx is NULL. own: the index among the new keys of key 0 (causal and
   mask apply), or -1 for prefix keys, which every row sees. Inlined, so each of its two
   callers gets its own copy (idx known NULL or not). */
static inline __attribute__((always_inline)) void tile(
        const Args *a, const Scratch *s, const Rows *w, int bi, const float *kb, int64_t ks,
        const float *vb, int64_t vs, const int64_t *idx, int nk, int own) {
    const int RP = w->RP, R = w->R, np = w->np, d = a->d, nkp = (nk + KB - 1) / KB * KB;
    const float LOG2E = 1.4426950408889634f;
    float *qt = s->qt, *ot = s->ot, *pt = s->pt;
    /* pt[j][r] = q_r . k_j: KB keys by RV vectors of rows in registers */
    for (int r0 = 0; r0 < RP; r0 += RV * W)
        for (int jb = 0; jb < nkp; jb += KB) {
            vf acc[KB][RV] = {{{0}}};
            const float *kj[KB];
            for (int jj = 0; jj < KB; jj++)  /* past the tile: repeat its last key */
                kj[jj] = kb + (idx ? idx[jb + jj < nk ? jb + jj : nk - 1]
                                   : jb + jj < nk ? jb + jj : nk - 1) * ks;
            for (int x = 0; x < d; x++) {
                vf qv[RV];
                for (int u = 0; u < RV; u++) qv[u] = ld(qt + x * RP + r0 + u * W);
                for (int jj = 0; jj < KB; jj++) {
                    const vf kx = splat(kj[jj][x]);
                    for (int u = 0; u < RV; u++) acc[jj][u] += kx * qv[u];
                }
            }
            for (int jj = 0; jj < KB; jj++)
                for (int u = 0; u < RV; u++) st(pt + (jb + jj) * RP + r0 + u * W, acc[jj][u]);
        }
    if (a->mask && own >= 0)  /* additive, per (batch, position, key): the same for every head */
        for (int j = 0; j < nk; j++)
            for (int r = 0; r < R; r++)
                pt[j * RP + r] += LOG2E *
                    a->mask[bi * a->ms[0] + (w->p0 + r % np) * a->ms[1] + own + j];
    /* online softmax, a vector of rows at a time: new max, rescale, probabilities */
    for (int r0 = 0; r0 < RP; r0 += W) {
        const vi lim = *(const vi_mem *)(w->last + r0);
        const vf old = ld(w->mx + r0);
        vf top = old;
        for (int j = 0; j < nk; j++) {
            vf x = ld(pt + j * RP + r0);
            if (a->causal && own >= 0) {
                x = pick((own + j) > lim, splat(-INFINITY), x);
                st(pt + j * RP + r0, x);
            }
            top = pick(x > top, x, top);
        }
        const vi none = top == splat(-INFINITY);  /* no key seen yet: subtract 0 */
        const vf sub = pick(none, splat(0.0f), top);
        const vf alpha = exp2v(old - sub);
        vf sum = {0};
        for (int j = 0; j < nkp; j++) {
            const vf p = j < nk ? exp2v(ld(pt + j * RP + r0) - sub) : (vf){0};
            st(pt + j * RP + r0, p);
            sum += p;
        }
        st(w->l + r0, ld(w->l + r0) * alpha + sum);
        st(w->mx + r0, top);
        for (int x = 0; x < d; x++) st(ot + x * RP + r0, ld(ot + x * RP + r0) * alpha);
    }
    /* ot[x][r] += sum_j v_j[x] pt[j][r]: KB head dims by RV vectors of rows */
    for (int r0 = 0; r0 < RP; r0 += RV * W)
        for (int xb = 0; xb < d; xb += KB) {
            vf acc[KB][RV];
            for (int xx = 0; xx < KB; xx++)
                for (int u = 0; u < RV; u++) acc[xx][u] = ld(ot + (xb + xx) * RP + r0 + u * W);
            for (int j = 0; j < nk; j++) {
                vf pv[RV];
                for (int u = 0; u < RV; u++) pv[u] = ld(pt + j * RP + r0 + u * W);
                const float *vx0 = vb + (idx ? idx[j] : j) * vs + xb;
                for (int xx = 0; xx < KB; xx++) {
                    const vf vx = splat(vx0[xx]);
                    for (int u = 0; u < RV; u++) acc[xx][u] += vx * pv[u];
                }
            }
            for (int xx = 0; xx < KB; xx++)
                for (int u = 0; u < RV; u++) st(ot + (xb + xx) * RP + r0 + u * W, acc[xx][u]);
        }
}

static void task(const Args *a, int t, const Scratch *s) {
    const int G = a->heads / a->kv_heads, d = a->d, blocks = (a->m + BQ - 1) / BQ;
    const int bi = t / (a->kv_heads * blocks), h = (t / blocks) % a->kv_heads;
    const int p0 = (t % blocks) * BQ, np = a->m - p0 < BQ ? a->m - p0 : BQ;
    const int R = G * np, RP = (R + RV * W - 1) / (RV * W) * (RV * W);  /* rows, padded */
    const float c = a->scale * 1.4426950408889634f;
    float *qt = s->qt, *ot = s->ot;
    float mx[MAXROWS], l[MAXROWS];
    int32_t last[MAXROWS];
    for (int r = 0; r < RP; r++) {  /* row r: query head h*G + r/np at position p0 + r%np */
        const int g = r / np, i = r % np;
        const float *src = a->q + bi * a->qs[0] + (h * G + g) * a->qs[1] + (p0 + i) * a->qs[2];
        for (int x = 0; x < d; x++) qt[x * RP + r] = r < R ? src[x] * c : 0.0f;
        last[r] = r < R ? p0 + i : -1;
        mx[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(ot, 0, sizeof(float) * d * RP);
    const Rows w = {R, RP, np, p0, mx, l, last};
    const int P = (int)a->plen[bi];
    const int64_t *slots = a->slots + bi * a->ss;
    for (int j0 = 0; j0 < P; j0 += BK)  /* the prefix, slot by slot in the pool */
        tile(a, s, &w, bi, a->pk + h * a->pks[1], a->pks[0], a->pv + h * a->pvs[1], a->pvs[0],
             slots + j0, P - j0 < BK ? P - j0 : BK, -1);
    const int kend = a->causal && p0 + np < a->n ? p0 + np : a->n;
    const float *kb = a->k + bi * a->ks[0] + h * a->ks[1];
    const float *vb = a->v + bi * a->vs[0] + h * a->vs[1];
    for (int j0 = 0; j0 < kend; j0 += BK)  /* the new keys */
        tile(a, s, &w, bi, kb + j0 * a->ks[2], a->ks[2], vb + j0 * a->vs[2], a->vs[2], NULL,
             kend - j0 < BK ? kend - j0 : BK, j0);
    for (int r = 0; r < R; r++) {  /* normalise; lse back to natural log */
        const int g = r / np, i = r % np;
        float *dst = a->out + bi * a->os[0] + (h * G + g) * a->os[1] + (p0 + i) * a->os[2];
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int x = 0; x < d; x++) dst[x] = ot[x * RP + r] * inv;
        a->lse[bi * a->ls[0] + (h * G + g) * a->ls[1] + p0 + i] =
            l[r] > 0.0f ? (mx[r] + log2f(l[r])) * 0.6931471805599453f : -INFINITY;
    }
}

/* The tasks on OpenMP threads, handed out one at a time (causal tasks differ in size).
   Built with -fopenmp, this library links libgomp.so.1, which is the one torch has
   loaded: the same threads torch's own kernels run on, not a second set competing with
   them for the cores. Each thread keeps its scratch from call to call. */
static int run(const Args *a, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(|: failed)
    for (int t = 0; t < a->tasks; t++) {
        float *scratch = thread_scratch((2 * MAXD + BK) * MAXROWS);
        if (!scratch) { failed = 1; continue; }
        const Scratch s = {scratch, scratch + MAXD * MAXROWS, scratch + 2 * MAXD * MAXROWS};
        task(a, t, &s);
    }
    return failed ? -2 : 0;
}

/* out[b, heads, m, d] and lse[b, heads, m] (natural log) of q[b, heads, m, d] against
   sequence i's prefix, the plen[i] keys of the pool pk, pv[capacity, kv_heads, d] at
   slots[i * ss ..] (plen[i] may be 0; ss 0: the same prefix for every sequence), then
   k, v[b, kv_heads, n, d], through the strides given (the last dimension contiguous;
   strides: q, k, v 3 each, mask 2 (batch, position), out 3, lse 2, pk, pv 2 each (slot,
   head), slots 1 (ss)), mask additive over k's keys and shared by the heads or NULL,
   causal: position i sees keys 0..i of k. Returns 0, -1 for
   shapes it does not take, among them those whose tasks have too few rows to fill a
   register block (a decode step's: torch's kernel runs those faster), -2 when out of
   memory (then out holds nothing promised). */
int minirt_attention(const float *q, const float *k, const float *v, const float *mask,
                     const float *pk, const float *pv, const int64_t *slots,
                     const int64_t *plen, float *out, float *lse, const int64_t *strides,
                     const int *shape, float scale, int causal, int nthreads) {
    Args a = {.q = q, .k = k, .v = v, .mask = mask, .pk = pk, .pv = pv, .slots = slots,
              .plen = plen, .out = out, .lse = lse, .b = shape[0], .heads = shape[1],
              .kv_heads = shape[2], .m = shape[3], .n = shape[4], .d = shape[5],
              .causal = causal, .scale = scale};
    memcpy(a.qs, strides, sizeof a.qs);
    memcpy(a.ks, strides + 3, sizeof a.ks);
    memcpy(a.vs, strides + 6, sizeof a.vs);
    memcpy(a.ms, strides + 9, sizeof a.ms);
    memcpy(a.os, strides + 11, sizeof a.os);
    memcpy(a.ls, strides + 14, sizeof a.ls);
    memcpy(a.pks, strides + 16, sizeof a.pks);
    memcpy(a.pvs, strides + 18, sizeof a.pvs);
    a.ss = strides[20];
    double keys = 0;  /* prefix keys, all sequences */
    for (int i = 0; i < a.b; i++) {
        if (plen[i] < 0) return -1;
        keys += (double)plen[i];
    }
    if (a.b < 1 || a.m < 1 || a.n < 1 || a.kv_heads < 1 || a.heads % a.kv_heads ||
        a.d < 1 || a.d > MAXD || a.d % KB || a.heads / a.kv_heads * BQ > MAXROWS ||
        a.heads / a.kv_heads * (a.m < BQ ? a.m : BQ) <= (RV - 1) * W)
        return -1;
    a.tasks = a.b * a.kv_heads * ((a.m + BQ - 1) / BQ);
    /* A thread per 2 MFLOP or so, at most nthreads and one per task. */
    const double flop =
        4.0 * a.heads * (double)a.m * a.d * (a.b * a.n / (causal ? 2.0 : 1.0) + keys);
    int threads = nthreads < 1 ? 1 : nthreads;
    if (threads > flop / 2e6) threads = flop < 4e6 ? 1 : (int)(flop / 2e6);
    if (threads > a.tasks) threads = a.tasks;
    return run(&a, threads);
}
