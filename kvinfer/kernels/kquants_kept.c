/* K-quant kept copies (the avx2 and avx512 levels; layout in kquants.h): packing (kvq_amx_tiles_pack hands these
 * types here), readback as GGUF bytes, and the route that multiplies over a copy (kvq_kq_matmul calls kvqi_kc_cols).
 */
#include "kquants.h"

#if KVQ_LEVEL >= 1
int64_t kvq_kq_kept_bytes(int64_t N, int64_t K, int qt) {
    const int sbb = kc_sb_bytes(qt);
    if (!sbb || N <= 0 || K <= 0 || K % QK_K) return 0;
    return (N + KC - 1) / KC * (K / QK_K) * sbb;
}

/* Bytes 4k..4k + 3 (k < nrows) of each column's src + off, as rows of R at dst. */
static void kc_rows(const uint8_t *const *cols, int64_t off, int nrows, uint8_t *dst) {
    for (int k = 0; k < nrows; k++)
        for (int u = 0; u < KC; u++) memcpy(dst + KC_R * k + 4 * u, cols[u] + off + 4 * k, 4);
}

int kvq_kq_kept_pack(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, uint8_t *dst, int nthreads) {
    const int sbb = kc_sb_bytes(qt), bb = kq_block_bytes(qt);
    if (!kvq_kq_kept_bytes(N, K, qt) || (uintptr_t)dst % 64) return KVQ_EBADSHAPE;
    const int64_t nsb = K / QK_K, groups = (N + KC - 1) / KC;
    if (ldw < nsb * bb) return KVQ_EROWBYTES;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int64_t gi = 0; gi < groups; gi++) {
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t *o = dst + (gi * nsb + s) * sbb;
            const uint8_t *b[KC]; /* past N: the last column again (never stored) */
            for (int u = 0; u < KC; u++) b[u] = w + (gi * KC + u < N ? gi * KC + u : N - 1) * ldw + s * bb;
            memset(o, 0, (size_t)sbb);
            if (qt == QT_Q3_K) {
                kc_rows(b, 32, 16, o);              /* qs[0..64): rows 8h + k are bytes 32h + 4k */
                kc_rows(b, 0, 8, o + 16 * KC_R);    /* hmask[0..32) */
                for (int t = 0; t < 16; t++)
                    for (int u = 0; u < KC; u++) o[KC3_SC + KC * t + u] = (uint8_t)(int8_t)kq_q3k_scale(b[u], t);
                for (int u = 0; u < KC; u++) memcpy(o + KC3_D + 2 * u, b[u] + 108, 2);
                continue;
            }
            if (qt == QT_Q6_K) {
                kc_rows(b, 0, 32, o);             /* ql[0..128): rows 16h + 8p + k are bytes 64h + 32p + 4k */
                kc_rows(b, 128, 16, o + 32 * KC_R); /* qh[0..64): rows 8h + k are bytes 32h + 4k */
                for (int t = 0; t < 16; t++)
                    for (int u = 0; u < KC; u++) o[KC6_SC + KC * t + u] = b[u][192 + t];
                for (int u = 0; u < KC; u++) memcpy(o + KC6_D + 2 * u, b[u] + 208, 2);
                continue;
            }
            if (qt == QT_Q2_K) {
                kc_rows(b, 16, 16, o); /* qs[0..64): rows 8h + k are bytes 32h + 4k */
                for (int t = 0; t < 16; t++)
                    for (int u = 0; u < KC; u++) o[KC2_SC + KC * t + u] = b[u][t];
                for (int u = 0; u < KC; u++) /* d, dmin */
                    memcpy(o + KC2_D + 2 * u, b[u] + 80, 2), memcpy(o + KC2_D + 2 * KC + 2 * u, b[u] + 82, 2);
                continue;
            }
            if (qt == QT_IQ4_XS) {
                kc_rows(b, 8, 32, o);
                for (int u = 0; u < KC; u++) {
                    for (int t = 0; t < 8; t++) o[KI_LS + KC * t + u] = (uint8_t)(int8_t)(kq_iq4xs_ls(b[u], t) - 32);
                    memcpy(o + KI_D + 2 * u, b[u], 2);
                }
                continue;
            }
            const int q5 = qt == QT_Q5_K, so = kc_so(qt);
            kc_rows(b, q5 ? 48 : 16, 32, o);
            if (q5) kc_rows(b, 16, 8, o + 32 * KC_R);
            for (int u = 0; u < KC; u++) {
                for (int j = 0; j < 8; j++) {
                    int sc, m;
                    kq_scale_min(b[u] + 4, j, &sc, &m);
                    o[so + KC * j + u] = (uint8_t)sc, o[so + 8 * KC + KC * j + u] = (uint8_t)m;
                }
                memcpy(o + so + 16 * KC + 2 * u, b[u], 2);
                memcpy(o + so + 18 * KC + 2 * u, b[u] + 2, 2);
            }
        }
    }
    return KVQ_OK;
}

