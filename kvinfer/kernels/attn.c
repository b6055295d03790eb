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
#if KVQ_LEVEL >= 2 /* exp 16 lanes at a time (the same operations), added 8 lanes at a time in order */
    for (; i + 16 <= n; i += 16) {
        const __m512 e = v16_exp(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(s + i, e);
        acc = vf_add(acc, _mm512_castps512_ps256(e));
        acc = vf_add(acc, _mm512_extractf32x8_ps(e, 1));
    }
#endif
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

/* Rows of a head size that is a multiple of KV_GROUP are stored rotated: each group of R = KV_GROUP values goes
 * through an unnormalised Walsh-Hadamard transform (H H = R I) before it is quantised. An outlier channel is
 * spread over its group, so the group's scale, and with it every value's rounding step, shrinks; attention
 * rotates q the same way (q.k is unchanged: (H q / R).(H k) = q.k) and rotates its output back
 * (sum p H v = H sum p v). The butterflies run in a fixed order and 1/R is exact, so every level computes the
 * same bits. (Rotating whole 64-value heads instead was no better: docs/BENCHMARKS.md.) */
static inline void wht(float *x, int64_t n) {
    for (int64_t len = 1; len < n; len <<= 1)
        for (int64_t i = 0; i < n; i += len << 1)
            for (int64_t k = i; k < i + len; k++) {
                const float a = x[k], b = x[k + len];
                x[k] = a + b, x[k + len] = a - b;
            }
}

/* x[0:D] rotated group by group, times `mul` (1/R to go back, or 1 when storing). */
static inline void rotate(float *x, int64_t D, float mul) {
    for (int64_t c = 0; c < D; c += KV_GROUP) {
        wht(x + c, KV_GROUP);
        if (mul != 1.0f)
            for (int64_t e = 0; e < KV_GROUP; e++) x[c + e] = x[c + e] * mul;
    }
}

static inline int kv_rotated(int64_t D) { return D % KV_GROUP == 0; }

/* float32 -> bfloat16, round to nearest even (NaN kept a quiet NaN): integer arithmetic, the same bits on every
 * level. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void kvq_kv_store(const float *src, int64_t T, int64_t src_stride, int64_t KVH, int64_t D, const int64_t *dst_off,
                  int64_t head_stride, void *dst, float *dst_scale, int kv_dtype) {
    if (kv_dtype == KV_BF16) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < KVH; g++) {
                const float *x = src + t * src_stride + g * D;
                uint16_t *q = (uint16_t *)dst + dst_off[t] + g * head_stride;
                for (int64_t i = 0; i < D; i++) q[i] = bf16_round(x[i]);
            }
        return;
    }
    const float top = kv_dtype == KV_INT8 ? 127.0f : 448.0f;
    const int64_t GS = kv_group(D);
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < KVH; g++) {
            float row[kv_rotated(D) ? D : 1];
            const float *src_row = src + t * src_stride + g * D;
            if (kv_rotated(D)) {
                memcpy(row, src_row, sizeof(float) * (size_t)D);
                rotate(row, D, 1.0f);
                src_row = row;
            }
            for (int64_t j = 0; j < D; j += GS) {
                const float *x = src_row + j;
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
}

/* 8 cache values at p as floats (exact: int8 and e4m3 values are all floats). */
static inline __attribute__((always_inline)) vf load8(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return vf_load((const float *)p + i);
    if (DT == KV_BF16) return vf_load_bf16((const uint16_t *)p + i);
    if (DT == KV_INT8) return vf_load_i8((const int8_t *)p + i);
    float t[8];
    for (int l = 0; l < 8; l++) t[l] = fp8_table[((const uint8_t *)p)[i + l]];
    return vf_load(t);
}

static inline __attribute__((always_inline)) float load1(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return ((const float *)p)[i];
    if (DT == KV_BF16) return kvq_bf16(((const uint16_t *)p)[i]);
    if (DT == KV_INT8) return (float)((const int8_t *)p)[i];
    return fp8_table[((const uint8_t *)p)[i]];
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

#if KVQ_LEVEL >= 2
/* ---- the AVX-512 level's 16 lanes for head size 64: two 8-lane vectors side by side, each lane its own IEEE
 * operations, so the results are piece64's general code's, bit for bit ---- */

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
#endif

/* Query tokens of one sequence whose pieces are computed together (each row read once for all; a bfloat16 cache's
 * rows widened once for all). 16 rather than 4: faster long prefills (docs/BENCHMARKS.md). */
#define QTILE 16
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
                const float *qh = q + h * 64;
#if KVQ_LEVEL >= 2
                const __m512 q4[4] = {_mm512_loadu_ps(qh), _mm512_loadu_ps(qh + 16), _mm512_loadu_ps(qh + 32),
                                      _mm512_loadu_ps(qh + 48)};
                __m512 z[8];
                for (int u = 0; u < 8; u++)
                    z[u] = u < m ? dot64_pair(q4, at(kb, offs[i0 + u], DT), DT) : _mm512_setzero_ps();
                const vf r = vf_mul(vf_add(hsum_pairs8(z), vf_zero()), vf_set1(j->scale));
#else
                for (int u = 0; u < m; u++) { /* dot_kv: a0 the even groups of 8, a1 the odd ones */
                    const void *k = at(kb, offs[i0 + u], DT);
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
                const vf r = vf_mul(vf_add(vf_hsum_each8(tmp), vf_zero()), vf_set1(j->scale));
#endif
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
#if KVQ_LEVEL >= 2
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
#else
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
#endif
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

/* ---- 8-bit caches with D a multiple of KV_GROUP: the fast piece ----
 * Keys: int8 rows meet q rounded per group to int16 (like the matmuls' activations), so a group's dot product is
 * exact integer arithmetic (vpmaddwd), times q's and k's group scales; fp8 rows are widened through F16C and
 * multiplied in float, 4 products summed per group, then times the group's scale. Eight positions are reduced
 * at once (one transpose-add instead of eight horizontal sums). Values: int8 rows are accumulated in exact int32
 * with the weights p * v_scale rounded to int16 against the piece's largest (two positions per vpmaddwd); fp8 rows
 * with float FMAs. Each row is widened once for all the query heads that share it. Every step is a fixed
 * sequence per element, the same on every level, and depends on nothing outside the query row's own piece. */
struct p8 {
    int64_t *off;                      /* [CHUNK] element offset of each position's row (padding repeats the last) */
    float *s, *ks, *vs, *w, *qf, *qs, *wsc, *ftmp; /* scores [G][CHUNK], scales [NG][CHUNK], weights [G][NG][CHUNK] */
    int16_t *wq, *qi;
    int32_t *tmp;
};

static size_t p8_layout(int64_t G, int64_t D, char *base, struct p8 *L) {
    const int64_t NG = D / KV_GROUP;
    size_t o = 0;
#define P8_TAKE(field, type, count)                                                                                \
    do {                                                                                                           \
        if (L) L->field = (type *)(base + o);                                                                      \
        o += (sizeof(type) * (size_t)(count) + 63) & ~(size_t)63;                                                  \
    } while (0)
    P8_TAKE(off, int64_t, CHUNK);
    P8_TAKE(s, float, G * CHUNK);
    P8_TAKE(ks, float, NG * CHUNK);
    P8_TAKE(vs, float, NG * CHUNK);
    P8_TAKE(w, float, G * NG * CHUNK);
    P8_TAKE(wq, int16_t, G * NG * CHUNK);
    P8_TAKE(qf, float, G * D);
    P8_TAKE(qi, int16_t, G * D);
    P8_TAKE(qs, float, G * NG);
    P8_TAKE(wsc, float, G * NG);
    P8_TAKE(tmp, int32_t, G * NG * 256); /* [G][NG][16 positions][16 lanes] (8 x 8 below the AVX-512 level) */
    P8_TAKE(ftmp, float, G * 64);
#undef P8_TAKE
    return o;
}

#if KVQ_LEVEL >= 2
/* Lane i of the result: the int32 sum of v[16 i .. 16 i + 15] (a transpose-add; integer sums, so any order gives
 * the same bits as the AVX2 level's eight-lane partial sums). */
static inline __m512i v16i_hsum16x16(const int32_t *v) {
    __m512i t[8], u[4];
    for (int k = 0; k < 8; k++) {
        const __m512i a = _mm512_loadu_si512(v + 32 * k), b = _mm512_loadu_si512(v + 32 * k + 16);
        t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    }
    for (int k = 0; k < 4; k++)
        u[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * k], t[2 * k + 1]),
                                _mm512_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
    /* u[k], 128-bit chunk L, element e: chunk L's partial sum of row 4 k + e */
    const __m512i r01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i r23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(r01, r23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(r01, r23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

static inline __attribute__((always_inline)) void piece8(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0,
                                                         int64_t p1, char *scr, float *part, const int DT,
                                                         const int64_t G) {
    const int64_t D = j->D, NG = D / KV_GROUP, n = p1 - p0, pos = j->tok_pos[t];
    const int64_t npad = (n + 31) & ~(int64_t)31; /* <= CHUNK */
    const int64_t *table = j->tables + j->tok_seq[t] * j->table_stride;
    const float *q = j->q + t * j->q_stride + g * G * D;
    const int64_t hoff = g * j->head_stride;
    struct p8 L;
    p8_layout(G, D, scr, &L);
    { /* the job's fields in locals: the stores to L.off could alias them */
        const int64_t BS = j->BS, bstride = j->block_stride, tstride = j->tok_stride;
        int64_t *off = L.off;
        for (int64_t p = p0, i = 0, bi = p0 / BS, o = p0 % BS; p < p1; p++, i++) {
            off[i] = table[bi] * bstride + o * tstride + hoff;
            if (++o == BS) o = 0, bi++;
        }
        for (int64_t i = n; i < npad; i++) off[i] = off[n - 1];
    }
    const float widen = DT == KV_FP8 ? 256.0f : 1.0f; /* vf_load_e4m3 reads values times 2^-8 */
    {
        const float *ksc = j->k_scale, *vsc = j->v_scale;
        for (int64_t i = 0; i < npad; i++) {
            const int64_t so = L.off[i] / KV_GROUP;
            for (int64_t c = 0; c < NG; c++) {
                L.ks[c * CHUNK + i] = ksc[so + c] * widen;
                L.vs[c * CHUNK + i] = vsc[so + c] * widen;
            }
        }
    }
    for (int64_t h = 0; h < G; h++) { /* q into the cache's rotated space */
        float *r = L.qf + h * D;
        memcpy(r, q + h * D, sizeof(float) * (size_t)D);
        rotate(r, D, 1.0f / KV_GROUP);
        if (DT == KV_INT8)
            for (int64_t c = 0; c < NG; c++) {
                float amax = 0.0f;
                for (int e = 0; e < KV_GROUP; e++) amax = fabsf(r[c * KV_GROUP + e]) > amax ? fabsf(r[c * KV_GROUP + e]) : amax;
                L.qs[h * NG + c] = amax / 32767.0f;
                round_i16_32(r + c * KV_GROUP, amax > 0.0f ? 32767.0f / amax : 0.0f, L.qi + h * D + c * KV_GROUP);
            }
    }

    /* scores, 8 positions at a time (int8 at the AVX-512 level: 16, below) */
#if KVQ_LEVEL >= 2
    if (DT == KV_INT8) { /* a group's 32 products in one vpmaddwd per head; 16 positions' sums by one transpose-add */
        for (int64_t i0 = 0; i0 < n; i0 += 16) { /* i0 + 16 <= npad: padding rows repeat the last */
            for (int64_t jj = 0; jj < 16; jj++) {
                const int64_t i = i0 + jj;
                const int8_t *kr = (const int8_t *)j->k + L.off[i];
                if (i + 16 < npad) __builtin_prefetch((const int8_t *)j->k + L.off[i + 16]);
                for (int64_t c = 0; c < NG; c++) {
                    const __m512i kq = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kr + c * KV_GROUP)));
#pragma GCC unroll 8
                    for (int64_t h = 0; h < G; h++)
                        _mm512_storeu_si512(L.tmp + ((h * NG + c) * 16 + jj) * 16,
                                            _mm512_madd_epi16(kq, _mm512_loadu_si512(L.qi + h * D + c * KV_GROUP)));
                }
            }
            for (int64_t h = 0; h < G; h++) { /* the float operations of the 8-lane code below, lane for lane */
                __m512 d = _mm512_setzero_ps();
                for (int64_t c = 0; c < NG; c++) {
                    const __m512 f = _mm512_cvtepi32_ps(v16i_hsum16x16(L.tmp + (h * NG + c) * 256));
                    const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(L.qs[h * NG + c]), _mm512_loadu_ps(L.ks + c * CHUNK + i0));
                    d = c ? _mm512_fmadd_ps(f, sc, d) : _mm512_mul_ps(f, sc);
                }
                _mm512_storeu_ps(L.s + h * CHUNK + i0, _mm512_mul_ps(d, _mm512_set1_ps(j->scale)));
            }
        }
    } else
#endif
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
        for (int64_t jj = 0; jj < 8; jj++) {
            const int64_t i = i0 + jj;
            const uint8_t *kr = (const uint8_t *)j->k + L.off[i];
            if (i + 8 < npad) __builtin_prefetch((const uint8_t *)j->k + L.off[i + 8]);
            for (int64_t c = 0; c < NG; c++) {
                if (DT == KV_INT8) {
                    const q32 kq = q32_from_q8(kr + c * KV_GROUP);
                    for (int64_t h = 0; h < G; h++)
                        vi_store(L.tmp + ((h * NG + c) * 8 + jj) * 8, q32_dot(kq, L.qi + h * D + c * KV_GROUP));
                } else {
                    const uint8_t *kc = kr + c * KV_GROUP;
                    const vf k0 = vf_load_e4m3(kc), k1 = vf_load_e4m3(kc + 8), k2 = vf_load_e4m3(kc + 16),
                             k3 = vf_load_e4m3(kc + 24), sc = vf_set1(L.ks[c * CHUNK + i]);
                    for (int64_t h = 0; h < G; h++) {
                        const float *qh = L.qf + h * D + c * KV_GROUP;
                        const vf a = vf_fma(vf_load(qh + 8), k1, vf_mul(vf_load(qh), k0));
                        const vf b = vf_fma(vf_load(qh + 24), k3, vf_mul(vf_load(qh + 16), k2));
                        float *acc = L.ftmp + (h * 8 + jj) * 8;
                        vf_store(acc, c ? vf_fma(vf_add(a, b), sc, vf_load(acc)) : vf_mul(vf_add(a, b), sc));
                    }
                }
            }
        }
        for (int64_t h = 0; h < G; h++) {
            vf d = vf_zero();
            if (DT == KV_INT8) {
                for (int64_t c = 0; c < NG; c++) {
                    const vf f = vi_to_vf(vi_hsum8x8(L.tmp + (h * NG + c) * 64));
                    const vf sc = vf_mul(vf_set1(L.qs[h * NG + c]), vf_load(L.ks + c * CHUNK + i0));
                    d = c ? vf_fma(f, sc, d) : vf_mul(f, sc);
                }
            } else {
                d = vf_hsum8x8(L.ftmp + h * 64);
            }
            vf_store(L.s + h * CHUNK + i0, vf_mul(d, vf_set1(j->scale)));
        }
    }

    /* softmax of each head's scores; the weights p * v_scale per group (0 past n) */
    for (int64_t h = 0; h < G; h++) {
        float *sh = L.s + h * CHUNK;
        if (j->slopes) {
            const float slope = j->slopes[g * G + h];
            for (int64_t i = 0; i < n; i++) sh[i] = sh[i] + slope * (float)(p0 + i - pos);
        }
        vf vmx = vf_set1(-INFINITY); /* a maximum is exact: 8 lanes, then the lanes, then the tail */
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) vmx = vf_max(vmx, vf_load(sh + i));
        float mx = vf_hmax(vmx);
        for (; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
        float *ph = part + h * (D + 2);
        ph[0] = mx;
        ph[1] = kvq_exp_shift_sum(sh, n, mx);
        for (int64_t i = n; i < npad; i++) sh[i] = 0.0f;
        for (int64_t c = 0; c < NG; c++) {
            float *w = L.w + (h * NG + c) * CHUNK;
            for (int64_t i = 0; i < npad; i += 8) vf_store(w + i, vf_mul(vf_load(sh + i), vf_load(L.vs + c * CHUNK + i)));
            if (DT == KV_INT8) {
                vf m = vf_zero();
                for (int64_t i = 0; i < npad; i += 8) m = vf_max(m, vf_load(w + i));
                const float wmax = vf_hmax(m);
                L.wsc[h * NG + c] = wmax / 32767.0f;
                for (int64_t i = 0; i < npad; i += KV_GROUP)
                    round_i16_32(w + i, wmax > 0.0f ? 32767.0f / wmax : 0.0f, L.wq + (h * NG + c) * CHUNK + i);
            }
        }
    }

    /* values, 16 dimensions at a time, every head's accumulators in registers (int8 at the AVX-512 level: a group of
     * 32 at a time, below) */
#if KVQ_LEVEL >= 2
    if (DT == KV_INT8) {
        const __m512i nat0 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), nat1 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
        for (int64_t c = 0; c < NG; c++)
            for (int64_t h0 = 0; h0 < G; h0 += 4) { /* up to 4 heads' accumulators, named so they stay in registers */
                const int64_t nh = G - h0 < 4 ? G - h0 : 4;
                /* 128-bit chunk L of lo: dimensions 8 L .. 8 L + 3 of the group; of hi: 8 L + 4 .. 8 L + 7 */
                __m512i lo0 = _mm512_setzero_si512(), lo1 = lo0, lo2 = lo0, lo3 = lo0, hi0 = lo0, hi1 = lo0, hi2 = lo0,
                        hi3 = lo0;
                const int16_t *wq = L.wq + (h0 * NG + c) * CHUNK;
                for (int64_t i = 0; i < n; i += 2) { /* n odd: the last pair's second row has weight 0 */
                    const int8_t *a = (const int8_t *)j->v + L.off[i] + c * KV_GROUP,
                                 *b = (const int8_t *)j->v + L.off[i + 1] + c * KV_GROUP;
                    if (i + 8 < npad) __builtin_prefetch((const int8_t *)j->v + L.off[i + 8] + c * KV_GROUP);
                    const __m512i A = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)a)),
                                  B = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)b));
                    const __m512i x0 = _mm512_unpacklo_epi16(A, B), x1 = _mm512_unpackhi_epi16(A, B);
