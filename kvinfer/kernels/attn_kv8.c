/* The 8-bit caches' fast piece (attn.c's piece() hands it the pieces of an int8 or fp8 cache whose head size is a
 * multiple of KV_GROUP). */
#include "attn.h"

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

#define P8_WIDE_INT8 1 /* int8 scores and values by scores16_int8 and values32_int8 */

/* The int8 scores, 16 positions at a time: a group's 32 products in one vpmaddwd per head, 16 positions' sums by
 * one transpose-add; then the float operations of scores8, lane for lane. */
static inline __attribute__((always_inline)) void scores16_int8(const struct kvq_attn *j, const struct p8 L,
                                                                int64_t n, int64_t npad, int64_t D,
                                                                const int64_t G, float *part, const int DT) {
    (void)part, (void)DT;
    const int64_t NG = D / KV_GROUP;
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
        for (int64_t h = 0; h < G; h++) { /* the float operations of scores8, lane for lane */
            __m512 d = _mm512_setzero_ps();
            for (int64_t c = 0; c < NG; c++) {
                const __m512 f = _mm512_cvtepi32_ps(v16i_hsum16x16(L.tmp + (h * NG + c) * 256));
                const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(L.qs[h * NG + c]), _mm512_loadu_ps(L.ks + c * CHUNK + i0));
                d = c ? _mm512_fmadd_ps(f, sc, d) : _mm512_mul_ps(f, sc);
            }
            _mm512_storeu_ps(L.s + h * CHUNK + i0, _mm512_mul_ps(d, _mm512_set1_ps(j->scale)));
        }
    }
}

/* The int8 values, a group of 32 dimensions at a time, up to 4 heads' accumulators named so they stay in
 * registers: the same exact int32 sums as values16's, then its product. */
static inline __attribute__((always_inline)) void values32_int8(const struct kvq_attn *j, const struct p8 L,
                                                                int64_t n, int64_t npad, int64_t D,
                                                                const int64_t G, float *part, const int DT) {
    (void)DT;
    const int64_t NG = D / KV_GROUP;
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
            for (int64_t k = 0; k < nh; k++) { /* exact int32 sums, the same as values16's; then its product */
                const int64_t h = h0 + k;
                const __m512 sc = _mm512_set1_ps(L.wsc[h * NG + c]);
                float *o = part + h * (D + 2) + 2 + c * KV_GROUP;
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi64(los[k], nat0, his[k])), sc));
                _mm512_storeu_ps(o + 16,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi64(los[k], nat1, his[k])), sc));
            }
        }
}
#else
#define P8_WIDE_INT8 0 /* (the two below are never called at this level) */
static inline __attribute__((always_inline)) void scores16_int8(const struct kvq_attn *j, const struct p8 L,
                                                                int64_t n, int64_t npad, int64_t D,
                                                                const int64_t G, float *part, const int DT) {
    (void)j, (void)L, (void)n, (void)npad, (void)part, (void)DT, (void)G, (void)D;
}

static inline __attribute__((always_inline)) void values32_int8(const struct kvq_attn *j, const struct p8 L,
                                                                int64_t n, int64_t npad, int64_t D,
                                                                const int64_t G, float *part, const int DT) {
    (void)j, (void)L, (void)n, (void)npad, (void)part, (void)DT, (void)G, (void)D;
}
#endif

/* The scores, 8 positions at a time (one transpose-add instead of eight horizontal sums): int8 rows in exact int16
 * dot products, fp8 rows widened and multiplied in float. */
static inline __attribute__((always_inline)) void scores8(const struct kvq_attn *j, const struct p8 L,
                                                          int64_t n, int64_t npad, int64_t D,
                                                          const int64_t G, float *part, const int DT) {
    (void)part;
    const int64_t NG = D / KV_GROUP;
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
}

/* The values, 16 dimensions at a time, every head's accumulators in registers (up to 4 heads at a time). */
static inline __attribute__((always_inline)) void values16(const struct kvq_attn *j, const struct p8 L,
                                                           int64_t n, int64_t npad, int64_t D,
                                                           const int64_t G, float *part, const int DT) {
    const int64_t NG = D / KV_GROUP;
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

    /* scores (int8 at the AVX-512 level: 16 positions at a time), then softmax, then values */
    if (P8_WIDE_INT8 && DT == KV_INT8) scores16_int8(j, L, n, npad, D, G, part, DT);
    else scores8(j, L, n, npad, D, G, part, DT);

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

    if (P8_WIDE_INT8 && DT == KV_INT8) values32_int8(j, L, n, npad, D, G, part, DT);
    else values16(j, L, n, npad, D, G, part, DT);
}

/* The fast piece with the head count a constant for the common group sizes (accumulators in registers). */
void kvqi_piece8(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0, int64_t p1, char *scr, float *part,
                 int DT) {
    switch (j->H / j->KVH) {
#define P8_G(n_) case n_: piece8(j, t, g, p0, p1, scr, part, DT, n_); return;
    P8_G(1) P8_G(2) P8_G(3) P8_G(4) P8_G(5) P8_G(6) P8_G(7) P8_G(8)
#undef P8_G
    default: piece8(j, t, g, p0, p1, scr, part, DT, j->H / j->KVH);
    }
}

size_t kvqi_piece8_scratch(int64_t G, int64_t D) { return p8_layout(G, D, NULL, NULL); }
