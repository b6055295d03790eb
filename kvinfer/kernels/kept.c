/* A weight's kept copy at the avx512 level built with the AMX flags: the 16-column layout of Q4_0 / Q4_1 / Q5_0 /
 * Q5_1 / Q8_0 / IQ4_NL weights (layout in matmul.h, above kept_qbytes), its packing and its readback as GGUF bytes. The
 * K-quants' copies are kquants_kept.c's; the routes that read a copy are qmatmul.c's kept_rows and amx/. A copy is
 * not looked up: the caller keeps it beside its weight and passes both in every call (kvq_matmul's kept), as it
 * passes the bias. */
#include "matmul.h"

#ifdef KVQ_HAVE_AMX
/* The fifth-bit row of a 5-bit block of 16 columns (qh at rows[c] + off): bit k of byte 4 c + i is bit 4 k + i of
 * column c's qh, the element kept_quants' row k holds in that byte. Once per weight, so plain loops. */
static void kept_fifth_bits(const uint8_t *const *rows, int64_t off, uint8_t *dst) {
    for (int c = 0; c < KEPT_COLS; c++) {
        uint32_t h;
        memcpy(&h, rows[c] + off, 4);
        for (int i = 0; i < 4; i++) {
            unsigned v = 0;
            for (int k = 0; k < 8; k++) v |= ((h >> (4 * k + i)) & 1u) << k;
            dst[4 * c + i] = (uint8_t)v;
        }
    }
}

/* Column u's qh back from a fifth-bit row. */
static uint32_t kept_qh(const uint8_t *src, int64_t u) {
    uint32_t h = 0;
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 8; k++) h |= (uint32_t)((src[4 * u + i] >> k) & 1u) << (4 * k + i);
    return h;
}

int64_t kvq_amx_tiles_bytes(int64_t N, int64_t K, int qt) {
    if (!kvq_type_kept(qt)) return 0;
    if (kq_is_kquant(qt)) return kvq_kq_kept_bytes(N, K, qt);
    if (!block_bytes(qt) || K <= 0 || K % QK || N <= 0) return 0;
    return (N + KEPT_COLS - 1) / KEPT_COLS * kept_group_bytes(K / QK, qt);
}

int kvq_amx_tiles_pack(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, uint8_t *dst, int nthreads) {
    if (kq_is_kquant(qt)) return kvq_kq_kept_pack(w, N, K, ldw, qt, dst, nthreads);
    const int64_t bytes = kvq_amx_tiles_bytes(N, K, qt), nb = K / QK;
    if (!bytes) return KVQ_EBADSHAPE;
    if (ldw < nb * block_bytes(qt)) return KVQ_EROWBYTES;
    if ((uintptr_t)dst % 64) return KVQ_EBADSHAPE;
    const int64_t passes = (N + AMX_COLS - 1) / AMX_COLS, gb = kept_group_bytes(nb, qt), bb = block_bytes(qt);
    int rc = KVQ_OK;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
        int8_t *bt = NULL; /* Q8_0 only: kvqi_amx_pack's transposed bytes (4-bit groups keep the GGML nibbles) */
        float *d = NULL, *m = NULL;
        if (qt == QT_Q8_0) {
            bt = (int8_t *)aligned_alloc(64, (size_t)nb * 2 * 8 * 64);
            d = (float *)aligned_alloc(64, sizeof(float) * (size_t)nb * AMX_COLS);
            m = (float *)aligned_alloc(64, sizeof(float) * (size_t)nb * AMX_COLS);
        }
        const int ok = qt != QT_Q8_0 || (bt && d && m);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < passes; p++) { /* (every thread meets the loop; one without buffers skips) */
            if (!ok) {
#pragma omp atomic write
                rc = KVQ_ENOMEM;
                continue;
            }
            const int64_t c0 = p * AMX_COLS, c1 = c0 + AMX_COLS < N ? c0 + AMX_COLS : N;
            if (qt == QT_Q8_0) kvqi_amx_pack(w, ldw, qt, nb, c0, c1, bt, d, m);
            for (int t = 0; t < 2 && c0 + KEPT_COLS * t < N; t++) {
                uint8_t *g = dst + (2 * p + t) * gb;
                const int qb = kept_qbytes(qt);
                uint16_t *dh = (uint16_t *)(g + nb * qb), *mh = dh + nb * KEPT_COLS;
                const uint8_t *rows[KEPT_COLS];
                for (int c = 0; c < KEPT_COLS; c++) { /* past N: the last column again (never stored) */
                    const int64_t col = c0 + KEPT_COLS * t + c;
                    rows[c] = w + (col < N ? col : N - 1) * ldw;
                }
                for (int64_t b = 0; b < nb; b++) {
                    if (qt == QT_Q8_0) {
                        memcpy(g + b * 512, bt + (b * 2 + t) * 512, 512);
                    } else {
                        __m512i y[4];
                        dw_transpose16x4(rows, b * bb + q_qs_offset(qt), y);
                        for (int k = 0; k < 4; k++) _mm512_store_si512(g + b * qb + 64 * k, y[k]);
                        if (q_has_qh(qt)) kept_fifth_bits(rows, b * bb + q_qh_offset(qt), g + b * qb + 4 * 64);
                    }
                    for (int c = 0; c < KEPT_COLS; c++) {
                        const int live = c0 + KEPT_COLS * t + c < N;
                        dh[b * KEPT_COLS + c] = live ? kvq_rd16(rows[c] + b * bb) : 0;
                        if (q_has_min(qt)) mh[b * KEPT_COLS + c] = live ? kvq_rd16(rows[c] + b * bb + 2) : 0;
                    }
                }
            }
        }
        free(bt), free(d), free(m);
    }
    return rc;
}

