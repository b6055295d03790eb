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

/* ---- 8-bit caches: int8, or fp8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no infinities, max
 * 448); each group of KV_GROUP values of a row (the whole row when D is not a multiple) has a float32 scale (its
 * largest |value| / 127, or / 448): one outlier channel coarsens 32 values, not the whole head ---- */

#define KV_GROUP 32
static inline int64_t kv_group(int64_t D) { return D % KV_GROUP == 0 ? KV_GROUP : D; }

float kvq_fp8_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = (float)m * 0.001953125f; /* subnormal: m * 2^-9 */
    else v = ldexpf(1.0f + (float)m * 0.125f, e - 7);
    return (b & 0x80) ? -v : v;
}

static float fp8_table[256];
__attribute__((constructor)) static void fp8_init(void) {
    for (int i = 0; i < 256; i++) fp8_table[i] = kvq_fp8_value((uint8_t)i);
}

/* Round to the nearest e4m3 value (ties to even), saturating at +-448. */
static uint8_t fp8_encode(float v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    float a = fabsf(v);
    if (a != a) return sign | 0x7f;
    if (a >= 464.0f) return sign | 0x7e; /* 464 is halfway between 448 and the (absent) 480 */
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormals (8 rounds up to 2^-6) */
    int ex;
    const float f = frexpf(a, &ex); /* a = f * 2^ex, f in [0.5, 1) */
    int m = (int)nearbyintf((f * 2.0f - 1.0f) * 8.0f), biased = ex - 1 + 7;
    if (m == 8) m = 0, biased++;
    if (biased > 15 || (biased == 15 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)(biased << 3 | m);
}

void kvq_kv_store(const float *src, int64_t T, int64_t src_stride, int64_t KVH, int64_t D, const int64_t *dst_off,
                  int64_t head_stride, void *dst, float *dst_scale, int kv_dtype) {
    const float top = kv_dtype == KV_INT8 ? 127.0f : 448.0f;
    const int64_t GS = kv_group(D);
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < KVH; g++)
            for (int64_t j = 0; j < D; j += GS) {
                const float *x = src + t * src_stride + g * D + j;
                const int64_t off = dst_off[t] + g * head_stride + j;
                float amax = 0.0f;
                for (int64_t i = 0; i < GS; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
                const float inv = amax > 0.0f ? top / amax : 0.0f;
                dst_scale[off / GS] = amax / top;
                if (kv_dtype == KV_INT8) {
                    int8_t *q = (int8_t *)dst + off;
                    for (int64_t i = 0; i < GS; i++) {
                        const float r = nearbyintf(x[i] * inv);
                        q[i] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r);
                    }
                } else {
                    uint8_t *q = (uint8_t *)dst + off;
                    for (int64_t i = 0; i < GS; i++) q[i] = fp8_encode(x[i] * inv);
                }
            }
}

/* 8 cache values at p as floats (exact: int8 and e4m3 values are all floats). */
static inline __attribute__((always_inline)) vf load8(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return vf_load((const float *)p + i);
    if (DT == KV_INT8) return vf_load_i8((const int8_t *)p + i);
    float t[8];
    for (int l = 0; l < 8; l++) t[l] = fp8_table[((const uint8_t *)p)[i + l]];
    return vf_load(t);
}

static inline __attribute__((always_inline)) float load1(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return ((const float *)p)[i];
    if (DT == KV_INT8) return (float)((const int8_t *)p)[i];
    return fp8_table[((const uint8_t *)p)[i]];
}

static inline __attribute__((always_inline)) const void *at(const void *base, int64_t off, const int DT) {
    return DT == KV_F32 ? (const void *)((const float *)base + off) : (const void *)((const uint8_t *)base + off);
}

/* dot(q, k) over D for a cache row of type DT: the same operations as dot() on the row's float values. */
static inline __attribute__((always_inline)) float dot_kv(const float *q, const void *k, int64_t D, const int DT) {
    vf a0 = vf_zero(), a1 = vf_zero();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        a0 = vf_fma(vf_load(q + i), load8(k, i, DT), a0);
        a1 = vf_fma(vf_load(q + i + 8), load8(k, i + 8, DT), a1);
    }
    if (i + 8 <= D) {
        a0 = vf_fma(vf_load(q + i), load8(k, i, DT), a0);
        i += 8;
    }
    float t = 0.0f;
    for (; i < D; i++) t = fmaf(q[i], load1(k, i, DT), t);
    return vf_hsum(vf_add(a0, a1)) + t;
}

