/* Matmul and embedding rows over GGML K-quant super-blocks (Q4_K, Q5_K, Q6_K; layouts in ggml_blocks.h), read as
 * stored. kvq_matmul / kvq_embed_rows (qmatmul.c) hand these types here.
 *
 * The activations are rounded as for the 32-weight types (qmatmul.c's quantize_rows: int16 per block of 32, scale
 * dx, exact float sum sx), so a sub-block's dot product with its quants is an exact int32 D_j. The arithmetic of
 * y[r, n], the same whatever M, the thread count or the ISA level (every float step one IEEE operation, lane =
 * output column):
 *   acc = 0; for each super-block, for each sub-block j in order (b: the 32-activation block it lies in):
 *     acc = fma(float(D_j), (d * sc_j) * dx_b, acc)
 *     acc = acc - (dmin * m_j) * sx_b, one rounding (fnma)    Q4_K / Q5_K only
 *   y = acc (+ bias[n], one add).
 * A super-block of 8 output columns is unpacked once to int16 quants and exact float scales, then every row of
 * the call reads it; a row's accumulators live in memory between super-blocks, so the row count never changes a
 * row's operations. No AMX route: these types run on the vector route on every CPU.
 */
#include "ggml_blocks.h"
#include "kernels.h"
#include "simd.h"

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define KG 8 /* output columns per group: one 8-lane vector */
#define KQ_MIN_BYTES_PER_THREAD (16 * 1024)

/* Lane l: q[2l] x[2l] + q[2l + 1] x[2l + 1] (exact). */
static inline vi dot16(const int16_t *q, const int16_t *x) {
#if KVQ_LEVEL >= 1
    return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)q), _mm256_loadu_si256((const __m256i *)x));
#else
    vi r;
    for (int l = 0; l < 8; l++) r.v[l] = (int32_t)q[2 * l] * x[2 * l] + (int32_t)q[2 * l + 1] * x[2 * l + 1];
    return r;
#endif
}

#if KVQ_LEVEL >= 1
static inline __m256i u8x16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline void st16(int16_t *q, __m256i v) { _mm256_storeu_si256((__m256i *)q, v); }

/* kq_unpack's quants, 16 at a time (integers: the same values). */
static inline __attribute__((always_inline)) void kq_unpack_q(const uint8_t *blk, const int qt, int16_t *q) {
    const __m256i m15 = _mm256_set1_epi16(15), m3 = _mm256_set1_epi16(3);
    if (qt == QT_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const __m256i o = _mm256_set1_epi16(32);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, q += 128)
            for (int i = 0; i < 32; i += 16) {
                const __m256i a = u8x16(ql + i), b = u8x16(ql + 32 + i), hb = u8x16(qh + i);
                st16(q + i, _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(a, m15),
                                                             _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4)), o));
                st16(q + 32 + i, _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(b, m15),
                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4)), o));
                st16(q + 64 + i, _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(a, 4),
                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4)), o));
                st16(q + 96 + i, _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(b, 4),
                     _mm256_slli_epi16(_mm256_srli_epi16(hb, 6), 4)), o));
            }
        return;
    }
    const uint8_t *qh = blk + 16, *qs = blk + (qt == QT_Q5_K ? 48 : 16);
    const __m256i one = _mm256_set1_epi16(1);
    for (int c = 0; c < 4; c++, qs += 32, q += 64)
        for (int i = 0; i < 32; i += 16) {
            const __m256i v = u8x16(qs + i);
            __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_srli_epi16(v, 4);
            if (qt == QT_Q5_K) {
                const __m256i hb = u8x16(qh + i);
                lo = _mm256_add_epi16(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
                hi = _mm256_add_epi16(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
            }
            st16(q + i, lo);
            st16(q + 32 + i, hi);
        }
}

/* Lane t of column u's vector c[u] to out[t][u] (an 8 x 8 transpose: moves only). */
static inline void tr8(const __m256 *c, float out[][KG]) {
    __m256 t[8], v[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(c[i], c[i + 1]), t[i + 1] = _mm256_unpackhi_ps(c[i], c[i + 1]);
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            v[i + 2 * h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0x44);
            v[i + 2 * h + 1] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0xee);
        }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(out[i], _mm256_permute2f128_ps(v[i], v[i + 4], 0x20));
        _mm256_storeu_ps(out[i + 4], _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
    }
}