#define P8_VACC(k, lo, hi)                                                                                         \
    if (nh > k) {                                                                                                  \
        int32_t w;                                                                                                 \
        memcpy(&w, wq + k * NG * CHUNK + i, sizeof w);                                                             \
        const __m512i wv = _mm512_set1_epi32(w);                                                                   \
        lo = _mm512_add_epi32(lo, _mm512_madd_epi16(x0, wv));                                                      \
        hi = _mm512_add_epi32(hi, _mm512_madd_epi16(x1, wv));                                                      \
    }
                    P8_VACC(0, lo0, hi0) P8_VACC(1, lo1, hi1) P8_VACC(2, lo2, hi2) P8_VACC(3, lo3, hi3)
#undef P8_VACC
                }
                const __m512i los[4] = {lo0, lo1, lo2, lo3}, his[4] = {hi0, hi1, hi2, hi3};
                for (int64_t k = 0; k < nh; k++) { /* exact int32 sums, the same as the 8-lane code's; then its product */
                    const int64_t h = h0 + k;
                    const __m512 sc = _mm512_set1_ps(L.wsc[h * NG + c]);
                    float *o = part + h * (D + 2) + 2 + c * KV_GROUP;
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi64(los[k], nat0, his[k])), sc));
                    _mm512_storeu_ps(o + 16,
                                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi64(los[k], nat1, his[k])), sc));
                }
            }
    } else