/* Rows ids[0..n) of the weight, in GGUF bytes, from its kept copy (out: n rows ldo bytes apart): the layout above
 * read back. Q4_K / Q5_K's scales[12] are packed again from sc_j, m_j; all 96 bits carry them, so the bytes are the
 * file's. */
int kvq_kq_kept_rows(const uint8_t *kept, int64_t N, int64_t K, int qt, const int64_t *ids, int64_t n, uint8_t *out,
                     int64_t ldo) {
    const int sbb = kc_sb_bytes(qt), bb = kq_block_bytes(qt);
    if (!kvq_kq_kept_bytes(N, K, qt)) return KVQ_EBADTYPE;
    const int64_t nsb = K / QK_K, gb = nsb * sbb;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= N) return KVQ_EBADSHAPE;
        const int u = (int)(ids[i] % KC);
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *sb = kept + ids[i] / KC * gb + s * sbb;
            uint8_t *o = out + i * ldo + s * bb;
            if (qt == QT_Q3_K) { /* the 12 scale bytes packed again from sc_j: all 96 bits carry them */
                for (int r = 0; r < 16; r++) memcpy(o + 32 + 4 * r, sb + KC_R * r + 4 * u, 4);
                for (int r = 0; r < 8; r++) memcpy(o + 4 * r, sb + 16 * KC_R + KC_R * r + 4 * u, 4);
                memcpy(o + 108, sb + KC3_D + 2 * u, 2);
                int v[16];
                for (int t = 0; t < 16; t++) v[t] = (int8_t)sb[KC3_SC + KC * t + u] + 32;
                for (int j = 0; j < 8; j++) o[96 + j] = (uint8_t)((v[j] & 15) | ((v[j + 8] & 15) << 4));
                for (int i = 0; i < 4; i++) {
                    int h = 0;
                    for (int q = 0; q < 4; q++) h |= ((v[4 * q + i] >> 4) & 3) << (2 * q);
                    o[104 + i] = (uint8_t)h;
                }
                continue;
            }
            if (qt == QT_Q6_K) {
                for (int r = 0; r < 48; r++) memcpy(o + 4 * r, sb + KC_R * r + 4 * u, 4); /* ql, then qh */
                for (int t = 0; t < 16; t++) o[192 + t] = sb[KC6_SC + KC * t + u];
                memcpy(o + 208, sb + KC6_D + 2 * u, 2);
                continue;
            }
            if (qt == QT_Q2_K) {
                for (int r = 0; r < 16; r++) memcpy(o + 16 + 4 * r, sb + KC_R * r + 4 * u, 4);
                for (int t = 0; t < 16; t++) o[t] = sb[KC2_SC + KC * t + u];
                memcpy(o + 80, sb + KC2_D + 2 * u, 2), memcpy(o + 82, sb + KC2_D + 2 * KC + 2 * u, 2);
                continue;
            }
            if (qt == QT_IQ4_XS) { /* every bit of scales_h / scales_l comes back from ls_j */
                for (int r = 0; r < 32; r++) memcpy(o + 8 + 4 * r, sb + KC_R * r + 4 * u, 4);
                memcpy(o, sb + KI_D + 2 * u, 2);
                int ls[8], h = 0;
                for (int t = 0; t < 8; t++) ls[t] = (int8_t)sb[KI_LS + KC * t + u] + 32, h |= ((ls[t] >> 4) & 3) << (2 * t);
                o[2] = (uint8_t)(h & 0xff), o[3] = (uint8_t)(h >> 8);
                for (int i = 0; i < 4; i++) o[4 + i] = (uint8_t)((ls[2 * i] & 15) | ((ls[2 * i + 1] & 15) << 4));
                continue;
            }
            const int q5 = qt == QT_Q5_K, so = kc_so(qt);
            for (int r = 0; r < 32; r++) memcpy(o + (q5 ? 48 : 16) + 4 * r, sb + KC_R * r + 4 * u, 4);
            if (q5)
                for (int r = 0; r < 8; r++) memcpy(o + 16 + 4 * r, sb + 32 * KC_R + KC_R * r + 4 * u, 4);
            memcpy(o, sb + so + 16 * KC + 2 * u, 2);
            memcpy(o + 2, sb + so + 18 * KC + 2 * u, 2);
            uint8_t sc[8], m[8];
            for (int j = 0; j < 8; j++) sc[j] = sb[so + KC * j + u], m[j] = sb[so + 8 * KC + KC * j + u];
            for (int j = 0; j < 4; j++) {
                o[4 + j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
                o[8 + j] = (uint8_t)((m[j] & 63) | ((m[j + 4] >> 4) << 6));
                o[12 + j] = (uint8_t)((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
            }
        }
    }
    return KVQ_OK;
}