static inline __m256 f8_of_u8(uint64_t b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)b))); }
static inline __m256 f8_of_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The scales of 8 columns' super-blocks (rows[u] + off), t-major: ds[t][u] = d * sc_t, dm[t][u] = dmin * m_t, the
 * same exact products as kq_unpack. Q4_K / Q5_K's 12 bytes unpack with whole-word masks: bytes 0-7 of the result
 * are sc_0..7, bytes 8-15 m_0..7. */
static inline __attribute__((always_inline)) void kq_scales8(const uint8_t *const *rows, int64_t off, const int qt,
                                                             float ds[][KG], float dm[][KG]) {
    __m256 c[KG], e[KG];
    if (qt == QT_Q6_K) {
        for (int u = 0; u < KG; u++) {
            const uint8_t *b = rows[u] + off;
            c[u] = _mm256_mul_ps(_mm256_set1_ps(kvq_half(kvq_rd16(b + 208))), f8_of_i8((const int8_t *)b + 192));
            e[u] = _mm256_mul_ps(_mm256_set1_ps(kvq_half(kvq_rd16(b + 208))), f8_of_i8((const int8_t *)b + 200));
        }
        tr8(c, ds);
        tr8(e, ds + 8);
        return;
    }
    for (int u = 0; u < KG; u++) {
        const uint8_t *b = rows[u] + off;
        uint32_t w[3];
        memcpy(w, b + 4, 12);
        const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
        const uint64_t sc = (uint64_t)(w[0] & k1) | (uint64_t)((w[2] & k2) | (((w[0] >> 6) & k3) << 4)) << 32;
        const uint64_t mn = (uint64_t)(w[1] & k1) | (uint64_t)(((w[2] >> 4) & k2) | (((w[1] >> 6) & k3) << 4)) << 32;
        c[u] = _mm256_mul_ps(_mm256_set1_ps(kvq_half(kvq_rd16(b))), f8_of_u8(sc));
        e[u] = _mm256_mul_ps(_mm256_set1_ps(kvq_half(kvq_rd16(b + 2))), f8_of_u8(mn));
    }
    tr8(c, ds);
    tr8(e, dm);
}

#endif