#endif
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const int64_t c = d0 / KV_GROUP;
        if (DT == KV_INT8) {
            for (int64_t h0 = 0; h0 < G; h0 += 4) { /* up to 4 heads' accumulators, named so they stay in registers */
                const int64_t nh = G - h0 < 4 ? G - h0 : 4;
                vi a00 = vi_zero(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
                const int16_t *wq = L.wq + (h0 * NG + c) * CHUNK;
                for (int64_t i = 0; i < n; i += 2) { /* n odd: the last pair's second row has weight 0 */
                    const int8_t *a = (const int8_t *)j->v + L.off[i] + d0,
                                 *b = (const int8_t *)j->v + L.off[i + 1] + d0;
                    if (i + 8 < npad) __builtin_prefetch((const uint8_t *)j->v + L.off[i + 8] + d0);
                    const vs x0 = vs_pair_i8(a, b), x1 = vs_pair_i8(a + 8, b + 8);
#define P8_VACC8(k, lo, hi)                                                                                        \
    if (nh > k) {                                                                                                  \
        int32_t w;                                                                                                 \
        memcpy(&w, wq + k * NG * CHUNK + i, sizeof w);                                                             \
        lo = vi_add(lo, vs_madd_pair(x0, w));                                                                      \
        hi = vi_add(hi, vs_madd_pair(x1, w));                                                                      \
    }
                    P8_VACC8(0, a00, a01) P8_VACC8(1, a10, a11) P8_VACC8(2, a20, a21) P8_VACC8(3, a30, a31)
#undef P8_VACC8
                }
                const vi los[4] = {a00, a10, a20, a30}, his[4] = {a01, a11, a21, a31};
                for (int64_t k = 0; k < nh; k++) {
                    const vf sc = vf_set1(L.wsc[(h0 + k) * NG + c]);
                    float *o = part + (h0 + k) * (D + 2) + 2 + d0;
                    vf_store(o, vf_mul(vi_to_vf(los[k]), sc));
                    vf_store(o + 8, vf_mul(vi_to_vf(his[k]), sc));
                }
            }
        } else {
            for (int64_t h0 = 0; h0 < G; h0 += 4) { /* up to 4 heads' accumulators, named so they stay in registers */
                const int64_t nh = G - h0 < 4 ? G - h0 : 4;
                vf a00 = vf_zero(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
                const float *wf = L.w + (h0 * NG + c) * CHUNK;
                for (int64_t i = 0; i < n; i++) {
                    const uint8_t *vr = (const uint8_t *)j->v + L.off[i] + d0;
                    if (i + 8 < npad) __builtin_prefetch((const uint8_t *)j->v + L.off[i + 8] + d0);
                    const vf v0 = vf_load_e4m3(vr), v1 = vf_load_e4m3(vr + 8);
#define P8_FACC(k, lo, hi)                                                                                         \
    if (nh > k) {                                                                                                  \
        const vf w = vf_set1(wf[k * NG * CHUNK + i]);                                                              \
        lo = vf_fma(w, v0, lo);                                                                                    \
        hi = vf_fma(w, v1, hi);                                                                                    \
    }
                    P8_FACC(0, a00, a01) P8_FACC(1, a10, a11) P8_FACC(2, a20, a21) P8_FACC(3, a30, a31)
#undef P8_FACC
                }
                const vf los[4] = {a00, a10, a20, a30}, his[4] = {a01, a11, a21, a31};
                for (int64_t k = 0; k < nh; k++) {
                    float *o = part + (h0 + k) * (D + 2) + 2 + d0;
                    vf_store(o, los[k]);
                    vf_store(o + 8, his[k]);
                }
            }
        }
    }
}