/* Piece [p0, p1) of query token t, kv head g: per query head of the group, part[h * (D + 2) + ...] = m, l, o.
 * Positions are walked block by block (no division per position); s is scratch of G * CHUNK floats. With an
 * 8-bit cache a score is dot(q, k) * k_scale * scale and a value row enters with weight p * v_scale. */
static inline __attribute__((always_inline)) void piece_dt(const struct kvq_attn *j, int64_t t, int64_t g,
                                                           int64_t p0, int64_t p1, float *s, float *part,
                                                           const int DT) {
    const int64_t G = j->H / j->KVH, D = j->D, n = p1 - p0, pos = j->tok_pos[t];
    const int64_t *table = j->tables + j->tok_seq[t] * j->table_stride;
    const float *q = j->q + t * j->q_stride + g * G * D;
    const int64_t hoff = g * j->head_stride;
    const int64_t GS = kv_group(D);
    for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < p1; p++) {
        const int64_t off = table[bi] * j->block_stride + o * j->tok_stride + hoff;
        const void *k = at(j->k, off, DT);
        for (int64_t h = 0; h < G; h++) {
            if (DT == KV_F32) {
                s[h * n + p - p0] = dot_kv(q + h * D, k, D, DT) * j->scale;
                continue;
            }
            float d = 0.0f; /* group by group: its dot product times its scale, summed in order */
            for (int64_t c = 0; c < D; c += GS)
                d = d + dot_kv(q + h * D + c, at(k, c, DT), GS, DT) * j->k_scale[(off + c) / GS];
            s[h * n + p - p0] = d * j->scale;
        }
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
                const int64_t off = table[bi] * j->block_stride + o * j->tok_stride + hoff;
                const void *v = at(j->v, off, DT);
                const float pw = s[h * n + p - p0];
                for (int i = 0; i < 8; i++) {
                    const float w = DT == KV_F32 ? pw : pw * j->v_scale[(off + 8 * i) / GS];
                    a[i] = vf_fma(vf_set1(w), load8(v, 8 * i, DT), a[i]);
                }
                if (++o == j->BS) o = 0, bi++;
            }
            for (int i = 0; i < 8; i++) vf_store(part + h * (D + 2) + 2 + 8 * i, a[i]);
        }
        return;
    }
    for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < p1; p++) {
        const int64_t off = table[bi] * j->block_stride + o * j->tok_stride + hoff;
        const void *v = at(j->v, off, DT);
        for (int64_t h = 0; h < G; h++) {
            float *o_ = part + h * (D + 2) + 2;
            for (int64_t c = 0; c < D; c += GS) { /* each group with its own scale: w = p * v_scale */
                const float w = DT == KV_F32 ? s[h * n + p - p0] : s[h * n + p - p0] * j->v_scale[(off + c) / GS];
                const int64_t e = c + GS;
                int64_t i = c;
                const vf pp = vf_set1(w);
                for (; i + 8 <= e; i += 8) vf_store(o_ + i, vf_fma(pp, load8(v, i, DT), vf_load(o_ + i)));
                for (; i < e; i++) o_[i] = fmaf(w, load1(v, i, DT), o_[i]);
            }
        }
        if (++o == j->BS) o = 0, bi++;
    }
}

static void piece(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0, int64_t p1, float *s, float *part) {
    if (j->kv_dtype == KV_INT8) piece_dt(j, t, g, p0, p1, s, part, KV_INT8);
    else if (j->kv_dtype == KV_FP8) piece_dt(j, t, g, p0, p1, s, part, KV_FP8);
    else piece_dt(j, t, g, p0, p1, s, part, KV_F32);
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
        j.table_stride <= 0 || j.q_stride < j.H * j.D || j.out_stride < j.H * j.D || j.kv_dtype < KV_F32 ||
        j.kv_dtype > KV_FP8)
        return KVQ_EBADSHAPE;
    if (j.kv_dtype != KV_F32 && (!j.k_scale || !j.v_scale || j.block_stride % kv_group(j.D) ||
                                 j.tok_stride % kv_group(j.D) || j.head_stride % kv_group(j.D)))
        return KVQ_EBADSHAPE; /* an 8-bit cache's scales sit at the groups' offsets / group size */
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