/* One super-block: q[256] the quants as int16 (Q6_K: minus 32), ds[j] = d * sc_j, dm[j] = dmin * m_j (exact). */
static void kq_unpack(const uint8_t *blk, int qt, int16_t *q, float *ds, float *dm) {
    if (qt == QT_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = kvq_half(kvq_rd16(blk + 208));
        for (int j = 0; j < 16; j++) ds[j] = d * (float)sc[j];
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, q += 128)
            for (int l = 0; l < 32; l++) {
                q[l] = (int16_t)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                q[l + 32] = (int16_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                q[l + 64] = (int16_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                q[l + 96] = (int16_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        return;
    }
    const float d = kvq_half(kvq_rd16(blk)), dmin = kvq_half(kvq_rd16(blk + 2));
    for (int j = 0; j < 8; j++) {
        int sc, m;
        kq_scale_min(blk + 4, j, &sc, &m);
        ds[j] = d * (float)sc, dm[j] = dmin * (float)m;
    }
    const uint8_t *qh = blk + 16, *qs = blk + (qt == QT_Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++, qs += 32, q += 64)
        for (int l = 0; l < 32; l++) {
            q[l] = (int16_t)(qs[l] & 15);
            q[l + 32] = (int16_t)(qs[l] >> 4);
            if (qt == QT_Q5_K) {
                q[l] = (int16_t)(q[l] + (((qh[l] >> (2 * c)) & 1) << 4));
                q[l + 32] = (int16_t)(q[l + 32] + (((qh[l] >> (2 * c + 1)) & 1) << 4));
            }
        }
}

struct kq_job {
    const int16_t *xq;
    const float *dx, *sx, *bias;
    const uint8_t *w;
    float *y;
    int64_t M, K, N, ldw, ldy;
    int qt;
};

/* Columns n0..n1 (whole groups of KG but the last) for every row; acc [M * KG], q [KG * 256] scratch. */
static inline __attribute__((always_inline)) void kq_cols(const struct kq_job *j, int64_t n0, int64_t n1,
                                                           float *acc, int16_t *q, const int qt) {
    const int bb = kq_block_bytes(qt);
    const int64_t nsb = j->K / QK_K, nb = j->K / 32, M = j->M;
    for (int64_t n = n0; n < n1; n += KG) {
        const int g = n1 - n < KG ? (int)(n1 - n) : KG;
        const uint8_t *rows[KG];
        for (int u = 0; u < KG; u++) rows[u] = j->w + (n + (u < g ? u : g - 1)) * j->ldw;
        for (int64_t i = 0; i < M * KG; i++) acc[i] = 0.0f;
        for (int64_t s = 0; s < nsb; s++) {
            float ds[16][KG], dm[8][KG];
#if KVQ_LEVEL >= 1
            for (int u = 0; u < KG; u++) kq_unpack_q(rows[u] + s * bb, qt, q + u * QK_K);
            kq_scales8(rows, s * bb, qt, ds, dm);
#else
            for (int u = 0; u < KG; u++) {
                float dsu[16], dmu[8];
                kq_unpack(rows[u] + s * bb, qt, q + u * QK_K, dsu, dmu);
                for (int t = 0; t < (qt == QT_Q6_K ? 16 : 8); t++) ds[t][u] = dsu[t];
                if (qt != QT_Q6_K)
                    for (int t = 0; t < 8; t++) dm[t][u] = dmu[t];
            }
#endif
            for (int64_t r = 0; r < M; r++) {
                const int16_t *xr = j->xq + r * j->K + s * QK_K;
                const float *dxr = j->dx + r * nb + s * 8, *sxr = j->sx + r * nb + s * 8;
                vf a = vf_load(acc + r * KG);
                if (qt == QT_Q6_K) {
                    for (int t = 0; t < 16; t++) {
                        vi p[KG];
                        for (int u = 0; u < KG; u++) p[u] = dot16(q + u * QK_K + 16 * t, xr + 16 * t);
                        a = vf_fma(vi_to_vf(vi_sum8(p)), vf_mul(vf_load(ds[t]), vf_set1(dxr[t / 2])), a);
                    }
                } else {
                    for (int t = 0; t < 8; t++) {
                        vi p[KG];
                        for (int u = 0; u < KG; u++) {
                            const int16_t *qu = q + u * QK_K + 32 * t;
                            p[u] = vi_add(dot16(qu, xr + 32 * t), dot16(qu + 16, xr + 32 * t + 16));
                        }
                        a = vf_fma(vi_to_vf(vi_sum8(p)), vf_mul(vf_load(ds[t]), vf_set1(dxr[t])), a);
                        a = vf_fnma(vf_load(dm[t]), vf_set1(sxr[t]), a);
                    }
                }
                vf_store(acc + r * KG, a);
            }
        }
        for (int64_t r = 0; r < M; r++)
            for (int u = 0; u < g; u++)
                j->y[r * j->ldy + n + u] = j->bias ? acc[r * KG + u] + j->bias[n + u] : acc[r * KG + u];
    }
}

static int kq_run(const struct kq_job *j, int64_t n0, int64_t n1) {
    float *acc = (float *)malloc(sizeof(float) * (size_t)(j->M * KG));
    int16_t *q = (int16_t *)malloc(sizeof(int16_t) * KG * QK_K);
    if (!acc || !q) {
        free(acc), free(q);
        return KVQ_ENOMEM;
    }
    if (j->qt == QT_Q4_K) kq_cols(j, n0, n1, acc, q, QT_Q4_K);
    else if (j->qt == QT_Q5_K) kq_cols(j, n0, n1, acc, q, QT_Q5_K);
    else kq_cols(j, n0, n1, acc, q, QT_Q6_K);
    free(acc), free(q);
    return KVQ_OK;
}

#if KVQ_LEVEL >= 2
#define KC 16 /* output columns per kept group (below) */
static void kc_cols(const struct kq_job *j, const uint8_t *xu, const uint8_t *kept, int64_t n0, int64_t n1);
#endif

int kvq_kq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw,
                  int qt, const float *bias, float *y, int64_t ldy, int nthreads) {
    const int bb = kq_block_bytes(qt);
    if (!bb) return KVQ_EBADTYPE;
    if (M < 0 || N < 0 || K <= 0 || K % QK_K || ldx < K || ldy < N) return KVQ_EBADSHAPE;
    if (ldw < K / QK_K * bb) return KVQ_EROWBYTES;
    if (M == 0 || N == 0) return KVQ_OK;
    const int64_t nb = K / 32;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * nb)), *sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    if (!xq || !dx || !sx) {
        free(xq), free(dx), free(sx);
        return KVQ_ENOMEM;
    }
    kvq_quantize_rows(x, M, K, ldx, xq, dx, sx);
    const struct kq_job j = {xq, dx, sx, bias, w, y, M, K, N, ldw, ldy, qt};
    int nt = nthreads > 0 ? nthreads : kvq_max_threads();
    int64_t cols = KG;
    uint8_t *xu = NULL;
#if KVQ_LEVEL >= 2
    const uint8_t *kept = kvq_kept_lookup(w, N, K, ldw, qt);
    if (kept) {
        xu = (uint8_t *)malloc((size_t)(M * K * 2));
        if (!xu) {
            free(xq), free(dx), free(sx);
            return KVQ_ENOMEM;
        }
        kvq_split_bytes(xq, M, K, xu);
        cols = KC;
    }
#endif
    const int64_t work = N * (K / QK_K * bb) * (M < 8 ? 1 : M / 8), groups = (N + cols - 1) / cols;
    if ((int64_t)nt > work / KQ_MIN_BYTES_PER_THREAD) nt = (int)(work / KQ_MIN_BYTES_PER_THREAD);
    if (nt > groups) nt = (int)groups;
    if (nt < 1) nt = 1;
    int rc = KVQ_OK;
    if (xu) {
#if KVQ_LEVEL >= 2
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            int tid = 0, nth = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            const int64_t e = groups * (tid + 1) / nth * KC;
            kc_cols(&j, xu, kept, groups * tid / nth * KC, e < N ? e : N); /* whole groups each */
        }
#endif
    } else if (nt == 1) {
        rc = kq_run(&j, 0, N);
    } else {
#pragma omp parallel num_threads(nt)
        {
            int tid = 0, nth = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            const int64_t e = groups * (tid + 1) / nth * KG;
            const int r = kq_run(&j, groups * tid / nth * KG, e < N ? e : N); /* whole groups each */
            if (r) {
#pragma omp atomic write
                rc = r;
            }
        }
    }
    free(xq), free(dx), free(sx), free(xu);
    return rc;
}