/* The fast piece with the head count a constant for the common group sizes (accumulators in registers). */
static void piece8_dt(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0, int64_t p1, char *scr,
                      float *part, const int DT) {
    switch (j->H / j->KVH) {
#define P8_G(n_) case n_: piece8(j, t, g, p0, p1, scr, part, DT, n_); return;
    P8_G(1) P8_G(2) P8_G(3) P8_G(4) P8_G(5) P8_G(6) P8_G(7) P8_G(8)
#undef P8_G
    default: piece8(j, t, g, p0, p1, scr, part, DT, j->H / j->KVH);
    }
}

/* Per-thread scratch of a piece. */
static size_t piece_scratch(const struct kvq_attn *j) {
    const int64_t G = j->H / j->KVH;
    const size_t plain = sizeof(float) * (size_t)(G * CHUNK);
    if (!KV_IS_8BIT(j->kv_dtype) || !kv_rotated(j->D)) return plain;
    const size_t fast = p8_layout(G, j->D, NULL, NULL);
    return fast > plain ? fast : plain;
}

static void piece(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0, int64_t p1, char *s, float *part) {
    if (KV_IS_8BIT(j->kv_dtype) && kv_rotated(j->D))
        piece8_dt(j, t, g, p0, p1, s, part, j->kv_dtype == KV_INT8 ? KV_INT8 : KV_FP8);
    else if (j->kv_dtype == KV_INT8) piece_dt(j, t, g, p0, p1, (float *)s, part, KV_INT8);
    else if (j->kv_dtype == KV_FP8) piece_dt(j, t, g, p0, p1, (float *)s, part, KV_FP8);
    else if (j->kv_dtype == KV_BF16) piece_dt(j, t, g, p0, p1, (float *)s, part, KV_BF16);
    else piece_dt(j, t, g, p0, p1, (float *)s, part, KV_F32);
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

/* merge(), then out of a rotated 8-bit cache's space (see rotate). */
static void merge_out(const struct kvq_attn *j, const float *part, int64_t C, int64_t G, float *out) {
    merge(part, C, G, j->D, out);
    if (KV_IS_8BIT(j->kv_dtype) && kv_rotated(j->D)) rotate(out, j->D, 1.0f / KV_GROUP);
}

static inline int64_t num_pieces(const struct kvq_attn *j, int64_t t) {
    return j->tok_pos[t] / CHUNK - first_pos(j, t) / CHUNK + 1;
}

/* The job's shape and block ids checked (both routes). */
static int attn_check(const struct kvq_attn *jp) {
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
    const int rc = attn_check(&j);
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

/* ---- Prompt rows on AMX bfloat16 tiles (kvq_attention_prompt) ----
 * A prompt token's route is its role, as in the matmuls (qmatmul.c, kvq_matmul_prompt): the runner sends the rows
 * of prompt tokens here and every other row to kvq_attention. Per (sequence, kv head) the keys and values of
 * positions [0, last query position] are rounded to bfloat16 (a bfloat16 cache's already are) and laid out once
 * per call as tile operands: keys as B tiles of S = Q K^T (16 positions, 32 dimensions each), values as B tiles of
 * O = P V (32 positions, 16 dimensions each). Then for a tile of up to 16 consecutive query tokens of a sequence
 * and a query head, piece by piece (the same fixed CHUNK positions counted from 0 as kvq_attention, merged by the
 * same merge()): q rounded to bfloat16, S by tdpbf16ps over 16 positions at a time, per row times the scale (plus
 * ALiBi), its maximum m, p = exp(s - m) rounded to bfloat16 with l the sum of those rounded values (16 lanes,
 * then the lanes in order), and O = P V by tdpbf16ps over 32 positions at a time into four 16 x 16 float tiles.
 * Positions past a row's own (causal) and past the sequence's last query enter with p = 0, which adds exact
 * zeros, so a row's result depends on its own q and its positions' keys and values only: not on the rows beside
 * it in its tile, the chunking of its prompt or the threads. tdpbf16ps rounds as its CPU does, so the bits are
 * that CPU's (as kvq_matmul_prompt's). Head sizes that are multiples of 64 up to 256; no sliding window;
 * float32 and bfloat16 caches. */
#if KVQ_LEVEL >= 2 && defined(__AMX_TILE__)
#define PA_PACK_BYTES (32 << 20) /* the most a call lays out at once (kv heads in groups beyond it) */
#define PA_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))

PA_TARGET static void pa_config(void) {
    struct kvq_tile_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64; /* 0: S, 1: A (q or p), 2-3: B, 4-7: O */
    _tile_loadconfig(&c);
}

/* One (sequence, kv head)'s keys and values as tile operands, positions [0, npos) (npos a multiple of 32; zeros
 * past the last query's position): kt[(k * D / 32 + half) * 512 + 32 r + 2 n + e] = key(16 k + n)[32 half + 2 r + e]
 * and vp[(k * D / 16 + t) * 512 + 32 r + 2 d + e] = value(32 k + 2 r + e)[16 t + d]. */
struct pa_seq {
    int64_t seq, last, npos;
    uint16_t *kt, *vp;
};

/* Positions 32 kb .. 32 kb + 31 of kv head g of sequence ps into ps's tiles; rows: scratch of 64 * D values. */
PA_TARGET static void pa_pack(const struct kvq_attn *j, const struct pa_seq *ps, int64_t g, int64_t kb,
                              uint16_t *rows) {
    const int64_t D = j->D;
    const int64_t *table = j->tables + ps->seq * j->table_stride;
    uint16_t *kr = rows, *vr = rows + 32 * D;
    for (int u = 0; u < 32; u++) {
        const int64_t p = 32 * kb + u;
        if (p > ps->last) {
            memset(kr + u * D, 0, sizeof(uint16_t) * (size_t)D);
            memset(vr + u * D, 0, sizeof(uint16_t) * (size_t)D);
            continue;
        }
        const int64_t off = table[p / j->BS] * j->block_stride + (p % j->BS) * j->tok_stride + g * j->head_stride;
        if (j->kv_dtype == KV_BF16) {
            memcpy(kr + u * D, (const uint16_t *)j->k + off, sizeof(uint16_t) * (size_t)D);
            memcpy(vr + u * D, (const uint16_t *)j->v + off, sizeof(uint16_t) * (size_t)D);
        } else {
            for (int64_t d = 0; d < D; d += 32) {
                const float *k = (const float *)j->k + off + d, *v = (const float *)j->v + off + d;
                _mm512_storeu_si512(kr + u * D + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(k + 16),
                                                                                 _mm512_loadu_ps(k)));
                _mm512_storeu_si512(vr + u * D + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16),
                                                                                 _mm512_loadu_ps(v)));
            }
        }
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int w = 0; w < 2; w++) /* the two 16-position key tiles */
        for (int64_t half = 0; half < D / 32; half++) {
            uint16_t *dst = ps->kt + ((2 * kb + w) * (D / 32) + half) * 512;
            /* dword r of the half of position 16 w + n, for n = 0..15 */
            const __m512i base = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * w)),
                                                                     _mm512_set1_epi32((int)(D / 2))),
                                                  _mm512_set1_epi32((int)(16 * half)));
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(dst + 32 * r,
                                    _mm512_i32gather_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(r)), kr, 4));
        }
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t t = 0; t < D / 16; t++) {
        uint16_t *dst = ps->vp + (kb * (D / 16) + t) * 512;
        for (int r = 0; r < 16; r++) {
            const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vr + 2 * r * D + 16 * t)));
            const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vr + (2 * r + 1) * D + 16 * t)));
            _mm512_storeu_si512(dst + 32 * r, _mm512_permutex2var_epi16(a, idx, b));
        }
    }
}