int kvq_kept_rows(const uint8_t *kept, int64_t N, int64_t K, int qt, const int64_t *ids, int64_t n, uint8_t *out,
                  int64_t ldo) {
    if (kq_is_kquant(qt)) return kvq_kq_kept_rows(kept, N, K, qt, ids, n, out, ldo);
    if (!block_bytes(qt) || !kvq_type_kept(qt)) return KVQ_EBADTYPE;
    if (K <= 0 || K % QK || N <= 0) return KVQ_EBADSHAPE;
    const int64_t nb = K / QK, gb = kept_group_bytes(nb, qt), bb = block_bytes(qt), qo = q_qs_offset(qt);
    const int qb = kept_qbytes(qt), nrows = qt == QT_Q8_0 ? 8 : 4; /* rows of quants, or of nibble pairs */
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= N) return KVQ_EBADSHAPE;
        const uint8_t *gq = kept + ids[i] / KEPT_COLS * gb;
        const uint16_t *dh = (const uint16_t *)(gq + nb * kept_qbytes(qt)), *mh = dh + nb * KEPT_COLS;
        const int64_t u = ids[i] % KEPT_COLS;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + i * ldo + b * bb;
            for (int k = 0; k < nrows; k++) memcpy(o + qo + 4 * k, gq + b * qb + 64 * k + 4 * u, 4);
            if (q_has_qh(qt)) {
                const uint32_t h = kept_qh(gq + b * qb + 4 * 64, u);
                memcpy(o + q_qh_offset(qt), &h, 4);
            }
            memcpy(o, dh + b * KEPT_COLS + u, 2);
            if (q_has_min(qt)) memcpy(o + 2, mh + b * KEPT_COLS + u, 2);
        }
    }
    return KVQ_OK;
}
#else

/* Below the avx512 level only the K-quants have a kept layout (kquants_kept.c; none at the generic level). */
int64_t kvq_amx_tiles_bytes(int64_t N, int64_t K, int qt) {
    return kvq_type_kept(qt) ? kvq_kq_kept_bytes(N, K, qt) : 0;
}

int kvq_amx_tiles_pack(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, uint8_t *dst, int nthreads) {
    return kq_is_kquant(qt) ? kvq_kq_kept_pack(w, N, K, ldw, qt, dst, nthreads) : KVQ_EBADTYPE;
}

int kvq_kept_rows(const uint8_t *kept, int64_t N, int64_t K, int qt, const int64_t *ids, int64_t n, uint8_t *out,
                  int64_t ldo) {
    return kq_is_kquant(qt) ? kvq_kq_kept_rows(kept, N, K, qt, ids, n, out, ldo) : KVQ_EBADTYPE;
}
#endif