/* Rows ids[0..n) as float32 (ids checked by the caller): the same floats as the gguf package's dequantization,
 * (d * sc_j) * q - dmin * m_j (a multiply, then a subtract) or (d * sc_j) * (q - 32). */
int kvq_kq_embed_rows(const uint8_t *w, int64_t ldw, int qt, const int64_t *ids, int64_t n, int64_t K, float *out) {
    const int bb = kq_block_bytes(qt);
    if (!bb) return KVQ_EBADTYPE;
    if (K % QK_K) return KVQ_EBADSHAPE;
    if (ldw < K / QK_K * bb) return KVQ_EROWBYTES;
    int16_t q[QK_K];
    float ds[16], dm[8];
    for (int64_t r = 0; r < n; r++)
        for (int64_t s = 0; s < K / QK_K; s++) {
            kq_unpack(w + ids[r] * ldw + s * bb, qt, q, ds, dm);
            float *yb = out + r * K + s * QK_K;
            if (qt == QT_Q6_K)
                for (int i = 0; i < QK_K; i++) yb[i] = ds[i / 16] * (float)q[i];
            else
                for (int i = 0; i < QK_K; i++) yb[i] = ds[i / 32] * (float)q[i] - dm[i / 32];
        }
    return KVQ_OK;
}

#if KVQ_LEVEL >= 2
/* ---- kept copies (the avx512 level): the super-blocks of 16 output columns laid out once for VNNI ----
 * kvq_amx_tiles_pack hands K-quant weights here, and kvq_kq_matmul reads the registered copy instead of the GGUF
 * rows. Per group of 16 columns, super-block after super-block (kc_sb_bytes each, a multiple of 64):
 *   Q4_K / Q5_K: the 128 quant bytes as 32 rows of 64 (row 8c + k: bytes 32c + 4k..32c + 4k + 3 of each column:
 *   low nibbles are sub-block 2c's quants 4k.., high nibbles sub-block 2c + 1's), Q5_K then its 32 high-bit
 *   bytes as 8 rows the same way (bit j: sub-block j), then sc[j][column], m[j][column] (one byte each), then the
 *   16 columns' d, dmin as fp16 bits.
 *   Q6_K: ql as 32 rows (row 16h + 8p + k: ql[64h + 32p + 4k..]), qh as 16 rows (row 8h + k: qh[32h + 4k..]),
 *   sc[t][column] (int8), the 16 d as fp16 bits, 32 bytes of padding.
 * That is the GGUF bytes' size (plus 1.0-2.5%), so a one-row decode reads no more. A 32-value block's 8 rows of
 * quants (4 per column and row) meet the activations' two bytes (hi + 128, lo; kvq_split_bytes) in vpdpbusd, as
 * qmatmul.c's kept_rows does: with S the column's quant sum (Q6_K: of q - 32), D = 256 * (sum((hi + 128) q) -
 * 128 S) + sum(lo q), the exact int32 kq_cols computes, then its float operations in its order, one column per
 * lane: the same bits. */