/* Row i's scores S[i][0:n) (float; times the scale, plus ALiBi) to p = bf16(exp(s - m)) in P[i][0:np) (zeros from
 * n on); returns m and l = the sum of the rounded p. */
PA_TARGET static void pa_softmax_row(float *s, int64_t n, int64_t np, float scale, float slope, int64_t rel0,
                                     uint16_t *p, float *m_out, float *l_out) {
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 k = n - x >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - x)) - 1);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + x), sc);
        if (slope != 0.0f) /* slope * (position - query position), as kvq_attention adds it */
            v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(slope),
                                               _mm512_add_ps(lane, _mm512_set1_ps((float)(rel0 + x)))));
        _mm512_mask_storeu_ps(s + x, k, v);
        mv = _mm512_mask_max_ps(mv, k, v, mv);
    }
    const float mx = _mm512_reduce_max_ps(mv);
    __m512 acc = _mm512_setzero_ps();
    int64_t x = 0;
    for (; x < n; x += 16) {
        const __mmask16 k = n - x >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - x)) - 1);
        const __m512 e = v16_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + x), _mm512_set1_ps(mx)));
        const __m256i b = _mm256_maskz_mov_epi16(k, (__m256i)_mm512_cvtneps_pbh(e));
        _mm256_storeu_si256((__m256i *)(p + x), b);
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    for (; x < np; x += 16) _mm256_storeu_si256((__m256i *)(p + x), _mm256_setzero_si256());
    float lanes[16], l = 0.0f;
    _mm512_storeu_ps(lanes, acc);
    for (int i = 0; i < 16; i++) l = l + lanes[i];
    *m_out = mx, *l_out = l;
}