#if KVQ_LEVEL >= 2
typedef __m512i kc_vi;
typedef __m512 kc_vf;
#define kc_loadi(p) _mm512_load_si512((const void *)(p))
#define kc_and _mm512_and_si512
#define kc_or _mm512_or_si512
#define kc_srli16 _mm512_srli_epi16
#define kc_slli16 _mm512_slli_epi16
#define kc_sub8 _mm512_sub_epi8
#define kc_set1_8 _mm512_set1_epi8
#define kc_set1f _mm512_set1_ps
#define kc_set1i _mm512_set1_epi32
#define kc_addi _mm512_add_epi32
#define kc_subi _mm512_sub_epi32
#define kc_slli32 _mm512_slli_epi32
#define kc_cvt _mm512_cvtepi32_ps
#define kc_mul _mm512_mul_ps
#define kc_fma _mm512_fmadd_ps
#define kc_fnma _mm512_fnmadd_ps
#define kc_zerof _mm512_setzero_ps
/* KC fp16 bits as floats; KC unsigned / signed bytes as floats */
#define kc_half(p) _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(p)))
#define kc_u8f(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(p))))
#define kc_i8f(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(p))))
#define kc_u8i(p) _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(p)))
#define kc_srli32 _mm512_srli_epi32
/* 16 bytes at p in every 128-bit lane; bytes of a looked up in such a table, per 128-bit lane (vpshufb) */
#define kc_bcast16(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#define kc_lookup8(tbl, a) _mm512_shuffle_epi8(tbl, a)

/* The 4 bytes at p in every 32-bit lane, broadcast from memory (a load; not through a general register). */
static inline __attribute__((always_inline)) __m512i kc_bcast4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* sum over k in [k0, k0 + n) of the 4 bytes at xb + 4k times W[k], per column (vpdpbusd, two chains): the bytes
 * at xb unsigned and W's signed, or with xs (kc_dot_s) the roles swapped: W's bytes unsigned (quants 0..31), xb's
 * signed. */