#define KC_MT 8 /* x rows per tile */
#define KC_AHEAD 4 /* super-blocks of the copy asked for ahead of the one multiplied */

static int kc_sb_bytes(int qt) {
    switch (qt) {
    case QT_Q4_K: return 2368;
    case QT_Q5_K: return 2880;
    case QT_Q6_K: return 3392;
    default: return 0;
    }
}

int64_t kvq_kq_kept_bytes(int64_t N, int64_t K, int qt) {
    const int sbb = kc_sb_bytes(qt);
    if (!sbb || N <= 0 || K <= 0 || K % QK_K) return 0;
    return (N + KC - 1) / KC * (K / QK_K) * sbb;
}

/* Bytes 4k..4k + 3 (k < nrows) of each column's src + off, as rows of 64 at dst. */
static void kc_rows(const uint8_t *const *cols, int64_t off, int nrows, uint8_t *dst) {
    for (int k = 0; k < nrows; k++)
        for (int u = 0; u < KC; u++) memcpy(dst + 64 * k + 4 * u, cols[u] + off + 4 * k, 4);
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
            if (qt == QT_Q6_K) {
                kc_rows(b, 0, 32, o);          /* ql[0..128): rows 16h + 8p + k are bytes 64h + 32p + 4k */
                kc_rows(b, 128, 16, o + 2048); /* qh[0..64): rows 8h + k are bytes 32h + 4k */
                for (int t = 0; t < 16; t++)
                    for (int u = 0; u < KC; u++) o[3072 + 16 * t + u] = b[u][192 + t];
                for (int u = 0; u < KC; u++) memcpy(o + 3328 + 2 * u, b[u] + 208, 2);
                continue;
            }
            const int q5 = qt == QT_Q5_K, so = q5 ? 2560 : 2048;
            kc_rows(b, q5 ? 48 : 16, 32, o);
            if (q5) kc_rows(b, 16, 8, o + 2048);
            for (int u = 0; u < KC; u++) {
                for (int j = 0; j < 8; j++) {
                    int sc, m;
                    kq_scale_min(b[u] + 4, j, &sc, &m);
                    o[so + 16 * j + u] = (uint8_t)sc, o[so + 128 + 16 * j + u] = (uint8_t)m;
                }
                memcpy(o + so + 256 + 2 * u, b[u], 2);
                memcpy(o + so + 288 + 2 * u, b[u] + 2, 2);
            }
        }
    }
    return KVQ_OK;
}

/* sum over k in [k0, k0 + 4) of the activation bytes' products with W[k], hi and lo apart, as two short chains. */
static inline __attribute__((always_inline)) __m512i kc_dot4(const uint8_t *xr, const __m512i *W, int k0,
                                                             __m512i s15) {
    int32_t a[4], e[4];
    memcpy(a, xr + 4 * k0, 16), memcpy(e, xr + 32 + 4 * k0, 16);
    __m512i h0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(a[0]), W[k0]);
    __m512i h1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(a[1]), W[k0 + 1]);
    __m512i l0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(e[0]), W[k0]);
    __m512i l1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(e[1]), W[k0 + 1]);
    h0 = _mm512_dpbusd_epi32(h0, _mm512_set1_epi32(a[2]), W[k0 + 2]);
    h1 = _mm512_dpbusd_epi32(h1, _mm512_set1_epi32(a[3]), W[k0 + 3]);
    l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(e[2]), W[k0 + 2]);
    l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(e[3]), W[k0 + 3]);
    const __m512i hi = _mm512_sub_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), s15);
    return _mm512_add_epi32(hi, _mm512_add_epi32(l0, l1));
}