/* Query tokens t0 .. t0 + n - 1 (one sequence, consecutive positions), kv head g: every piece of every query head
 * of the group into local (token i's pieces at local + i * per_tok), then merged into out. Scratch: S (16 x CHUNK
 * floats), P (16 x CHUNK bfloat16), qb (G x 16 x D bfloat16), O (16 x D floats). */
PA_TARGET static void pa_tile(const struct kvq_attn *j, const struct pa_seq *ps, int64_t t0, int n, int64_t g,
                              float *S, uint16_t *P, uint16_t *qb, float *O, float *local, int64_t per_tok) {
    const int64_t G = j->H / j->KVH, D = j->D;
    for (int64_t h = 0; h < G; h++) {
        uint16_t *qh = qb + h * 16 * D;
        for (int i = 0; i < 16; i++)
            for (int64_t d = 0; d < D; d += 32) {
                __m512i v = _mm512_setzero_si512();
                if (i < n) {
                    const float *q = j->q + (t0 + i) * j->q_stride + (g * G + h) * D + d;
                    v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
                }
                _mm512_storeu_si512(qh + i * D + d, v);
            }
    }
    const int64_t C = num_pieces(j, t0 + n - 1);
    for (int64_t c = 0; c < C; c++) {
        int a = 0; /* tokens whose positions reach piece c: a suffix of the tile */
        while (c >= num_pieces(j, t0 + a)) a++;
        const int64_t p0 = c * CHUNK, P1 = j->tok_pos[t0 + n - 1] + 1 < p0 + CHUNK ? j->tok_pos[t0 + n - 1] + 1
                                                                                  : p0 + CHUNK;
        const int64_t nkt = (P1 - p0 + 15) / 16, npair = (P1 - p0 + 31) / 32;
        for (int i = 0; i < a; i++) memset(P + i * CHUNK, 0, sizeof(uint16_t) * (size_t)(npair * 32));
        for (int64_t h = 0; h < G; h++) {
            const uint16_t *qh = qb + h * 16 * D;
            for (int64_t k = 0; k < nkt; k++) {
                _tile_zero(0);
                for (int64_t half = 0; half < D / 32; half++) {
                    _tile_loadd(1, qh + 32 * half, (int)(D * 2));
                    _tile_loadd(2, ps->kt + ((p0 / 16 + k) * (D / 32) + half) * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, S + 16 * k, CHUNK * 4);
            }
            float mx[QTILE], l[QTILE];
            for (int i = a; i < n; i++) {
                const int64_t pos = j->tok_pos[t0 + i], ni = (pos + 1 < P1 ? pos + 1 : P1) - p0;
                pa_softmax_row(S + i * CHUNK, ni, npair * 32, j->scale, j->slopes ? j->slopes[g * G + h] : 0.0f,
                               p0 - pos, P + i * CHUNK, &mx[i], &l[i]);
            }
            for (int64_t dg = 0; dg < D / 64; dg++) {
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                const uint16_t *vb = ps->vp + ((p0 / 32) * (D / 16) + dg * 4) * 512;
                for (int64_t k = 0; k < npair; k++, vb += (D / 16) * 512) {
                    _tile_loadd(1, P + 32 * k, CHUNK * 2);
                    _tile_loadd(2, vb, 64);
                    _tile_dpbf16ps(4, 1, 2);
                    _tile_loadd(3, vb + 512, 64);
                    _tile_dpbf16ps(5, 1, 3);
                    _tile_loadd(2, vb + 1024, 64);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_loadd(3, vb + 1536, 64);
                    _tile_dpbf16ps(7, 1, 3);
                }
                _tile_stored(4, O + dg * 64, (int)(D * 4));
                _tile_stored(5, O + dg * 64 + 16, (int)(D * 4));
                _tile_stored(6, O + dg * 64 + 32, (int)(D * 4));
                _tile_stored(7, O + dg * 64 + 48, (int)(D * 4));
            }
            for (int i = a; i < n; i++) {
                float *part = local + i * per_tok + c * G * (D + 2) + h * (D + 2);
                part[0] = mx[i], part[1] = l[i];
                memcpy(part + 2, O + i * D, sizeof(float) * (size_t)D);
            }
        }
    }
    for (int i = 0; i < n; i++)
        for (int64_t h = 0; h < G; h++)
            merge(local + i * per_tok + h * (D + 2), num_pieces(j, t0 + i), G, D,
                  j->out + (t0 + i) * j->out_stride + (g * G + h) * D);
}

PA_TARGET int kvq_attention_prompt(const struct kvq_attn *jp) {
    const struct kvq_attn j = *jp;
    if (!kvq_amx_bf16_enable(-1) || j.D % 64 || j.D > 256 || j.window > 0 ||
        (j.kv_dtype != KV_F32 && j.kv_dtype != KV_BF16))
        return KVQ_EBADTYPE;
    const int rc = attn_check(&j);
    if (rc != KVQ_OK || j.T == 0) return rc;
    const int64_t G = j.H / j.KVH, D = j.D;
    /* the sequences, each with its last query position; the tiles of consecutive tokens */
    int64_t *tile0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * j.T + 1));
    struct pa_seq *seqs = (struct pa_seq *)malloc(sizeof(struct pa_seq) * (size_t)j.T);
    if (!tile0 || !seqs) {
        free(tile0), free(seqs);
        return KVQ_ENOMEM;
    }
    int64_t *tile_seq = tile0 + j.T + 1, ntiles = 0, nseq = 0, maxc = 1;
    for (int64_t t = 0; t < j.T; t++) {
        int64_t s = 0;
        while (s < nseq && seqs[s].seq != j.tok_seq[t]) s++;
        if (s == nseq) seqs[nseq++] = (struct pa_seq){j.tok_seq[t], j.tok_pos[t], 0, NULL, NULL};
        if (j.tok_pos[t] > seqs[s].last) seqs[s].last = j.tok_pos[t];
        if (!(ntiles && t - tile0[ntiles - 1] < QTILE && j.tok_seq[t] == j.tok_seq[t - 1] &&
              j.tok_pos[t] == j.tok_pos[t - 1] + 1))
            tile_seq[ntiles] = s, tile0[ntiles++] = t;
        maxc = num_pieces(&j, t) > maxc ? num_pieces(&j, t) : maxc;
    }
    tile0[ntiles] = j.T;
    /* packed operands: per sequence, per kv head, npos * D values of keys and of values; kv heads in groups
     * whose operands fit PA_PACK_BYTES (a long context's copy stays bounded) */
    size_t per_head = 0;
    for (int64_t s = 0; s < nseq; s++) {
        seqs[s].npos = (seqs[s].last + 32) / 32 * 32;
        per_head += sizeof(uint16_t) * (size_t)(seqs[s].npos * D * 2);
    }
    int64_t gh = (int64_t)(PA_PACK_BYTES / per_head);
    gh = gh < 1 ? 1 : gh > j.KVH ? j.KVH : gh;
    uint16_t *packed = (uint16_t *)aligned_alloc(64, (per_head * (size_t)gh + 63) / 64 * 64);
    if (!packed) {
        free(tile0), free(seqs);
        return KVQ_ENOMEM;
    }
    int64_t units = 0; /* pack work: (sequence, 32 positions) */
    for (int64_t s = 0, off = 0; s < nseq; s++) {
        seqs[s].kt = packed + off, seqs[s].vp = packed + off + seqs[s].npos * D * gh;
        off += seqs[s].npos * D * 2 * gh;
        units += seqs[s].npos / 32;
    }
    const int64_t per_tok = maxc * G * (D + 2);
    int status = KVQ_OK;
    for (int64_t g0 = 0; g0 < j.KVH && status == KVQ_OK; g0 += gh) {
        const int64_t ng = j.KVH - g0 < gh ? j.KVH - g0 : gh, items = ntiles * ng;
        int nt = j.nthreads > 0 ? j.nthreads : 1;
        if (nt > items) nt = (int)items;
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            const size_t fl = (size_t)(16 * CHUNK) + (size_t)(16 * D) + (size_t)(QTILE * per_tok);
            const size_t hw = (size_t)(16 * CHUNK) + (size_t)(G * 16 * D) + (size_t)(64 * D);
            char *scr = (char *)aligned_alloc(64, (sizeof(float) * fl + sizeof(uint16_t) * hw + 127) / 64 * 64);
            if (!scr) {
#pragma omp atomic write
                status = KVQ_ENOMEM;
            }
            float *S = (float *)scr, *O = S + 16 * CHUNK, *local = O + 16 * D;
            uint16_t *P = (uint16_t *)(local + QTILE * per_tok), *qb = P + 16 * CHUNK, *rows = qb + G * 16 * D;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units * ng; u++) {
                if (!scr) continue;
                int64_t g = u % ng, kb = u / ng, s = 0;
                while (kb >= seqs[s].npos / 32) kb -= seqs[s++].npos / 32;
                struct pa_seq ps = seqs[s];
                ps.kt += g * ps.npos * D, ps.vp += g * ps.npos * D;
                pa_pack(&j, &ps, g0 + g, kb, rows);
            }
            if (scr) pa_config();
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                if (!scr || status != KVQ_OK) continue;
                const int64_t g = it / ntiles, ti = it % ntiles;
                struct pa_seq ps = seqs[tile_seq[ti]];
                ps.kt += g * ps.npos * D, ps.vp += g * ps.npos * D;
                pa_tile(&j, &ps, tile0[ti], (int)(tile0[ti + 1] - tile0[ti]), g0 + g, S, P, qb, O, local,
                        per_tok);
            }
            if (scr) _tile_release();
            free(scr);
        }
    }
    free(packed), free(tile0), free(seqs);
    return status;
}
#else
int kvq_attention_prompt(const struct kvq_attn *jp) {
    (void)jp;
    return KVQ_EBADTYPE;
}
#endif
