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
 *
 * This file: the general route (any query rows, every cache type). The 8-bit caches' fast piece is attn_kv8.c,
 * storing rows kvstore.c, the prompt rows' AMX route amx/attn_prompt.c.
 */
#include "attn.h"


/* kvq_exp_shift_sum's first elements, per level: at the AVX-512 level exp 16 lanes at a time (the same
 * operations), added 8 lanes at a time in order; returns how many it did. */
#if KVQ_LEVEL >= 2
static inline int64_t exp_shift_wide(float *s, int64_t n, float mx, vf *acc) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = v16_exp(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(s + i, e);
        *acc = vf_add(*acc, _mm512_castps512_ps256(e));
        *acc = vf_add(*acc, _mm512_extractf32x8_ps(e, 1));
    }
    return i;
}
#else
static inline int64_t exp_shift_wide(float *s, int64_t n, float mx, vf *acc) {
    (void)s, (void)n, (void)mx, (void)acc;
    return 0;
}
#endif

/* s[i] = exp(s[i] - mx) for i < n; returns their sum (8-lane partial sums, then the tail in order). */
float kvq_exp_shift_sum(float *s, int64_t n, float mx) {
    vf m = vf_set1(mx), acc = vf_zero();
    int64_t i = exp_shift_wide(s, n, mx, &acc);
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

/* 8 cache values at p as floats (exact: int8 and e4m3 values are all floats). */
static inline __attribute__((always_inline)) vf load8(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return vf_load((const float *)p + i);
    if (DT == KV_BF16) return vf_load_bf16((const uint16_t *)p + i);
    if (DT == KV_INT8) return vf_load_i8((const int8_t *)p + i);
    float t[8];
    for (int l = 0; l < 8; l++) t[l] = kvqi_fp8_table[((const uint8_t *)p)[i + l]];
    return vf_load(t);
}

static inline __attribute__((always_inline)) float load1(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return ((const float *)p)[i];
    if (DT == KV_BF16) return kvq_bf16(((const uint16_t *)p)[i]);
    if (DT == KV_INT8) return (float)((const int8_t *)p)[i];
    return kvqi_fp8_table[((const uint8_t *)p)[i]];
}

static inline __attribute__((always_inline)) const void *at(const void *base, int64_t off, const int DT) {
    if (DT == KV_F32) return (const void *)((const float *)base + off);
    if (DT == KV_BF16) return (const void *)((const uint16_t *)base + off);
    return (const void *)((const uint8_t *)base + off);
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

/* ---- piece64_rows' arithmetic, one definition per level: scores64_8 (the scaled scores of up to 8 positions for
 * one query head) and values64_tile (a piece's values for every token of a tile and every head). Every level
 * computes the same bits: the AVX-512 level's 16 lanes hold two 8-lane vectors side by side, each lane its own IEEE
 * operations, and its sums add in the 8-lane code's order. ---- */
#if KVQ_LEVEL >= 2

static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return _mm512_loadu_ps((const float *)p + i);
    return v16_load_bf16((const uint16_t *)p + i);
}

/* dot_kv's two accumulators for a 64-value key row: a0 (even groups of 8) in lanes 0-7, a1 (odd) in 8-15. */
static inline __attribute__((always_inline)) __m512 dot64_pair(const __m512 *q, const void *k, const int DT) {
    __m512 z = _mm512_fmadd_ps(q[0], load16(k, 0, DT), _mm512_setzero_ps());
    z = _mm512_fmadd_ps(q[1], load16(k, 16, DT), z);
    z = _mm512_fmadd_ps(q[2], load16(k, 32, DT), z);
    return _mm512_fmadd_ps(q[3], load16(k, 48, DT), z);
}

/* values64 for all 64 lanes at once: 16 per register, the same FMA per lane in the same order. */
static inline __attribute__((always_inline)) void values64_16(const void *vbase, const int64_t *offs, int64_t n,
                                                              const float *s, float *part, int64_t h0,
                                                              const int NH, const int DT) {
    __m512 a[3][4];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < 4; c++) a[h][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const void *v = at(vbase, offs[i], DT);
        const __m512 v0 = load16(v, 0, DT), v1 = load16(v, 16, DT), v2 = load16(v, 32, DT), v3 = load16(v, 48, DT);
        for (int h = 0; h < NH; h++) {
            const __m512 w = _mm512_set1_ps(s[(h0 + h) * n + i]);
            a[h][0] = _mm512_fmadd_ps(w, v0, a[h][0]);
            a[h][1] = _mm512_fmadd_ps(w, v1, a[h][1]);
            a[h][2] = _mm512_fmadd_ps(w, v2, a[h][2]);
            a[h][3] = _mm512_fmadd_ps(w, v3, a[h][3]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(part + (h0 + h) * 66 + 2 + 16 * c, a[h][c]);
}

/* Scores of the m <= 8 positions at offs (the rest 0) for query head qh: vf_hsum(a0 + a1) + 0 (dot_kv's empty
 * scalar tail), times the scale, lane u position u. (tmp: the 8-lane code's scratch, not needed here.) */
static inline __attribute__((always_inline)) vf scores64_8(const float *qh, const void *kb, const int64_t *offs,
                                                           int m, float scale, float *tmp, const int DT) {
    (void)tmp;
    const __m512 q4[4] = {_mm512_loadu_ps(qh), _mm512_loadu_ps(qh + 16), _mm512_loadu_ps(qh + 32),
                          _mm512_loadu_ps(qh + 48)};
    __m512 z[8];
    for (int u = 0; u < 8; u++) z[u] = u < m ? dot64_pair(q4, at(kb, offs[u], DT), DT) : _mm512_setzero_ps();
    return vf_mul(vf_add(hsum_pairs8(z), vf_zero()), vf_set1(scale));
}

/* The values of tokens 0..nt-1 (token i: positions [p0, p1s[i]), weights s + i * G * CHUNK) into parts[i], all 64
 * lanes of up to three heads at once. */
static inline __attribute__((always_inline)) void values64_tile(const void *vb, const int64_t *offs, int nt,
                                                                int64_t G, int64_t p0, const int64_t *p1s,
                                                                const float *s, float *const *parts, const int DT) {
    for (int i = 0; i < nt; i++) {
        const int64_t n = p1s[i] - p0;
        const float *si = s + i * G * CHUNK;
        for (int64_t h = 0; h < G; h += 3) {
            const int64_t nh = G - h < 3 ? G - h : 3;
            if (nh == 3) values64_16(vb, offs, n, si, parts[i], h, 3, DT);
            else if (nh == 2) values64_16(vb, offs, n, si, parts[i], h, 2, DT);
            else values64_16(vb, offs, n, si, parts[i], h, 1, DT);
        }
    }
}
#else
/* Values of a piece for query heads h0 .. h0 + NH - 1 (NH <= 3), head size 64, lanes [c, c + 16): part[h][2 + c
 * + i] = the sum over positions, in order, of fma(p, v[c + i], .) (six accumulators, no spills); each value row's
 * 64-byte slice is read once for the NH heads. */
static inline __attribute__((always_inline)) void values64(const void *vbase, const int64_t *offs, int64_t n,
                                                           const float *s, float *part, int64_t h0, const int NH,
                                                           int c, const int DT) {
    vf a[3][2];
    for (int h = 0; h < NH; h++) a[h][0] = a[h][1] = vf_zero();
    for (int64_t i = 0; i < n; i++) {
        const void *v = at(vbase, offs[i] + c, DT);
        const vf v0 = load8(v, 0, DT), v1 = load8(v, 8, DT);
        for (int h = 0; h < NH; h++) {
            const vf w = vf_set1(s[(h0 + h) * n + i]);
            a[h][0] = vf_fma(w, v0, a[h][0]);
            a[h][1] = vf_fma(w, v1, a[h][1]);
        }
    }
    for (int h = 0; h < NH; h++) {
        vf_store(part + (h0 + h) * 66 + 2 + c, a[h][0]);
        vf_store(part + (h0 + h) * 66 + 2 + c + 8, a[h][1]);
    }
}

/* scores64_8 in 8 lanes: per position, dot_kv's two accumulators (a0 the even groups of 8, a1 the odd ones) into
 * row u of tmp (rows m..7 hold zeros), then one transpose-add of the 8 rows. */
static inline __attribute__((always_inline)) vf scores64_8(const float *qh, const void *kb, const int64_t *offs,
                                                           int m, float scale, float *tmp, const int DT) {
    for (int u = 0; u < m; u++) {
        const void *k = at(kb, offs[u], DT);
        vf a0 = vf_fma(vf_load(qh), load8(k, 0, DT), vf_zero());
        vf a1 = vf_fma(vf_load(qh + 8), load8(k, 8, DT), vf_zero());
        a0 = vf_fma(vf_load(qh + 16), load8(k, 16, DT), a0);
        a1 = vf_fma(vf_load(qh + 24), load8(k, 24, DT), a1);
        a0 = vf_fma(vf_load(qh + 32), load8(k, 32, DT), a0);
        a1 = vf_fma(vf_load(qh + 40), load8(k, 40, DT), a1);
        a0 = vf_fma(vf_load(qh + 48), load8(k, 48, DT), a0);
        a1 = vf_fma(vf_load(qh + 56), load8(k, 56, DT), a1);
        vf_store(tmp + 8 * u, vf_add(a0, a1));
    }
    /* vf_hsum(a0 + a1) + 0 (dot_kv's empty scalar tail), times the scale */
    return vf_mul(vf_add(vf_hsum_each8(tmp), vf_zero()), vf_set1(scale));
}

/* values64_tile in 16-lane slices (values64), a slice of every token and head before the next slice. */
static inline __attribute__((always_inline)) void values64_tile(const void *vb, const int64_t *offs, int nt,
                                                                int64_t G, int64_t p0, const int64_t *p1s,
                                                                const float *s, float *const *parts, const int DT) {
    for (int c = 0; c < 64; c += 16)
        for (int i = 0; i < nt; i++) {
            const int64_t n = p1s[i] - p0;
            const float *si = s + i * G * CHUNK;
            for (int64_t h = 0; h < G; h += 3) {
                const int64_t nh = G - h < 3 ? G - h : 3;
                if (nh == 3) values64(vb, offs, n, si, parts[i], h, 3, c, DT);
                else if (nh == 2) values64(vb, offs, n, si, parts[i], h, 2, c, DT);
                else values64(vb, offs, n, si, parts[i], h, 1, c, DT);
            }
        }
}
#endif

#define WIDEN_MIN_TOKENS 4 /* tokens of a tile from which a bfloat16 piece is widened first */

/* Pieces [p0, p1s[i]) of the query tokens t0 + i (i < nt <= QTILE: one sequence, consecutive positions, so
 * p1s ascends), kv head g, for head size 64 and float values (float32, bfloat16). For every token, the same
 * operations in the same order as piece_dt's general code (a token's result does not depend on the others in its
 * tile), arranged for the machine: scores eight positions at a time (one transpose-add instead of eight
 * horizontal sums), the running maximum kept per lane, values in 16-lane slices with the weights of up to three
 * heads; each group of key rows and each slice of value rows is read from memory once for the G query heads of
 * all nt tokens. Row i of the piece is at kb / vb + offs[i] (in elements of DT). s: scratch of nt * G * CHUNK
 * floats; parts[i]: token i's piece (G * (D + 2) floats). */
static inline __attribute__((always_inline)) void piece64_rows(const struct kvq_attn *j, const void *kb,
                                                               const void *vb, const int64_t *offs, int64_t t0,
                                                               int nt, int64_t g, int64_t p0, const int64_t *p1s,
                                                               float *s, float *const *parts, const int DT) {
    const int64_t G = j->H / j->KVH, P1 = p1s[nt - 1];
    float tmp[64];
    const int esz = DT == KV_BF16 ? 2 : 4;
    for (int64_t i0 = 0; i0 < P1 - p0; i0 += 8) {
        /* the next 8 positions' key rows, and these 8 positions' value rows (read after this piece's scores):
         * asked for ahead, as rows sit wherever their blocks are; it pays most where the cache streams from
         * memory (docs/BENCHMARKS.md, "Figures behind code decisions") */
        for (int64_t u = i0 + 8; u < i0 + 16 && u < P1 - p0; u++)
            for (int o = 0; o < 64 * esz; o += 64) __builtin_prefetch((const char *)kb + offs[u] * esz + o);
        for (int64_t u = i0; u < i0 + 8 && u < P1 - p0; u++)
            for (int o = 0; o < 64 * esz; o += 64) __builtin_prefetch((const char *)vb + offs[u] * esz + o);
        for (int i = 0; i < nt; i++) {
            const int64_t n = p1s[i] - p0;
            if (i0 >= n) continue;
            const int m = n - i0 < 8 ? (int)(n - i0) : 8;
            for (int u = m; u < 8; u++) vf_store(tmp + 8 * u, vf_zero());
            const float *q = j->q + (t0 + i) * j->q_stride + g * G * 64;
            for (int64_t h = 0; h < G; h++) {
                const vf r = scores64_8(q + h * 64, kb, offs + i0, m, j->scale, tmp, DT);
                float *sh = s + i * G * CHUNK + h * n + i0;
                if (m == 8) vf_store(sh, r);
                else {
                    float t8[8];
                    vf_store(t8, r);
                    memcpy(sh, t8, sizeof(float) * (size_t)m);
                }
            }
        }
    }
    for (int i = 0; i < nt; i++) {
        const int64_t n = p1s[i] - p0, pos = j->tok_pos[t0 + i];
        for (int64_t h = 0; h < G; h++) {
            float *sh = s + i * G * CHUNK + h * n;
            if (j->slopes) {
                const float slope = j->slopes[g * G + h];
                for (int64_t x = 0; x < n; x++) sh[x] = sh[x] + slope * (float)(p0 + x - pos);
            }
            /* the maximum (NaN scores are passed over, as in piece_dt): per lane, then across lanes in order */
            vf mv = vf_set1(-INFINITY);
            int64_t x = 0;
            for (; x + 8 <= n; x += 8) mv = vf_max(vf_load(sh + x), mv);
            float lanes[8], mx = -INFINITY;
            vf_store(lanes, mv);
            for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
            for (; x < n; x++) mx = sh[x] > mx ? sh[x] : mx;
            float *ph = parts[i] + h * 66;
            ph[0] = mx;
            ph[1] = kvq_exp_shift_sum(sh, n, mx);
        }
    }
    values64_tile(vb, offs, nt, G, p0, p1s, s, parts, DT);
}

/* piece64_rows over the cache rows of positions [p0, P1) of kv head g, found through the block table. With a
 * bfloat16 cache and `wide` (scratch of 2 * CHUNK * 64 floats), the piece's key and value rows are widened to float
 * once (exactly) for all the tile's tokens and heads, instead of at every read: the same values, the same bits. */
static void piece64_tile(const struct kvq_attn *j, int64_t t0, int nt, int64_t g, int64_t p0, const int64_t *p1s,
                         float *s, float *const *parts, float *wide) {
    const int64_t P1 = p1s[nt - 1];
    const int64_t *table = j->tables + j->tok_seq[t0] * j->table_stride;
    const int64_t hoff = g * j->head_stride;
    int64_t offs[CHUNK];
    for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < P1; p++) {
        offs[p - p0] = table[bi] * j->block_stride + o * j->tok_stride + hoff;
        if (++o == j->BS) o = 0, bi++;
    }
    if (j->kv_dtype != KV_BF16) {
        piece64_rows(j, j->k, j->v, offs, t0, nt, g, p0, p1s, s, parts, KV_F32);
        return;
    }
    if (!wide) {
        piece64_rows(j, j->k, j->v, offs, t0, nt, g, p0, p1s, s, parts, KV_BF16);
        return;
    }
    float *kw = wide, *vw = wide + CHUNK * 64;
    for (int64_t i = 0; i < P1 - p0; i++) {
        const uint16_t *kr = (const uint16_t *)j->k + offs[i], *vr = (const uint16_t *)j->v + offs[i];
        for (int c = 0; c < 64; c += 8) {
            vf_store(kw + i * 64 + c, vf_load_bf16(kr + c));
            vf_store(vw + i * 64 + c, vf_load_bf16(vr + c));
        }
        offs[i] = i * 64;
    }
    piece64_rows(j, kw, vw, offs, t0, nt, g, p0, p1s, s, parts, KV_F32);
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
    if (!KV_IS_8BIT(DT) && D == 64) { /* (one compiled copy of piece64 per value type: see piece64_tile) */
        piece64_tile(j, t, 1, g, p0, &p1, s, &part, NULL);
        return;
    }
    for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < p1; p++) {
        const int64_t off = table[bi] * j->block_stride + o * j->tok_stride + hoff;
        const void *k = at(j->k, off, DT);
        for (int64_t h = 0; h < G; h++) {
            if (!KV_IS_8BIT(DT)) {
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
    for (int64_t p = p0, bi = p0 / j->BS, o = p0 % j->BS; p < p1; p++) {
        const int64_t off = table[bi] * j->block_stride + o * j->tok_stride + hoff;
        const void *v = at(j->v, off, DT);
        for (int64_t h = 0; h < G; h++) {
            float *o_ = part + h * (D + 2) + 2;
            for (int64_t c = 0; c < D; c += GS) { /* each group with its own scale: w = p * v_scale */
                const float w = !KV_IS_8BIT(DT) ? s[h * n + p - p0] : s[h * n + p - p0] * j->v_scale[(off + c) / GS];
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

/* Per-thread scratch of a piece. */
static size_t piece_scratch(const struct kvq_attn *j) {
    const int64_t G = j->H / j->KVH;
    const size_t plain = sizeof(float) * (size_t)(G * CHUNK);
    if (!KV_IS_8BIT(j->kv_dtype) || !kv_rotated(j->D)) return plain;
    const size_t fast = kvqi_piece8_scratch(G, j->D);
    return fast > plain ? fast : plain;
}

static void piece(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0, int64_t p1, char *s, float *part) {
    if (KV_IS_8BIT(j->kv_dtype) && kv_rotated(j->D))
        kvqi_piece8(j, t, g, p0, p1, s, part, j->kv_dtype == KV_INT8 ? KV_INT8 : KV_FP8);
    else if (j->kv_dtype == KV_INT8) piece_dt(j, t, g, p0, p1, (float *)s, part, KV_INT8);
    else if (j->kv_dtype == KV_FP8) piece_dt(j, t, g, p0, p1, (float *)s, part, KV_FP8);
    else if (j->kv_dtype == KV_BF16) piece_dt(j, t, g, p0, p1, (float *)s, part, KV_BF16);
    else piece_dt(j, t, g, p0, p1, (float *)s, part, KV_F32);
}

static inline void piece_range(const struct kvq_attn *j, int64_t t, int64_t c, int64_t *p0, int64_t *p1) {
    const int64_t first = first_pos(j, t), end = j->tok_pos[t] + 1;
    *p0 = c * CHUNK > first ? c * CHUNK : first;
    *p1 = (c + 1) * CHUNK < end ? (c + 1) * CHUNK : end;
}

/* Merge C pieces (part[c * G * (D + 2) + h * (D + 2)]) of query head h into out[0:D], in order. */
void kvqi_attn_merge(const float *part, int64_t C, int64_t G, int64_t D, float *out) {
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

/* merge(), then out of a rotated 8-bit cache's space (see rotate). */
static void merge_out(const struct kvq_attn *j, const float *part, int64_t C, int64_t G, float *out) {
    kvqi_attn_merge(part, C, G, j->D, out);
    if (KV_IS_8BIT(j->kv_dtype) && kv_rotated(j->D)) rotate(out, j->D, 1.0f / KV_GROUP);
}

/* The job's shape and block ids checked (both routes). */
int kvqi_attn_check(const struct kvq_attn *jp) {
    const struct kvq_attn j = *jp;
    if (j.T < 0 || j.H <= 0 || j.KVH <= 0 || j.H % j.KVH || j.D <= 0 || j.BS <= 0 || j.NB <= 0 ||
        j.table_stride <= 0 || j.q_stride < j.H * j.D || j.out_stride < j.H * j.D || j.kv_dtype < KV_F32 ||
        j.kv_dtype > KV_BF16)
        return KVQ_EBADSHAPE;
    if (KV_IS_8BIT(j.kv_dtype) && (!j.k_scale || !j.v_scale || j.block_stride % kv_group(j.D) ||
                                 j.tok_stride % kv_group(j.D) || j.head_stride % kv_group(j.D)))
        return KVQ_EBADSHAPE; /* an 8-bit cache's scales sit at the groups' offsets / group size */
    for (int64_t t = 0; t < j.T; t++) {
        const int64_t pos = j.tok_pos[t];
        if (pos < 0 || j.tok_seq[t] < 0 || pos / j.BS >= j.table_stride) return KVQ_EBADSHAPE;
        const int64_t *table = j.tables + j.tok_seq[t] * j.table_stride;
        for (int64_t b = first_pos(&j, t) / j.BS; b <= pos / j.BS; b++)
            if (table[b] < 0 || table[b] >= j.NB) return KVQ_EBADBLOCK;
    }
    return KVQ_OK;
}

int kvq_attention(const struct kvq_attn *jp) {
    const struct kvq_attn j = *jp;
    const int rc = kvqi_attn_check(&j);
    if (rc != KVQ_OK || j.T == 0) return rc;
    const int64_t G = j.H / j.KVH, D = j.D, pairs = j.T * j.KVH;
    int nt = j.nthreads > 0 ? j.nthreads : 1;
    int64_t maxc = 1;
    for (int64_t t = 0; t < j.T; t++) maxc = num_pieces(&j, t) > maxc ? num_pieces(&j, t) : maxc;
    const int split = pairs < 2 * (int64_t)nt && maxc > 1; /* pieces as work items */
    /* Otherwise items are (query tile, kv head): with head size 64, float values and no window, up to QTILE
     * consecutive tokens of one sequence are a tile (their pieces read each cache row once); else one token. */
    const int tiled = !split && D == 64 && (j.kv_dtype == KV_F32 || j.kv_dtype == KV_BF16) && j.window <= 0;
    int64_t *tile0 = NULL, ntiles = j.T;
    if (tiled) {
        tile0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(j.T + 1));
        if (!tile0) return KVQ_ENOMEM;
        ntiles = 0;
        for (int64_t t = 0; t < j.T; t++)
            if (!(ntiles && t - tile0[ntiles - 1] < QTILE && j.tok_seq[t] == j.tok_seq[t - 1] &&
                  j.tok_pos[t] == j.tok_pos[t - 1] + 1))
                tile0[ntiles++] = t;
        tile0[ntiles] = j.T;
    }
    const int64_t items = split ? pairs * maxc : ntiles * j.KVH;
    float *shared = split ? (float *)malloc(sizeof(float) * (size_t)(items * G * (D + 2))) : NULL;
    if (split && !shared) return KVQ_ENOMEM;
    if (nt > items) nt = (int)items;
    const int64_t per_tok = maxc * G * (D + 2); /* a token's pieces */
    int status = KVQ_OK;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* tiled with a bfloat16 cache: also room for a piece's key and value rows widened (piece64_tile) */
        const size_t wide_floats = tiled && j.kv_dtype == KV_BF16 ? 2 * CHUNK * 64 : 0;
        char *s = (char *)malloc(tiled ? sizeof(float) * (QTILE * (size_t)(G * CHUNK) + wide_floats + 16)
                                       : piece_scratch(&j));
        float *wide = s && wide_floats ? (float *)(((uintptr_t)(s + sizeof(float) * QTILE * (size_t)(G * CHUNK)) + 63)
                                                   & ~(uintptr_t)63) : NULL;
        float *local = split ? NULL : (float *)malloc(sizeof(float) * (size_t)((tiled ? QTILE : 1) * per_tok));
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
                } else if (tiled) { /* kv head major: one head's keys and values stay in cache */
                    const int64_t g = it / ntiles, t0 = tile0[it % ntiles];
                    const int n = (int)(tile0[it % ntiles + 1] - t0);
                    float *parts[QTILE];
                    int64_t p1s[QTILE];
                    for (int64_t c = 0; c < num_pieces(&j, t0 + n - 1); c++) {
                        int a = 0; /* tokens whose positions reach piece c: a suffix of the tile */
                        while (c >= num_pieces(&j, t0 + a)) a++;
                        int64_t p0 = 0;
                        for (int i = a; i < n; i++) {
                            piece_range(&j, t0 + i, c, &p0, &p1s[i]);
                            parts[i] = local + i * per_tok + c * G * (D + 2);
                        }
                        /* widening pays from a few tokens a tile, not for a decode token alone */
                        piece64_tile(&j, t0 + a, n - a, g, p0, p1s + a, (float *)s, parts + a,
                                     n - a >= WIDEN_MIN_TOKENS ? wide : NULL);
                    }
                    for (int i = 0; i < n; i++)
                        for (int64_t h = 0; h < G; h++)
                            merge_out(&j, local + i * per_tok + h * (D + 2), num_pieces(&j, t0 + i), G,
                                      j.out + (t0 + i) * j.out_stride + (g * G + h) * D);
                } else {
                    const int64_t t = it % j.T, g = it / j.T, C = num_pieces(&j, t);
                    const int64_t c0 = first_pos(&j, t) / CHUNK;
                    for (int64_t c = 0; c < C; c++) {
                        int64_t p0, p1;
                        piece_range(&j, t, c0 + c, &p0, &p1);
                        piece(&j, t, g, p0, p1, s, local + c * G * (D + 2));
                    }
                    for (int64_t h = 0; h < G; h++)
                        merge_out(&j, local + h * (D + 2), C, G, j.out + t * j.out_stride + (g * G + h) * D);
                }
            }
        }
        free(s), free(local);
    }
    free(tile0);
    if (split && status == KVQ_OK) {
        for (int64_t pair = 0; pair < pairs; pair++) {
            const int64_t t = pair / j.KVH, g = pair % j.KVH;
            for (int64_t h = 0; h < G; h++)
                merge_out(&j, shared + pair * maxc * G * (D + 2) + h * (D + 2), num_pieces(&j, t), G,
                          j.out + t * j.out_stride + (g * G + h) * D);
        }
    }
    free(shared);
    return status;
}