static inline __attribute__((always_inline)) __m512i kc_qsum(const __m512i *W, int k0, int n) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i s = _mm512_setzero_si512();
    for (int k = k0; k < k0 + n; k++) s = _mm512_dpbusd_epi32(s, ones, W[k]);
    return _mm512_slli_epi32(s, 15);
}

/* MT rows (xu, dx, sx at the first) against one group's copy gp; y at the group's first column. */
static inline __attribute__((always_inline)) void kc_tile(const uint8_t *xu, const float *dx, const float *sx,
                                                          int64_t nb, int64_t nsb, const uint8_t *gp, float *y,
                                                          int64_t ldy, int g, const int qt, const int MT) {
    const int sbb = kc_sb_bytes(qt);
    const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    __m512 acc[KC_MT];
#pragma GCC unroll 8
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = gp + s * sbb;
        for (int o = 0; o < sbb; o += 64) __builtin_prefetch(sb + KC_AHEAD * sbb + o);
        __m512i W[8];
        if (qt == QT_Q6_K) {
            const __m512 vd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sb + 3328)));
            const __m512i o32 = _mm512_set1_epi8(32);
            for (int b8 = 0; b8 < 8; b8++) {
                const int h = b8 >> 2, t = b8 & 3, p = t & 1, sh = 4 * (t >> 1);
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    const __m512i lo = _mm512_load_si512(sb + 64 * (16 * h + 8 * p + k));
                    const __m512i hb = _mm512_load_si512(sb + 2048 + 64 * (8 * h + k));
                    W[k] = _mm512_sub_epi8(
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, sh), m4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * t), m3), 4)),
                        o32);
                }
                const __m512i s0 = kc_qsum(W, 0, 4), s1 = kc_qsum(W, 4, 4);
                const __m512 ds0 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                         _mm_load_si128((const __m128i *)(sb + 3072 + 32 * b8)))));
                const __m512 ds1 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                         _mm_load_si128((const __m128i *)(sb + 3088 + 32 * b8)))));
#pragma GCC unroll 8
                for (int r = 0; r < MT; r++) {
                    const uint8_t *xr = xu + (r * nb + s * 8 + b8) * 64;
                    const __m512i D0 = kc_dot4(xr, W, 0, s0), D1 = kc_dot4(xr, W, 4, s1);
                    const __m512 vdx = _mm512_set1_ps(dx[r * nb + s * 8 + b8]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D0), _mm512_mul_ps(ds0, vdx), acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D1), _mm512_mul_ps(ds1, vdx), acc[r]);
                }
            }
            continue;
        }
        const int so = qt == QT_Q5_K ? 2560 : 2048;
        const __m512 vd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sb + so + 256)));
        const __m512 vmin = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sb + so + 288)));
        for (int j = 0; j < 8; j++) {
            const int c = j >> 1, sh = 4 * (j & 1);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                W[k] = _mm512_and_si512(_mm512_srli_epi16(_mm512_load_si512(sb + 64 * (8 * c + k)), sh), m4);
                if (qt == QT_Q5_K) {
                    const __m512i hb = _mm512_load_si512(sb + 2048 + 64 * k);
                    W[k] = _mm512_or_si512(W[k], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, j), one), 4));
                }
            }
            const __m512i s15 = kc_qsum(W, 0, 8);
            const __m512 vds = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                     _mm_load_si128((const __m128i *)(sb + so + 16 * j)))));
            const __m512 vdm = _mm512_mul_ps(vmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                       _mm_load_si128((const __m128i *)(sb + so + 128 + 16 * j)))));
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                const uint8_t *xr = xu + (r * nb + s * 8 + j) * 64;
                /* the block's 8 rows of quants as two 4-row dot products, hi corrections split between them */
                const __m512i D = _mm512_add_epi32(kc_dot4(xr, W, 0, _mm512_setzero_si512()),
                                                   kc_dot4(xr, W, 4, s15));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D), _mm512_mul_ps(vds, _mm512_set1_ps(dx[r * nb + s * 8 + j])),
                                         acc[r]);
                acc[r] = _mm512_fnmadd_ps(vdm, _mm512_set1_ps(sx[r * nb + s * 8 + j]), acc[r]);
            }
        }
    }
    const __mmask16 keep = g == KC ? (__mmask16)0xffff : (__mmask16)((1u << g) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

typedef void (*kc_fn)(const uint8_t *, const float *, const float *, int64_t, int64_t, const uint8_t *, float *,
                      int64_t, int);
#define KC_TILE(MT)                                                                                             \
    static void kc_tile##MT(const uint8_t *xu, const float *dx, const float *sx, int64_t nb, int64_t nsb,       \
                            const uint8_t *gp, float *y, int64_t ldy, int g, int qt) {                          \
        if (qt == QT_Q4_K) kc_tile(xu, dx, sx, nb, nsb, gp, y, ldy, g, QT_Q4_K, MT);                            \
        else if (qt == QT_Q5_K) kc_tile(xu, dx, sx, nb, nsb, gp, y, ldy, g, QT_Q5_K, MT);                       \
        else kc_tile(xu, dx, sx, nb, nsb, gp, y, ldy, g, QT_Q6_K, MT);                                          \
    }