static inline __attribute__((always_inline)) kc_vi kc_dotx(const uint8_t *xb, const kc_vi *W, int k0, int n,
                                                           const int xs) {
    __m512i c[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int k = 0; k < n; k++) {
        const __m512i x = kc_bcast4(xb + 4 * (k0 + k));
        c[k & 1] = xs ? _mm512_dpbusd_epi32(c[k & 1], W[k0 + k], x) : _mm512_dpbusd_epi32(c[k & 1], x, W[k0 + k]);
    }
    return _mm512_add_epi32(c[0], c[1]);
}

static inline void kc_store(float *y, kc_vf v, int g) {
    _mm512_mask_storeu_ps(y, g == KC ? (__mmask16)0xffff : (__mmask16)((1u << g) - 1), v);
}
#else
typedef __m256i kc_vi;
typedef __m256 kc_vf;
#define kc_loadi(p) _mm256_load_si256((const __m256i *)(p))
#define kc_and _mm256_and_si256
#define kc_or _mm256_or_si256
#define kc_srli16 _mm256_srli_epi16
#define kc_slli16 _mm256_slli_epi16
#define kc_sub8 _mm256_sub_epi8
#define kc_set1_8 _mm256_set1_epi8
#define kc_set1f _mm256_set1_ps
#define kc_set1i _mm256_set1_epi32
#define kc_addi _mm256_add_epi32
#define kc_subi _mm256_sub_epi32
#define kc_slli32 _mm256_slli_epi32
#define kc_cvt _mm256_cvtepi32_ps
#define kc_mul _mm256_mul_ps
#define kc_fma _mm256_fmadd_ps
#define kc_fnma _mm256_fnmadd_ps
#define kc_zerof _mm256_setzero_ps
#define kc_half(p) _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(p)))
#define kc_u8f(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define kc_i8f(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define kc_u8i(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define kc_srli32 _mm256_srli_epi32
#define kc_bcast16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define kc_lookup8(tbl, a) _mm256_shuffle_epi8(tbl, a)

/* kc_dotx without VNNI: vpmaddubsw gives the int16 sums of two products (|sum| <= 2 * 255 * 32 here; with xs,
 * 2 * 31 * 128), two of them add without overflow, and vpmaddwd with ones widens to the column's int32. */
static inline __attribute__((always_inline)) kc_vi kc_dotx(const uint8_t *xb, const kc_vi *W, int k0, int n,
                                                           const int xs) {
    int32_t a[8];
    memcpy(a, xb + 4 * k0, 4 * (size_t)n);
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (int k = 0; k < n; k += 2) {
        const __m256i x0 = _mm256_set1_epi32(a[k]), x1 = _mm256_set1_epi32(a[k + 1]);
        const __m256i p = xs ? _mm256_add_epi16(_mm256_maddubs_epi16(W[k0 + k], x0),
                                                _mm256_maddubs_epi16(W[k0 + k + 1], x1))
                             : _mm256_add_epi16(_mm256_maddubs_epi16(x0, W[k0 + k]),
                                                _mm256_maddubs_epi16(x1, W[k0 + k + 1]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones16));
    }
    return acc;
}

static inline void kc_store(float *y, kc_vf v, int g) {
    if (g == KC) {
        _mm256_storeu_ps(y, v);
    } else {
        float t[KC];
        _mm256_storeu_ps(t, v);
        for (int u = 0; u < g; u++) y[u] = t[u];
    }
}
#endif

#define kc_dot(xb, W, k0, n) kc_dotx(xb, W, k0, n, 0)
#define kc_dot_s(xb, W, k0, n) kc_dotx(xb, W, k0, n, 1) /* xb signed, W unsigned (kc_signed_hi) */

static const uint8_t kc_ones[32] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

