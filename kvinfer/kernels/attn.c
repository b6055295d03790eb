/* Attention of query tokens over a KV cache read in place, for prefill, chunked prefill, decode and the `none`
 * backend's recompute alike: one arithmetic for a query row wherever it comes from.
 *
 * A query token at position pos of its sequence attends to positions [first, pos] (first = pos + 1 - window
 * with sliding-window attention, else 0), with keys and values found through the sequence's block table:
 *   key of position p, kv head g = k[table[p / BS] * block_stride + (p % BS) * tok_stride + g * head_stride]
 * which covers the paged pools ([blocks, BS, kv_heads, D]), the contiguous cache ([slots, kv_heads, max_len, D]:
 * one "block" per slot) and a step's own fresh K/V ([tokens, kv_heads, D]). Query heads h share kv head
 * h / (H / KVH) (MHA, GQA, MQA).
 *
 * Positions are split into fixed pieces of CHUNK positions counted from 0 (never a count chosen from the batch
 * or the thread count); each piece gives a partial softmax (max m, sum l of exp(s - m), o = sum exp(s - m) v)
 * and the pieces are merged in order. Which thread computes a piece does not matter, so the result of a query
 * row depends on its own position and cache contents only: not on the block size, the batch, the chunking of a
 * prefill or the number of threads. Work items are (query token, kv head) pairs with all the query heads that
 * share that kv head, so each key row is read once for them; when there are too few pairs to keep the threads
 * busy (decode of one or two long sequences), pieces become the items.
 */
#include "kernels.h"
#include "simd.h"

#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK 256

/* dot(q, k) over D: 8-lane FMAs into two accumulators (even / odd groups of 8), a sequential scalar tail. */
static inline float dot(const float *q, const float *k, int64_t D) {
    vf a0 = vf_zero(), a1 = vf_zero();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        a0 = vf_fma(vf_load(q + i), vf_load(k + i), a0);
        a1 = vf_fma(vf_load(q + i + 8), vf_load(k + i + 8), a1);
    }
    if (i + 8 <= D) {
        a0 = vf_fma(vf_load(q + i), vf_load(k + i), a0);
        i += 8;
    }
    float t = 0.0f;
    for (; i < D; i++) t = fmaf(q[i], k[i], t);
    return vf_hsum(vf_add(a0, a1)) + t;
}

/* o[0:D] = o + p * v, lane by lane (the same fused operation whether a lane is in a vector or the tail). */
static inline void axpy(float *o, float p, const float *v, int64_t D) {
    int64_t i = 0;
    const vf pp = vf_set1(p);
    for (; i + 8 <= D; i += 8) vf_store(o + i, vf_fma(pp, vf_load(v + i), vf_load(o + i)));
    for (; i < D; i++) o[i] = fmaf(p, v[i], o[i]);
}

/* s[i] = exp(s[i] - mx) for i < n; returns their sum (8-lane partial sums, then the tail in order). */
float kvq_exp_shift_sum(float *s, int64_t n, float mx) {
    int64_t i = 0;
    vf m = vf_set1(mx), acc = vf_zero();
    for (; i + 8 <= n; i += 8) {
        vf e = vf_exp(vf_sub(vf_load(s + i), m));
        vf_store(s + i, e);
        acc = vf_add(acc, e);
    }
    float sum = vf_hsum(acc);
    for (; i < n; i++) {
        s[i] = kvq_exp1(s[i] - mx);
        sum = sum + s[i];
    }
    return sum;
}

/* Piece [p0, p1) of query token t, kv head g: per query head of the group, part[h * (D + 2) + ...] = m, l, o.
 * Positions are walked block by block (no division per position); s is scratch of G * CHUNK floats. */