KC_TILE(1)
KC_TILE(2)
KC_TILE(3)
KC_TILE(4)
KC_TILE(5)
KC_TILE(6)
KC_TILE(7)
KC_TILE(8)
typedef void (*kc_any)(const uint8_t *, const float *, const float *, int64_t, int64_t, const uint8_t *, float *,
                       int64_t, int, int);
static const kc_any kc_tiles[KC_MT + 1] = {NULL, kc_tile1, kc_tile2, kc_tile3, kc_tile4,
                                           kc_tile5, kc_tile6, kc_tile7, kc_tile8};

/* Columns n0..n1 (n0 a multiple of KC) of every row from the kept copy; then the bias, one add. */
static void kc_cols(const struct kq_job *j, const uint8_t *xu, const uint8_t *kept, int64_t n0, int64_t n1) {
    const int64_t nsb = j->K / QK_K, nb = j->K / 32, gb = nsb * kc_sb_bytes(j->qt);
    for (int64_t n = n0; n < n1; n += KC) {
        const int g = n1 - n < KC ? (int)(n1 - n) : KC;
        for (int64_t r = 0; r < j->M; r += KC_MT) {
            const int h = j->M - r < KC_MT ? (int)(j->M - r) : KC_MT;
            kc_tiles[h](xu + r * nb * 64, j->dx + r * nb, j->sx + r * nb, nb, nsb, kept + n / KC * gb,
                        j->y + r * j->ldy + n, j->ldy, g, j->qt);
        }
        if (j->bias)
            for (int64_t r = 0; r < j->M; r++)
                for (int u = 0; u < g; u++) j->y[r * j->ldy + n + u] = j->y[r * j->ldy + n + u] + j->bias[n + u];
    }
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
            if (qt == QT_Q6_K) {
                for (int r = 0; r < 48; r++) memcpy(o + 4 * r, sb + 64 * r + 4 * u, 4); /* ql, then qh */
                for (int t = 0; t < 16; t++) o[192 + t] = sb[3072 + 16 * t + u];
                memcpy(o + 208, sb + 3328 + 2 * u, 2);
                continue;
            }
            const int q5 = qt == QT_Q5_K, so = q5 ? 2560 : 2048;
            for (int r = 0; r < 32; r++) memcpy(o + (q5 ? 48 : 16) + 4 * r, sb + 64 * r + 4 * u, 4);
            if (q5)
                for (int r = 0; r < 8; r++) memcpy(o + 16 + 4 * r, sb + 2048 + 64 * r + 4 * u, 4);
            memcpy(o, sb + so + 256 + 2 * u, 2);
            memcpy(o + 2, sb + so + 288 + 2 * u, 2);
            uint8_t sc[8], m[8];
            for (int j = 0; j < 8; j++) sc[j] = sb[so + 16 * j + u], m[j] = sb[so + 128 + 16 * j + u];
            for (int j = 0; j < 4; j++) {
                o[4 + j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
                o[8 + j] = (uint8_t)((m[j] & 63) | ((m[j + 4] >> 4) << 6));
                o[12 + j] = (uint8_t)((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
            }
        }
    }
    return KVQ_OK;
}
#else
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