/* MT rows (xu, dx, sx, sx16, c16 at the first) against one group's copy gp; y at the group's first column. */
static inline __attribute__((always_inline)) void kc_tile(const uint8_t *xu, const float *dx, const float *sx,
                                                          const float *sx16, const int32_t *c16, int64_t nb,
                                                          int64_t nsb, const uint8_t *gp, float *y, int64_t ldy,
                                                          int g, const int qt, const int MT) {
    const int sbb = kc_sb_bytes(qt), l8 = kvqi_act8; /* l8: the lo bytes are zero, their products skipped */
    const kc_vi m4 = kc_set1_8(15), m3 = kc_set1_8(3), sixteen = kc_set1_8(16);
    kc_vf acc[KC_MT];
#pragma GCC unroll 16
    for (int r = 0; r < MT; r++) acc[r] = kc_zerof();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = gp + s * sbb;
        for (int o = 0; o < sbb; o += 64) KVQ_PREFETCH(sb + KC_AHEAD * sbb + o);
        kc_vi W[8];
        if (qt == QT_Q6_K || qt == QT_Q3_K) { /* 16-value sub-blocks of signed quants q = u - off, no minimum */
            const int q3 = qt == QT_Q3_K, sc = q3 ? KC3_SC : KC6_SC, lo_u = kc_lo_stored(qt);
            const kc_vf vd = kc_half(sb + (q3 ? KC3_D : KC6_D));
            const kc_vi offset = kc_set1_8((char)kc_off(qt)), m30 = kc_set1_8(0x30), four = kc_set1_8(4);
#pragma GCC unroll 8
            for (int b8 = 0; b8 < 8; b8++) { /* unrolled: every shift below is by a constant */
                const int h = b8 >> 2, t = b8 & 3;
                kc_vi L[8];
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    if (q3) { /* u = 2 bits of qs | the hmask bit << 2 */
                        const kc_vi lo = kc_loadi(sb + KC_R * (8 * h + k));
                        const kc_vi hb = kc_loadi(sb + 16 * KC_R + KC_R * k);
                        const kc_vi hm = b8 <= 2 ? kc_slli16(hb, 2 - b8) : kc_srli16(hb, b8 - 2);
                        W[k] = kc_or(kc_and(t ? kc_srli16(lo, 2 * t) : lo, m3), kc_and(hm, four));
                    } else { /* u = 4 bits of ql | 2 bits of qh << 4 */
                        const kc_vi lo = kc_loadi(sb + KC_R * (16 * h + 8 * (t & 1) + k));
                        const kc_vi hb = kc_loadi(sb + 32 * KC_R + KC_R * (8 * h + k));
                        const kc_vi hm = t < 2 ? kc_slli16(hb, 4 - 2 * t) : t == 2 ? hb : kc_srli16(hb, 2);
                        W[k] = kc_or(kc_and(t >= 2 ? kc_srli16(lo, 4) : lo, m4), kc_and(hm, m30));
                    }
                    L[k] = lo_u ? W[k] : kc_sub8(W[k], offset);
                }
                const kc_vf ds0 = kc_mul(vd, kc_i8f(sb + sc + KC * (2 * b8)));
                const kc_vf ds1 = kc_mul(vd, kc_i8f(sb + sc + KC * (2 * b8 + 1)));
#pragma GCC unroll 8
                for (int r = 0; r < MT; r++) {
                    const uint8_t *xr = xu + (r * nb + s * 8 + b8) * 64; /* hi signed (kc_signed_hi) */
                    const int32_t *c = c16 + r * 2 * nb + s * 16 + 2 * b8;
                    kc_vi D0 = kc_subi(kc_slli32(kc_dot_s(xr, W, 0, 4), 8), kc_set1i(c[0]));
                    kc_vi D1 = kc_subi(kc_slli32(kc_dot_s(xr, W, 4, 4), 8), kc_set1i(c[1]));
                    if (!l8) D0 = kc_addi(D0, kc_dot(xr + 32, L, 0, 4)), D1 = kc_addi(D1, kc_dot(xr + 32, L, 4, 4));
                    const kc_vf vdx = kc_set1f(dx[r * nb + s * 8 + b8]);
                    acc[r] = kc_fma(kc_cvt(D0), kc_mul(ds0, vdx), acc[r]);
                    acc[r] = kc_fma(kc_cvt(D1), kc_mul(ds1, vdx), acc[r]);
                }
            }
            continue;
        }
        if (qt == QT_Q2_K) { /* 16-value sub-blocks of 2-bit quants (unsigned), minus dmin * m_t * (the 16 activations'
                              * exact float sum) */
            const kc_vf vd = kc_half(sb + KC2_D), vmin = kc_half(sb + KC2_D + 2 * KC);
            const kc_vi low4 = kc_set1i(15);
#pragma GCC unroll 8
            for (int b8 = 0; b8 < 8; b8++) { /* unrolled: every shift below is by a constant */
                const int h = b8 >> 2, g4 = b8 & 3;
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    const kc_vi v = kc_loadi(sb + KC_R * (8 * h + k));
                    W[k] = kc_and(g4 ? kc_srli16(v, 2 * g4) : v, m3);
                }
                const kc_vi sm0 = kc_u8i(sb + KC2_SC + KC * (2 * b8)), sm1 = kc_u8i(sb + KC2_SC + KC * (2 * b8 + 1));
                const kc_vf ds0 = kc_mul(vd, kc_cvt(kc_and(sm0, low4))), dm0 = kc_mul(vmin, kc_cvt(kc_srli32(sm0, 4)));
                const kc_vf ds1 = kc_mul(vd, kc_cvt(kc_and(sm1, low4))), dm1 = kc_mul(vmin, kc_cvt(kc_srli32(sm1, 4)));
#pragma GCC unroll 8
                for (int r = 0; r < MT; r++) {
                    const uint8_t *xr = xu + (r * nb + s * 8 + b8) * 64; /* hi signed (kc_signed_hi) */
                    const float *x16 = sx16 + r * 2 * nb + s * 16 + 2 * b8;
                    kc_vi D0 = kc_slli32(kc_dot_s(xr, W, 0, 4), 8), D1 = kc_slli32(kc_dot_s(xr, W, 4, 4), 8);
                    if (!l8) D0 = kc_addi(D0, kc_dot(xr + 32, W, 0, 4)), D1 = kc_addi(D1, kc_dot(xr + 32, W, 4, 4));
                    const kc_vf vdx = kc_set1f(dx[r * nb + s * 8 + b8]);
                    acc[r] = kc_fma(kc_cvt(D0), kc_mul(ds0, vdx), acc[r]);
                    acc[r] = kc_fnma(dm0, kc_set1f(x16[0]), acc[r]);
                    acc[r] = kc_fma(kc_cvt(D1), kc_mul(ds1, vdx), acc[r]);
                    acc[r] = kc_fnma(dm1, kc_set1f(x16[1]), acc[r]);
                }
            }
            continue;
        }
        if (qt == QT_IQ4_XS) { /* the nibbles looked up in the table (vpshufb per 128-bit lane), then as Q4_K; only
                                 * reached at the avx512 level, the one that keeps IQ4_XS (types.h) */
            const kc_vf vd = kc_half(sb + KI_D);
            const kc_vi tbl = kc_bcast16(KQ_IQ4NL);
            for (int j = 0; j < 8; j++) {
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const kc_vi v = kc_loadi(sb + KC_R * (4 * j + k));
                    W[k] = kc_lookup8(tbl, kc_and(v, m4));
                    W[k + 4] = kc_lookup8(tbl, kc_and(kc_srli16(v, 4), m4));
                }
                const kc_vi s15 = kc_slli32(kc_dot(kc_ones, W, 0, 8), 15);
                const kc_vf vds = kc_mul(vd, kc_i8f(sb + KI_LS + KC * j));
#pragma GCC unroll 8
                for (int r = 0; r < MT; r++) {
                    const uint8_t *xr = xu + (r * nb + s * 8 + j) * 64;
                    kc_vi D = kc_subi(kc_slli32(kc_dot(xr, W, 0, 8), 8), s15);
                    if (!l8) D = kc_addi(D, kc_dot(xr + 32, W, 0, 8));
                    acc[r] = kc_fma(kc_cvt(D), kc_mul(vds, kc_set1f(dx[r * nb + s * 8 + j])), acc[r]);
                }
            }
            continue;
        }
        const int so = kc_so(qt);
        const kc_vf vd = kc_half(sb + so + 16 * KC), vmin = kc_half(sb + so + 18 * KC);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) { /* unrolled: every shift below is by a constant */
            const int c = j >> 1;
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const kc_vi lo = kc_loadi(sb + KC_R * (8 * c + k));
                W[k] = kc_and(j & 1 ? kc_srli16(lo, 4) : lo, m4);
                if (qt == QT_Q5_K) { /* bit j of the high-bit byte, moved to bit 4 */
                    const kc_vi hb = kc_loadi(sb + 32 * KC_R + KC_R * k);
                    W[k] = kc_or(W[k], kc_and(j <= 4 ? kc_slli16(hb, 4 - j) : kc_srli16(hb, j - 4), sixteen));
                }
            }
            const kc_vf vds = kc_mul(vd, kc_u8f(sb + so + KC * j));
            const kc_vf vdm = kc_mul(vmin, kc_u8f(sb + so + 8 * KC + KC * j));
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                const uint8_t *xr = xu + (r * nb + s * 8 + j) * 64; /* hi signed here (kc_signed_hi) */
                kc_vi D = kc_slli32(kc_dot_s(xr, W, 0, 8), 8);
                if (!l8) D = kc_addi(D, kc_dot(xr + 32, W, 0, 8));
                acc[r] = kc_fma(kc_cvt(D), kc_mul(vds, kc_set1f(dx[r * nb + s * 8 + j])), acc[r]);
                acc[r] = kc_fnma(vdm, kc_set1f(sx[r * nb + s * 8 + j]), acc[r]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MT; r++) kc_store(y + r * ldy, acc[r], g);
}