static void piece(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0, int64_t p1, float *s, float *part) {
    const int64_t G = j->H / j->KVH, D = j->D, n = p1 - p0, pos = j->tok_pos[t];
    const int64_t *table = j->tables + j->tok_seq[t] * j->table_stride;
    const float *q = j->q + t * j->q_stride + g * G * D;
    const int64_t hoff = g * j->head_stride;
    for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < p1; p++) {
        const float *k = j->k + table[bi] * j->block_stride + o * j->tok_stride + hoff;
        for (int64_t h = 0; h < G; h++) s[h * n + p - p0] = dot(q + h * D, k, D) * j->scale;
        if (++o == j->BS) o = 0, bi++;
    }
    for (int64_t h = 0; h < G; h++) {
        float *sh = s + h * n;
        if (j->slopes) {
            const float slope = j->slopes[g * G + h];
            for (int64_t p = p0; p < p1; p++) sh[p - p0] = sh[p - p0] + slope * (float)(p - pos);
        }
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
        float *ph = part + h * (D + 2);
        ph[0] = mx;
        ph[1] = kvq_exp_shift_sum(sh, n, mx);
        memset(ph + 2, 0, sizeof(float) * (size_t)D);
    }
    if (D == 64) { /* the common head size: the accumulator stays in registers (same operations, same order) */
        for (int64_t h = 0; h < G; h++) {
            vf a[8];
            for (int i = 0; i < 8; i++) a[i] = vf_zero();
            for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < p1; p++) {
                const float *v = j->v + table[bi] * j->block_stride + o * j->tok_stride + hoff;
                const vf pp = vf_set1(s[h * n + p - p0]);
                for (int i = 0; i < 8; i++) a[i] = vf_fma(pp, vf_load(v + 8 * i), a[i]);
                if (++o == j->BS) o = 0, bi++;
            }
            for (int i = 0; i < 8; i++) vf_store(part + h * (D + 2) + 2 + 8 * i, a[i]);
        }
        return;
    }
    for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < p1; p++) {
        const float *v = j->v + table[bi] * j->block_stride + o * j->tok_stride + hoff;
        for (int64_t h = 0; h < G; h++) axpy(part + h * (D + 2) + 2, s[h * n + p - p0], v, D);
        if (++o == j->BS) o = 0, bi++;
    }
}

/* The pieces of query token t: [max(c * CHUNK, first), min((c + 1) * CHUNK, pos + 1)) for c = c0 .. c1 - 1. */
static inline int64_t first_pos(const struct kvq_attn *j, int64_t t) {
    const int64_t pos = j->tok_pos[t];
    return j->window > 0 && pos + 1 > j->window ? pos + 1 - j->window : 0;
}

static inline void piece_range(const struct kvq_attn *j, int64_t t, int64_t c, int64_t *p0, int64_t *p1) {
    const int64_t first = first_pos(j, t), end = j->tok_pos[t] + 1;
    *p0 = c * CHUNK > first ? c * CHUNK : first;
    *p1 = (c + 1) * CHUNK < end ? (c + 1) * CHUNK : end;
}

/* Merge C pieces (part[c * G * (D + 2) + h * (D + 2)]) of query head h into out[0:D], in order. */
static void merge(const float *part, int64_t C, int64_t G, int64_t D, float *out) {
    const int64_t cs = G * (D + 2);
    float mx = -INFINITY, l = 0.0f;
    for (int64_t c = 0; c < C; c++) mx = part[c * cs] > mx ? part[c * cs] : mx;
    memset(out, 0, sizeof(float) * (size_t)D);
    for (int64_t c = 0; c < C; c++) {
        const float *pc = part + c * cs;
        const float w = kvq_exp1(pc[0] - mx);
        l = l + w * pc[1];
        int64_t i = 0;
        const vf wv = vf_set1(w);
        for (; i + 8 <= D; i += 8) vf_store(out + i, vf_add(vf_load(out + i), vf_mul(wv, vf_load(pc + 2 + i))));
        for (; i < D; i++) out[i] = out[i] + w * pc[2 + i];
    }
    const float inv = 1.0f / l;
    for (int64_t i = 0; i < D; i++) out[i] = out[i] * inv;
}

static inline int64_t num_pieces(const struct kvq_attn *j, int64_t t) {
    return j->tok_pos[t] / CHUNK - first_pos(j, t) / CHUNK + 1;
}

int kvq_attention(const struct kvq_attn *jp) {
    const struct kvq_attn j = *jp;
    if (j.T < 0 || j.H <= 0 || j.KVH <= 0 || j.H % j.KVH || j.D <= 0 || j.BS <= 0 || j.NB <= 0 ||
        j.table_stride <= 0 || j.q_stride < j.H * j.D || j.out_stride < j.H * j.D)
        return KVQ_EBADSHAPE;
    for (int64_t t = 0; t < j.T; t++) {
        const int64_t pos = j.tok_pos[t];
        if (pos < 0 || j.tok_seq[t] < 0 || pos / j.BS >= j.table_stride) return KVQ_EBADSHAPE;
        const int64_t *table = j.tables + j.tok_seq[t] * j.table_stride;
        for (int64_t b = first_pos(&j, t) / j.BS; b <= pos / j.BS; b++)
            if (table[b] < 0 || table[b] >= j.NB) return KVQ_EBADBLOCK;
    }
    if (j.T == 0) return KVQ_OK;
    const int64_t G = j.H / j.KVH, D = j.D, pairs = j.T * j.KVH;
    int nt = j.nthreads > 0 ? j.nthreads : 1;
    int64_t maxc = 1;
    for (int64_t t = 0; t < j.T; t++) maxc = num_pieces(&j, t) > maxc ? num_pieces(&j, t) : maxc;
    const int split = pairs < 2 * (int64_t)nt && maxc > 1; /* pieces as work items */
    const int64_t items = split ? pairs * maxc : pairs;
    float *shared = split ? (float *)malloc(sizeof(float) * (size_t)(items * G * (D + 2))) : NULL;
    if (split && !shared) return KVQ_ENOMEM;
    if (nt > items) nt = (int)items;
    int status = KVQ_OK;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(G * CHUNK));
        float *local = split ? NULL : (float *)malloc(sizeof(float) * (size_t)(maxc * G * (D + 2)));
        if (!s || (!split && !local)) {
#pragma omp atomic write
            status = KVQ_ENOMEM;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                if (split) { /* item = piece c of pair (t, g); empty pieces of shorter tokens are skipped */
                    const int64_t pair = it / maxc, c = it % maxc, t = pair / j.KVH, g = pair % j.KVH;
                    const int64_t c0 = first_pos(&j, t) / CHUNK;
                    if (c < num_pieces(&j, t)) {
                        int64_t p0, p1;
                        piece_range(&j, t, c0 + c, &p0, &p1);
                        piece(&j, t, g, p0, p1, s, shared + it * G * (D + 2));
                    }
                } else {
                    const int64_t t = it / j.KVH, g = it % j.KVH, C = num_pieces(&j, t);
                    const int64_t c0 = first_pos(&j, t) / CHUNK;
                    for (int64_t c = 0; c < C; c++) {
                        int64_t p0, p1;
                        piece_range(&j, t, c0 + c, &p0, &p1);
                        piece(&j, t, g, p0, p1, s, local + c * G * (D + 2));
                    }
                    for (int64_t h = 0; h < G; h++)
                        merge(local + h * (D + 2), C, G, D, j.out + t * j.out_stride + (g * G + h) * D);
                }
            }
        }
        free(s), free(local);
    }
    if (split && status == KVQ_OK) {
        for (int64_t pair = 0; pair < pairs; pair++) {
            const int64_t t = pair / j.KVH, g = pair % j.KVH;
            for (int64_t h = 0; h < G; h++)
                merge(shared + pair * maxc * G * (D + 2) + h * (D + 2), num_pieces(&j, t), G, D,
                      j.out + t * j.out_stride + (g * G + h) * D);
        }
    }
    free(shared);
    return status;
}