typedef void (*kc_any)(const uint8_t *, const float *, const float *, const float *, const int32_t *, int64_t,
                       int64_t, const uint8_t *, float *, int64_t, int, int);
#define KC_TILE(MT)                                                                                   \
    static void kc_tile##MT(const uint8_t *xu, const float *dx, const float *sx, const float *sx16,   \
                            const int32_t *c16, int64_t nb, int64_t nsb, const uint8_t *gp, float *y, \
                            int64_t ldy, int g, int qt) {                                             \
        if (qt == QT_Q4_K) kc_tile(xu, dx, sx, sx16, c16, nb, nsb, gp, y, ldy, g, QT_Q4_K, MT);       \
        else if (qt == QT_Q5_K) kc_tile(xu, dx, sx, sx16, c16, nb, nsb, gp, y, ldy, g, QT_Q5_K, MT);  \
        else if (qt == QT_Q6_K) kc_tile(xu, dx, sx, sx16, c16, nb, nsb, gp, y, ldy, g, QT_Q6_K, MT);  \
        else if (qt == QT_Q3_K) kc_tile(xu, dx, sx, sx16, c16, nb, nsb, gp, y, ldy, g, QT_Q3_K, MT);  \
        else if (qt == QT_Q2_K) kc_tile(xu, dx, sx, sx16, c16, nb, nsb, gp, y, ldy, g, QT_Q2_K, MT);  \
        else kc_tile(xu, dx, sx, sx16, c16, nb, nsb, gp, y, ldy, g, QT_IQ4_XS, MT);                   \
    }
KC_TILE(1)
KC_TILE(2)
#if KVQ_LEVEL >= 2
KC_TILE(3)
KC_TILE(4)
KC_TILE(5)
KC_TILE(6)
KC_TILE(7)
KC_TILE(8)
KC_TILE(9)
KC_TILE(10)
KC_TILE(11)
KC_TILE(12)
KC_TILE(13)
KC_TILE(14)
KC_TILE(15)
KC_TILE(16)
static const kc_any kc_tiles[KC_MT + 1] = {NULL, kc_tile1, kc_tile2, kc_tile3, kc_tile4, kc_tile5, kc_tile6,
                                           kc_tile7, kc_tile8, kc_tile9, kc_tile10, kc_tile11, kc_tile12,
                                           kc_tile13, kc_tile14, kc_tile15, kc_tile16};
#else
KC_TILE(3)
KC_TILE(4)
static const kc_any kc_tiles[KC_MT + 1] = {NULL, kc_tile1, kc_tile2, kc_tile3, kc_tile4};
#endif

/* Columns n0..n1 (n0 a multiple of KC) of every row from the kept copy, a pass of rows at a time; then the bias, one
 * add. */
void kvqi_kc_cols(const struct kq_job *j, const uint8_t *xu, const uint8_t *kept, int64_t n0, int64_t n1) {
    const int64_t nsb = j->K / QK_K, nb = j->K / 32, gb = nsb * kc_sb_bytes(j->qt);
    int64_t pass = KVQ_PASS_BYTES / (2 * j->K) / KC_MT * KC_MT;
    if (pass < KC_MT) pass = KC_MT;
    for (int64_t r0 = 0; r0 < j->M; r0 += pass) {
        const int64_t r1 = j->M - r0 < pass ? j->M : r0 + pass;
        for (int64_t n = n0; n < n1; n += KC) {
            const int g = n1 - n < KC ? (int)(n1 - n) : KC;
            for (int64_t r = r0; r < r1; r += KC_MT) {
                const int h = r1 - r < KC_MT ? (int)(r1 - r) : KC_MT;
                kc_tiles[h](xu + r * nb * 64, j->dx + r * nb, j->sx + r * nb, j->sx16 ? j->sx16 + r * 2 * nb : NULL,
                            j->c16 ? j->c16 + r * 2 * nb : NULL, nb, nsb, kept + n / KC * gb, j->y + r * j->ldy + n,
                            j->ldy, g, j->qt);
            }
        }
    }
    if (j->bias)
        for (int64_t r = 0; r < j->M; r++)
            for (int64_t n = n0; n < n1; n++) j->y[r * j->ldy + n] = j->y[r * j->ldy + n] + j->bias[n];
}
#else
void kvqi_kc_cols(const struct kq_job *j, const uint8_t *xu, const uint8_t *kept, int64_t n0, int64_t n1) {
    (void)j, (void)xu, (void)kept, (void)n0, (void)n1;
}

int kvq_kq_kept_rows(const uint8_t *kept, int64_t N, int64_t K, int qt, const int64_t *ids, int64_t n, uint8_t *out,
                     int64_t ldo) {
    (void)kept, (void)N, (void)K, (void)qt, (void)ids, (void)n, (void)out, (void)ldo;
    return KVQ_EBADTYPE;
}
int64_t kvq_kq_kept_bytes(int64_t N, int64_t K, int qt) {
    (void)N, (void)K, (void)qt;
    return 0;
}
int kvq_kq_kept_pack(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, uint8_t *dst, int nthreads) {
    (void)w, (void)N, (void)K, (void)ldw, (void)qt, (void)dst, (void)nthreads;
    return KVQ_EBADTYPE;
}
#endif

/* Run u of runs: whole groups of the columns (kvq_kq_matmul hands them to its threads). */
void kvqi_kc_run(const struct kq_job *j, const uint8_t *xu, const uint8_t *kept, int64_t u, int64_t runs,
                 int64_t groups) {
    const int64_t e = groups * (u + 1) / runs * KC;
    kvqi_kc_cols(j, xu, kept, groups * u / runs * KC, e < j->N ? e : j->N);
}
