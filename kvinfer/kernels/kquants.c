/* Matmul and embedding rows over GGML K-quant super-blocks (Q4_K, Q5_K, Q6_K, and IQ4_XS, which has their shape;
 * layouts in ggml_blocks.h), read as stored. kvq_matmul / kvq_embed_rows (matmul.c) hand these types here.
 *
 * The activations are rounded as for the 32-weight types (qmatmul.c's quantize_rows: int16 per block of 32, scale
 * dx, exact float sum sx), so a sub-block's dot product with its quants is an exact int32 D_j. The arithmetic of
 * y[r, n], the same whatever M, the thread count or the ISA level (every float step one IEEE operation, lane =
 * output column):
 *   acc = 0; for each super-block, for each sub-block j in order (b: the 32-activation block it lies in):
 *     acc = fma(float(D_j), (d * sc_j) * dx_b, acc)
 *     acc = acc - (dmin * m_j) * sx_b, one rounding (fnma)    Q4_K / Q5_K only
 * (IQ4_XS: d * sc_j is d * (ls_j - 32), its quants the table's int8 values. Q2_K's sub-blocks are 16 values, so
 * its minimum meets sx16, the exact float sum of each 16 activations, computed here as quantize_rows sums 32.)
 *   y = acc (+ bias[n], one add).
 * A super-block of 8 output columns is unpacked once to int16 quants and exact float scales, then every row of
 * the call reads it (from KQ_PAIR_FROM rows laid out by pairs: kq_pairs, kq_rows_pairs); a row's accumulators
 * live in memory between super-blocks, so the row count never changes a row's operations. No AMX route: these
 * types run on the vector route on every CPU.
 *
 * This file: the route over the GGUF rows, and (avx2) the reading of a kept copy's super-blocks by kq_cols; the kept
 * copies' layout is kquants.h's, their packing, readback and own route kquants_kept.c's.
 */
#include "kquants.h"

#define KQ_MIN_BYTES_PER_THREAD (16 * 1024)

#if KVQ_LEVEL >= 1
static inline __m256i u8x16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline void st16(int16_t *q, __m256i v) { _mm256_storeu_si256((__m256i *)q, v); }

/* kq_unpack's quants, 16 at a time (integers: the same values). */
static inline __attribute__((always_inline)) void kq_unpack_q(const uint8_t *blk, const int qt, int16_t *q) {
    const __m256i m15 = _mm256_set1_epi16(15), m3 = _mm256_set1_epi16(3);
    if (qt == QT_Q2_K) { /* value l of group 4n + s: bits 2s.. of qs[32n + l] */
        for (int n = 0; n < 2; n++)
            for (int sh = 0; sh < 4; sh++, q += 32)
                for (int i = 0; i < 32; i += 16)
                    st16(q + i, _mm256_and_si256(_mm256_srli_epi16(u8x16(blk + 16 + 32 * n + i), 2 * sh), m3));
        return;
    }
    if (qt == QT_Q3_K) { /* value l of group 4h + s: 2 bits of qs[32h + l], minus 4 where hmask bit 4h + s is clear */
        const __m256i four = _mm256_set1_epi16(4), one = _mm256_set1_epi16(1);
        for (int h = 0; h < 2; h++)
            for (int sh = 0; sh < 4; sh++, q += 32)
                for (int i = 0; i < 32; i += 16) {
                    const __m256i v = _mm256_and_si256(_mm256_srli_epi16(u8x16(blk + 32 + 32 * h + i), 2 * sh), m3);
                    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(u8x16(blk + i), 4 * h + sh), one);
                    st16(q + i, _mm256_sub_epi16(v, _mm256_mullo_epi16(_mm256_xor_si256(hb, one), four)));
                }
        return;
    }
    if (qt == QT_IQ4_XS) { /* each nibble looks its value up in the table (pshufb), widened to int16 */
        const __m128i t = _mm_loadu_si128((const __m128i *)KQ_IQ4NL), n15 = _mm_set1_epi8(15);
        for (int j = 0; j < 8; j++, q += 32) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * j));
            st16(q, _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(v, n15))));
            st16(q + 16, _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), n15))));
        }
        return;
    }
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
    if (qt == QT_Q2_K) { /* d * sc_j, dmin * m_j: exact products, as kq_unpack's */
        __m256 c2[KG], e2[KG];
        const __m256i m15 = _mm256_set1_epi32(15);
        for (int u = 0; u < KG; u++) {
            const uint8_t *b = rows[u] + off;
            const __m256 d = _mm256_set1_ps(kvq_half(kvq_rd16(b + 80)));
            const __m256 dmin = _mm256_set1_ps(kvq_half(kvq_rd16(b + 82)));
            const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
            const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
            c[u] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(lo, m15)));
            c2[u] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(hi, m15)));
            e[u] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)));
            e2[u] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)));
        }
        tr8(c, ds), tr8(c2, ds + 8), tr8(e, dm), tr8(e2, dm + 8);
        return;
    }
    if (qt == QT_Q3_K) { /* d * (sc_j - 32): exact products, as kq_unpack's */
        for (int u = 0; u < KG; u++) {
            const uint8_t *b = rows[u] + off;
            const float d = kvq_half(kvq_rd16(b + 108));
            for (int t = 0; t < 16; t++) ds[t][u] = d * (float)kq_q3k_scale(b, t);
        }
        return;
    }
    if (qt == QT_IQ4_XS) { /* d * (ls_j - 32): exact products, as kq_unpack's, one column per lane */
        uint16_t dh[KG];
        int32_t h[KG], l[KG]; /* scales_h, and scales_l as one little-endian word: ls_j's low bits at 4 j */
        for (int u = 0; u < KG; u++) {
            const uint8_t *b = rows[u] + off;
            dh[u] = kvq_rd16(b), h[u] = kvq_rd16(b + 2);
            memcpy(&l[u], b + 4, 4);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh)); /* F16C: exact, as kvq_half */
        const __m256i hv = vi_load(h), lv = vi_load(l), m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3);
        for (int t = 0; t < 8; t++) {
            const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lv, 4 * t), m15),
                                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hv, 2 * t), m3), 4));
            vf_store(ds[t], _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)))));
        }
        return;
    }
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
    if (qt == QT_Q2_K) {
        const float d = kvq_half(kvq_rd16(blk + 80)), dmin = kvq_half(kvq_rd16(blk + 82));
        for (int j = 0; j < 16; j++) ds[j] = d * (float)(blk[j] & 15), dm[j] = dmin * (float)(blk[j] >> 4);
        for (int n = 0; n < 2; n++)
            for (int sh = 0; sh < 4; sh++, q += 32)
                for (int l = 0; l < 32; l++) q[l] = (int16_t)((blk[16 + 32 * n + l] >> (2 * sh)) & 3);
        return;
    }
    if (qt == QT_Q3_K) {
        const float d = kvq_half(kvq_rd16(blk + 108));
        for (int j = 0; j < 16; j++) ds[j] = d * (float)kq_q3k_scale(blk, j);
        for (int h = 0; h < 2; h++)
            for (int sh = 0; sh < 4; sh++, q += 32)
                for (int l = 0; l < 32; l++)
                    q[l] = (int16_t)(((blk[32 + 32 * h + l] >> (2 * sh)) & 3) - (((blk[l] >> (4 * h + sh)) & 1) ? 0 : 4));
        return;
    }
    if (qt == QT_IQ4_XS) {
        const float d = kvq_half(kvq_rd16(blk));
        for (int j = 0; j < 8; j++, q += 32) {
            ds[j] = d * (float)(kq_iq4xs_ls(blk, j) - 32), dm[j] = 0.0f;
            for (int l = 0; l < 16; l++) {
                q[l] = KQ_IQ4NL[blk[8 + 16 * j + l] & 15];
                q[l + 16] = KQ_IQ4NL[blk[8 + 16 * j + l] >> 4];
            }
        }
        return;
    }
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

#if KVQ_LEVEL == 1
/* The kept copy (kquants.h) as this route reads it: kc_gguf8, a super-block of 8 columns' quant bytes in GGUF order
 * into scratch (bb bytes per column), and kc_scales8, their scales as kq_scales8 gives them. */

/* 8 rows of 32 bytes at rows (dword u of row k: column u's bytes 4k..4k + 3) to each column's 32 bytes in order,
 * at dst + u * ld: an 8 x 8 transpose of dwords. */
static void kc_tr8_rows(const uint8_t *rows, uint8_t *dst, int ld) {
    __m256 c[8];
    float out[8][KG];
    for (int k = 0; k < 8; k++) c[k] = _mm256_castsi256_ps(_mm256_load_si256((const __m256i *)(rows + 32 * k)));
    tr8(c, out);
    for (int u = 0; u < 8; u++) memcpy(dst + u * ld, out[u], 32);
}

static void kc_gguf8(const uint8_t *sb, int qt, uint8_t *scratch) {
    const int bb = kq_block_bytes(qt);
    if (qt == QT_Q2_K) {
        for (int h = 0; h < 2; h++) kc_tr8_rows(sb + KC_R * 8 * h, scratch + 16 + 32 * h, bb); /* qs */
        return;
    }
    if (qt == QT_Q3_K) {
        kc_tr8_rows(sb + 16 * KC_R, scratch, bb);                                               /* hmask */
        for (int h = 0; h < 2; h++) kc_tr8_rows(sb + KC_R * 8 * h, scratch + 32 + 32 * h, bb); /* qs */
        return;
    }
    if (qt == QT_Q6_K) {
        for (int hp = 0; hp < 4; hp++) kc_tr8_rows(sb + KC_R * 8 * hp, scratch + 32 * hp, bb);  /* ql */
        for (int h = 0; h < 2; h++) kc_tr8_rows(sb + 32 * KC_R + KC_R * 8 * h, scratch + 128 + 32 * h, bb);
        return;
    }
    const int q5 = qt == QT_Q5_K;
    for (int c = 0; c < 4; c++) kc_tr8_rows(sb + KC_R * 8 * c, scratch + (q5 ? 48 : 16) + 32 * c, bb);
    if (q5) kc_tr8_rows(sb + 32 * KC_R, scratch + 16, bb);
}

static void kc_scales8(const uint8_t *sb, int qt, float ds[][KG], float dm[][KG]) {
    if (qt == QT_Q2_K) { /* the scale bytes as stored: sc_t | m_t << 4 */
        const __m256 vd = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(sb + KC2_D)));
        const __m256 vm = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(sb + KC2_D + 2 * KC)));
        for (int t = 0; t < 16; t++) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + KC2_SC + KC * t)));
            _mm256_storeu_ps(ds[t], _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)))));
            _mm256_storeu_ps(dm[t], _mm256_mul_ps(vm, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))));
        }
        return;
    }
    if (kq_sub16(qt)) {
        const int sc = qt == QT_Q3_K ? KC3_SC : KC6_SC, d = qt == QT_Q3_K ? KC3_D : KC6_D;
        const __m256 vd = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(sb + d)));
        for (int t = 0; t < 16; t++)
            _mm256_storeu_ps(ds[t], _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                          _mm_loadl_epi64((const __m128i *)(sb + sc + KC * t))))));
        return;
    }
    const int so = kc_so(qt);
    const __m256 vd = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(sb + so + 16 * KC)));
    const __m256 vm = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(sb + so + 18 * KC)));
    for (int t = 0; t < 8; t++) {
        _mm256_storeu_ps(ds[t], _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                      _mm_loadl_epi64((const __m128i *)(sb + so + KC * t))))));
        _mm256_storeu_ps(dm[t], _mm256_mul_ps(vm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                      _mm_loadl_epi64((const __m128i *)(sb + so + 8 * KC + KC * t))))));
    }
}

/* Q4_K, Q5_K and Q6_K from the copy straight to kq_pairs's layout: a row of the copy holds 4 quants (bytes) of each
 * column, which one in-lane byte shuffle per pair widens to int16 pairs of that column's lane. */
static inline int kc_pairs_direct(int qt) { return qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K; }

static inline __attribute__((always_inline)) void kc_pairs8(const uint8_t *sb, const int qt, int32_t *p) {
    /* per column (dword): bytes 0, 1 -> int16 pair (4k, 4k + 1); bytes 2, 3 -> (4k + 2, 4k + 3) */
    const __m256i s01 = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                         0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
    const __m256i s23 = _mm256_add_epi8(s01, _mm256_setr_epi8(2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0,
                                                               2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0));
    const __m256i m15 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), m3 = _mm256_set1_epi8(3);
#define KC_PUT(v, i) (_mm256_storeu_si256((__m256i *)(p + (i) * KG), _mm256_shuffle_epi8(v, s01)), \
                      _mm256_storeu_si256((__m256i *)(p + ((i) + 1) * KG), _mm256_shuffle_epi8(v, s23)))
    if (qt == QT_Q6_K) { /* value 128h + 32p + 4k + b: low nibble of ql row 16h + 8p + k, bits 2p.. of qh row 8h + k;
                          * + 64: high nibble, bits 4 + 2p.. */
        const __m256i o = _mm256_set1_epi16(32);
        for (int h = 0; h < 2; h++)
            for (int pp = 0; pp < 2; pp++)
                for (int k = 0; k < 8; k++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(sb + KC_R * (16 * h + 8 * pp + k)));
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(sb + 32 * KC_R + KC_R * (8 * h + k)));
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(a, m15), _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(hb, 2 * pp), m3), 4));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m15), _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(hb, 4 + 2 * pp), m3), 4));
                    const int i = 64 * h + 16 * pp + 2 * k;
                    _mm256_storeu_si256((__m256i *)(p + i * KG), _mm256_sub_epi16(_mm256_shuffle_epi8(lo, s01), o));
                    _mm256_storeu_si256((__m256i *)(p + (i + 1) * KG), _mm256_sub_epi16(_mm256_shuffle_epi8(lo, s23), o));
                    _mm256_storeu_si256((__m256i *)(p + (i + 32) * KG), _mm256_sub_epi16(_mm256_shuffle_epi8(hi, s01), o));
                    _mm256_storeu_si256((__m256i *)(p + (i + 33) * KG), _mm256_sub_epi16(_mm256_shuffle_epi8(hi, s23), o));
                }
        return;
    }
    /* Q4_K / Q5_K: value 64c + 4k + b is the low nibble of row 8c + k (+ bit 2c of Q5_K's high-bit row k), value
     * 64c + 32 + 4k + b its high nibble (+ bit 2c + 1) */
    for (int c = 0; c < 4; c++)
        for (int k = 0; k < 8; k++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(sb + KC_R * (8 * c + k)));
            __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
            if (qt == QT_Q5_K) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(sb + 32 * KC_R + KC_R * k));
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
            }
            KC_PUT(lo, 32 * c + 2 * k);
            KC_PUT(hi, 32 * c + 16 + 2 * k);
        }
#undef KC_PUT
}
#endif


/* Super-block s of the group of KG columns at n (rows: their GGUF rows) as int16 quants q [KG * 256] and exact
 * float scales ds, dm [sub-block][column], one definition per level. */
#if KVQ_LEVEL == 1
static inline __attribute__((always_inline)) void kq_super_block(const struct kq_job *j, const uint8_t *const *rows,
                                                                 int64_t n, int64_t s, const int qt, int16_t *q,
                                                                 float ds[][KG], float dm[][KG]) {
    const int bb = kq_block_bytes(qt);
    const int64_t nsb = j->K / QK_K;
    if (j->kept) {
        const uint8_t *sb = j->kept + (n / KG * nsb + s) * kc_sb_bytes(qt);
        uint8_t scratch[KG * 210];
        kc_gguf8(sb, qt, scratch);
        for (int u = 0; u < KG; u++) kq_unpack_q(scratch + u * bb, qt, q + u * QK_K);
        kc_scales8(sb, qt, ds, dm);
    } else {
        for (int u = 0; u < KG; u++) kq_unpack_q(rows[u] + s * bb, qt, q + u * QK_K);
        kq_scales8(rows, s * bb, qt, ds, dm);
    }
}
#elif KVQ_LEVEL >= 2
static inline __attribute__((always_inline)) void kq_super_block(const struct kq_job *j, const uint8_t *const *rows,
                                                                 int64_t n, int64_t s, const int qt, int16_t *q,
                                                                 float ds[][KG], float dm[][KG]) {
    const int bb = kq_block_bytes(qt);
    (void)j, (void)n;
    for (int u = 0; u < KG; u++) kq_unpack_q(rows[u] + s * bb, qt, q + u * QK_K);
    kq_scales8(rows, s * bb, qt, ds, dm);
}
#else
static inline __attribute__((always_inline)) void kq_super_block(const struct kq_job *j, const uint8_t *const *rows,
                                                                 int64_t n, int64_t s, const int qt, int16_t *q,
                                                                 float ds[][KG], float dm[][KG]) {
    const int bb = kq_block_bytes(qt);
    (void)j, (void)n;
    for (int u = 0; u < KG; u++) {
        float dsu[16], dmu[16];
        kq_unpack(rows[u] + s * bb, qt, q + u * QK_K, dsu, dmu);
        for (int t = 0; t < (kq_sub16(qt) ? 16 : 8); t++) ds[t][u] = dsu[t];
        if (kq_has_min(qt))
            for (int t = 0; t < (kq_sub16(qt) ? 16 : 8); t++) dm[t][u] = dmu[t];
    }
}
#endif

#if KVQ_LEVEL >= 1
#define KQ_PAIR_FROM 3 /* from this many rows a super-block's quants are laid out by pairs (kq_pairs) first */
#define KQ_PAIR_ROWS 4 /* and met by this many rows at a time */

/* kq_super_block's quants q [KG][256] as p [128][KG] int32: p[i][u] = column u's quants 2i and 2i + 1, the pair
 * vpmaddwd meets with activations 2i, 2i + 1 (8 x 8 transposes of int32: moves only). */
static inline void kq_pairs(const int16_t *q, int32_t *p) {
    for (int b = 0; b < QK_K / 16; b++) {
        __m256i v[KG], t[KG], s[KG];
        for (int u = 0; u < KG; u++) v[u] = _mm256_loadu_si256((const __m256i *)(q + u * QK_K + 16 * b));
        for (int u = 0; u < KG; u += 2)
            t[u] = _mm256_unpacklo_epi32(v[u], v[u + 1]), t[u + 1] = _mm256_unpackhi_epi32(v[u], v[u + 1]);
        for (int h = 0; h < KG; h += 4) /* s[h + e]: element e (and e + 4) of columns h..h + 3 */
            for (int e = 0; e < 2; e++) {
                s[h + 2 * e] = _mm256_unpacklo_epi64(t[h + e], t[h + e + 2]);
                s[h + 2 * e + 1] = _mm256_unpackhi_epi64(t[h + e], t[h + e + 2]);
            }
        for (int e = 0; e < 4; e++) {
            _mm256_storeu_si256((__m256i *)(p + (8 * b + e) * KG), _mm256_permute2x128_si256(s[e], s[e + 4], 0x20));
            _mm256_storeu_si256((__m256i *)(p + (8 * b + e + 4) * KG), _mm256_permute2x128_si256(s[e], s[e + 4], 0x31));
        }
    }
}

/* Rows r0..r0 + R - 1 of super-block s against the pairs p: each pair of quants meets a broadcast pair of
 * activations in every row, so a sub-block's int32 sums come out one column per lane with no horizontal sum. The
 * same integer D_j as kq_cols's row loop (the same pairs, added in another order: exact), then the same float
 * operations in the same order. */
static inline __attribute__((always_inline)) void kq_rows_pairs(const struct kq_job *j, int64_t s, int64_t r0,
                                                                const int R, const int32_t *p, float ds[][KG],
                                                                float dm[][KG], float *acc, const int qt) {
    const int64_t M = j->M, x0 = s * M + r0; /* super-block-major rows (kq_by_super_block) */
    const int sub = kq_sub16(qt) ? 8 : 16; /* pairs per sub-block */
    vf a[KQ_PAIR_ROWS];
    const int16_t *xr[KQ_PAIR_ROWS];
    for (int i = 0; i < R; i++) a[i] = vf_load(acc + (r0 + i) * KG), xr[i] = j->xq + (x0 + i) * QK_K;
    for (int t = 0; t < QK_K / 2 / sub; t++) {
        vi d[KQ_PAIR_ROWS];
        for (int i = 0; i < R; i++) d[i] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int e = t * sub; e < (t + 1) * sub; e++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(p + e * KG));
            for (int i = 0; i < R; i++) {
                int32_t xp; /* activations 2e, 2e + 1 */
                memcpy(&xp, xr[i] + 2 * e, 4);
                d[i] = _mm256_add_epi32(d[i], _mm256_madd_epi16(w, _mm256_set1_epi32(xp)));
            }
        }
        for (int i = 0; i < R; i++) {
            if (kq_sub16(qt)) {
                a[i] = vf_fma(vi_to_vf(d[i]), vf_mul(vf_load(ds[t]), vf_set1(j->dx[(x0 + i) * 8 + t / 2])), a[i]);
                if (qt == QT_Q2_K) a[i] = vf_fnma(vf_load(dm[t]), vf_set1(j->sx16[(x0 + i) * 16 + t]), a[i]);
            } else {
                a[i] = vf_fma(vi_to_vf(d[i]), vf_mul(vf_load(ds[t]), vf_set1(j->dx[(x0 + i) * 8 + t])), a[i]);
                if (qt != QT_IQ4_XS) a[i] = vf_fnma(vf_load(dm[t]), vf_set1(j->sx[(x0 + i) * 8 + t]), a[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) vf_store(acc + (r0 + i) * KG, a[i]);
}

/* 32 int16 activations x split for the few-row routes below: xe = x[0, 2, .., 14, 16, .., 30], xo = x[1, 3, .., 31]
 * (per 128-bit half: even words, then odd; then the halves regrouped). */
static inline __attribute__((always_inline)) void kq_split_eo(const int16_t *x, __m256i *xe, __m256i *xo) {
    const __m256i eo = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i l = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)x), eo), 0xd8);
    const __m256i h = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(x + 16)), eo), 0xd8);
    *xe = _mm256_permute2x128_si256(l, h, 0x20), *xo = _mm256_permute2x128_si256(l, h, 0x31);
}

/* IQ4_XS below KQ_PAIR_FROM rows (decode, with no kept copy: avx2), with few shuffles (one port runs them all): a
 * sub-block's 16 bytes, loaded into both halves of a register, give the low nibbles (elements 0..15) in the low
 * half and the high nibbles (16..31) in the high half, one table lookup (pshufb) gives the 32 values as bytes, and
 * shifts, not shuffles, sign-extend the even-placed and the odd-placed bytes to int16. The activations are split
 * the same way once per sub-block and row (xe: elements 0, 2, .., 14, 16, .., 30; xo: 1, 3, .., 31), so each
 * column costs one pshufb and two vpmaddwd. The same integer D_j (the same products, summed in another order:
 * exact), then the same float operations in the same order. */
static inline __attribute__((always_inline)) void kq_iq4xs_rows(const struct kq_job *j, const uint8_t *const *rows,
                                                                int64_t s, const int R, float ds[][KG],
                                                                float *acc) {
    const int64_t M = j->M, x0 = s * M, off = s * kq_block_bytes(QT_IQ4_XS) + 8;
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KQ_IQ4NL));
    const __m256i n15 = _mm256_set1_epi8(15), sh = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    vf a[KQ_PAIR_FROM - 1];
    for (int i = 0; i < R; i++) a[i] = vf_load(acc + i * KG);
    for (int t = 0; t < 8; t++) {
        __m256i xe[KQ_PAIR_FROM - 1], xo[KQ_PAIR_FROM - 1];
        for (int i = 0; i < R; i++) kq_split_eo(j->xq + (x0 + i) * QK_K + 32 * t, &xe[i], &xo[i]);
        vi p[KQ_PAIR_FROM - 1][KG];
        for (int u = 0; u < KG; u++) {
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(rows[u] + off + 16 * t)));
            const __m256i w = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srlv_epi32(v, sh), n15));
            const __m256i we = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), wo = _mm256_srai_epi16(w, 8);
            for (int i = 0; i < R; i++)
                p[i][u] = _mm256_add_epi32(_mm256_madd_epi16(we, xe[i]), _mm256_madd_epi16(wo, xo[i]));
        }
        for (int i = 0; i < R; i++)
            a[i] = vf_fma(vi_to_vf(vi_sum8(p[i])), vf_mul(vf_load(ds[t]), vf_set1(j->dx[(x0 + i) * 8 + t])), a[i]);
    }
    for (int i = 0; i < R; i++) vf_store(acc + i * KG, a[i]);
}

/* Q2_K below KQ_PAIR_FROM rows without a kept copy (KVINFER_AMX_KEEP=0): as kq_iq4xs_rows. A group of 32 values (sub-blocks 2g and
 * 2g + 1) is 2 bits of 32 quant bytes, so one load serves four groups, a shift and a mask give a group's values as
 * bytes (low half of the register: sub-block 2g, high half: 2g + 1), and a mask or a shift widens the even- and the
 * odd-placed ones to int16. The 8 columns' sums are then reduced per half: D of both sub-blocks. */
static inline __attribute__((always_inline)) void kq_q2k_rows(const struct kq_job *j, const uint8_t *const *rows,
                                                              int64_t s, const int R, float ds[][KG],
                                                              float dm[][KG], float *acc) {
    const int64_t M = j->M, x0 = s * M, off = s * kq_block_bytes(QT_Q2_K) + 16;
    const __m256i m3 = _mm256_set1_epi8(3), lo8 = _mm256_set1_epi16(0xff);
    vf a[KQ_PAIR_FROM - 1];
    for (int i = 0; i < R; i++) a[i] = vf_load(acc + i * KG);
    for (int g = 0; g < 8; g++) {
        __m256i xe[KQ_PAIR_FROM - 1], xo[KQ_PAIR_FROM - 1];
        for (int i = 0; i < R; i++) kq_split_eo(j->xq + (x0 + i) * QK_K + 32 * g, &xe[i], &xo[i]);
        vi p[KQ_PAIR_FROM - 1][KG];
        for (int u = 0; u < KG; u++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(rows[u] + off + 32 * (g / 4)));
            const __m256i w = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (g % 4)), m3);
            const __m256i we = _mm256_and_si256(w, lo8), wo = _mm256_srli_epi16(w, 8);
            for (int i = 0; i < R; i++)
                p[i][u] = _mm256_add_epi32(_mm256_madd_epi16(we, xe[i]), _mm256_madd_epi16(wo, xo[i]));
        }
        for (int i = 0; i < R; i++) {
            vi D[2]; /* sub-blocks 2g and 2g + 1: each column's low and high half */
            vi_sum4x2(p[i], &D[0], &D[1]);
            for (int h = 0; h < 2; h++) {
                const int t = 2 * g + h;
                a[i] = vf_fma(vi_to_vf(D[h]), vf_mul(vf_load(ds[t]), vf_set1(j->dx[(x0 + i) * 8 + g])), a[i]);
                a[i] = vf_fnma(vf_load(dm[t]), vf_set1(j->sx16[(x0 + i) * 16 + t]), a[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) vf_store(acc + i * KG, a[i]);
}
#endif

/* Columns n0..n1 (whole groups of KG but the last) for every row; acc [M * KG], q [KG * 256] scratch. */
static inline __attribute__((always_inline)) void kq_cols(const struct kq_job *j, int64_t n0, int64_t n1,
                                                           float *acc, int16_t *q, const int qt) {
    const int64_t nsb = j->K / QK_K, M = j->M;
    for (int64_t n = n0; n < n1; n += KG) {
        const int g = n1 - n < KG ? (int)(n1 - n) : KG;
        const uint8_t *rows[KG];
        for (int u = 0; u < KG; u++) rows[u] = j->w + (n + (u < g ? u : g - 1)) * j->ldw;
        for (int64_t i = 0; i < M * KG; i++) acc[i] = 0.0f;
        for (int64_t s = 0; s < nsb; s++) {
            float ds[16][KG], dm[16][KG];
#if KVQ_LEVEL >= 1
            if (M >= KQ_PAIR_FROM) {
                int32_t p[QK_K / 2 * KG];
#if KVQ_LEVEL == 1
                if (j->kept && kc_pairs_direct(qt)) {
                    const uint8_t *sb = j->kept + (n / KG * nsb + s) * kc_sb_bytes(qt);
                    kc_pairs8(sb, qt, p);
                    kc_scales8(sb, qt, ds, dm);
                } else
#endif
                {
                    kq_super_block(j, rows, n, s, qt, q, ds, dm);
                    kq_pairs(q, p);
                }
                int64_t r = 0;
                for (; r + KQ_PAIR_ROWS <= M; r += KQ_PAIR_ROWS) kq_rows_pairs(j, s, r, KQ_PAIR_ROWS, p, ds, dm, acc, qt);
                if (M - r == 3) kq_rows_pairs(j, s, r, 3, p, ds, dm, acc, qt);
                else if (M - r == 2) kq_rows_pairs(j, s, r, 2, p, ds, dm, acc, qt);
                else if (M - r == 1) kq_rows_pairs(j, s, r, 1, p, ds, dm, acc, qt);
                continue;
            }
            if (qt == QT_IQ4_XS && !j->kept) {
                kq_scales8(rows, s * kq_block_bytes(qt), qt, ds, dm);
                if (M == 2) kq_iq4xs_rows(j, rows, s, 2, ds, acc);
                else kq_iq4xs_rows(j, rows, s, 1, ds, acc);
                continue;
            }
            if (qt == QT_Q2_K && !j->kept) {
                kq_scales8(rows, s * kq_block_bytes(qt), qt, ds, dm);
                if (M == 2) kq_q2k_rows(j, rows, s, 2, ds, dm, acc);
                else kq_q2k_rows(j, rows, s, 1, ds, dm, acc);
                continue;
            }
#endif
            kq_super_block(j, rows, n, s, qt, q, ds, dm);
            for (int64_t r = 0; r < M; r++) {
                const int16_t *xr = j->xq + (s * M + r) * QK_K; /* super-block-major (kq_by_super_block) */
                const float *dxr = j->dx + (s * M + r) * 8, *sxr = j->sx + (s * M + r) * 8;
                vf a = vf_load(acc + r * KG);
                if (kq_sub16(qt)) {
                    for (int t = 0; t < 16; t++) {
                        vi p[KG];
                        for (int u = 0; u < KG; u++) p[u] = vs_madd16(q + u * QK_K + 16 * t, xr + 16 * t);
                        a = vf_fma(vi_to_vf(vi_sum8(p)), vf_mul(vf_load(ds[t]), vf_set1(dxr[t / 2])), a);
                        if (qt == QT_Q2_K)
                            a = vf_fnma(vf_load(dm[t]), vf_set1(j->sx16[(s * M + r) * 16 + t]), a);
                    }
                } else {
                    for (int t = 0; t < 8; t++) {
                        vi p[KG];
                        for (int u = 0; u < KG; u++) {
                            const int16_t *qu = q + u * QK_K + 32 * t;
                            p[u] = vi_add(vs_madd16(qu, xr + 32 * t), vs_madd16(qu + 16, xr + 32 * t + 16));
                        }
                        a = vf_fma(vi_to_vf(vi_sum8(p)), vf_mul(vf_load(ds[t]), vf_set1(dxr[t])), a);
                        if (qt != QT_IQ4_XS) a = vf_fnma(vf_load(dm[t]), vf_set1(sxr[t]), a);
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

/* a [M, K / QK_K, e] (row-major, e values per super-block) to [K / QK_K, M, e]: every row's part of one super-block
 * side by side, so kq_cols's pass over the rows reads one run, not M strides of the row length (which, at a power-
 * of-two row length, land in the same cache sets and evict each other from some hundred rows on). Moves only. */
static void *kq_by_super_block(void *a, int64_t M, int64_t nsb, size_t e) {
    if (M <= 1 || !a) return a;
    char *t = (char *)malloc((size_t)(M * nsb) * e);
    if (t)
        for (int64_t r = 0; r < M; r++)
            for (int64_t s = 0; s < nsb; s++) memcpy(t + (s * M + r) * e, (char *)a + (r * nsb + s) * e, e);
    free(a);
    return t;
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
    else if (j->qt == QT_Q6_K) kq_cols(j, n0, n1, acc, q, QT_Q6_K);
    else if (j->qt == QT_Q3_K) kq_cols(j, n0, n1, acc, q, QT_Q3_K);
    else if (j->qt == QT_Q2_K) kq_cols(j, n0, n1, acc, q, QT_Q2_K);
    else kq_cols(j, n0, n1, acc, q, QT_IQ4_XS);
    free(acc), free(q);
    return KVQ_OK;
}

/* Rows r0..r1 of x for the call: rounded (quantize_rows), Q2_K's sums per 16, and for the byte route (xu) the
 * bytes and the offset sums per 16 (c16: off * sum(x), or off * 256 * sum(hi) where lo meets q itself,
 * kc_lo_stored). */
static void kq_prepare(const struct kq_job *j, const float *x, int64_t ldx, uint8_t *xu, int64_t r0, int64_t r1) {
    const int64_t K = j->K, nb = K / 32, n16 = K / 16;
    if (r1 <= r0) return;
    kvq_quantize_rows(x + r0 * ldx, r1 - r0, K, ldx, (int16_t *)j->xq + r0 * K, (float *)j->dx + r0 * nb,
                      (float *)j->sx + r0 * nb);
    if (j->sx16) /* as quantize_rows sums a block of 32: lane-wise adds, then one horizontal sum */
        for (int64_t r = r0; r < r1; r++)
            for (int64_t b = 0; b < n16; b++) {
                const float *xb = x + r * ldx + 16 * b;
                ((float *)j->sx16)[r * n16 + b] = vf_hsum(vf_add(vf_add(vf_zero(), vf_load(xb)), vf_load(xb + 8)));
            }
    if (!xu) return;
    kvq_split_bytes(j->xq + r0 * K, r1 - r0, K, kc_signed_hi(j->qt) ? 0 : 128, xu + r0 * K * 2);
    if (j->c16) {
        const int lo_u = kc_lo_stored(j->qt), off = kc_off(j->qt);
        for (int64_t i = r0 * n16; i < r1 * n16; i++) {
            int32_t a = 0;
            for (int e = 0; e < 16; e++) a += lo_u ? j->xq[16 * i + e] : 256 * (j->xq[16 * i + e] >> 8);
            ((int32_t *)j->c16)[i] = off * a;
        }
    }
}

int kvq_kq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw,
                  int qt, const uint8_t *kept, const float *bias, float *y, int64_t ldy, int nthreads) {
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
    float *sx16 = NULL;
    if (qt == QT_Q2_K && !(sx16 = (float *)malloc(sizeof(float) * (size_t)(M * (K / 16))))) {
        free(xq), free(dx), free(sx);
        return KVQ_ENOMEM;
    }
    struct kq_job j = {xq, dx, sx, bias, sx16, NULL, w, y, M, K, N, ldw, ldy, qt, NULL};
    int nt = nthreads > 0 ? nthreads : kvq_max_threads();
    int64_t cols = KG;
    uint8_t *xu = NULL;
    if (KC_OWN_ROWS < 0 || !kvq_type_kept(qt)) kept = NULL; /* (no kept layout at this level, or for this type) */
    /* avx2: byte products cost more per row than the int16 route's, which wins from a few rows on; it reads the
     * copy too (the GGUF rows may be gone), unpacked per call as it unpacks the rows. At 8 activation bits the
     * byte route skips the lo products and wins at every row count. */
    if (kept && M > KC_OWN_ROWS && !kvqi_act8) {
        j.kept = kept;
        kept = NULL;
    }
    int32_t *c16 = NULL;
    if (kept) {
        xu = (uint8_t *)malloc((size_t)(M * K * 2));
        if (kc_off(qt)) c16 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * (K / 16)));
        if (!xu || (kc_off(qt) && !c16)) {
            free(xq), free(dx), free(sx), free(sx16), free(xu), free(c16);
            return KVQ_ENOMEM;
        }
        j.c16 = c16;
        cols = KC;
    }
    const int64_t work = N * (K / QK_K * bb) * (M < 8 ? 1 : M / 8), groups = (N + cols - 1) / cols;
    if ((int64_t)nt > work / KQ_MIN_BYTES_PER_THREAD) nt = (int)(work / KQ_MIN_BYTES_PER_THREAD);
    if (nt > groups) nt = (int)groups;
    if (nt < 1) nt = 1;
    /* the rows rounded (and split into bytes) by the same threads, whole rows each: a row's values depend on it
     * alone */
    const int pt = M * K >= KVQ_PREP_PAR_MIN && M > 1 ? (nt < M ? nt : (int)M) : 1;
#pragma omp parallel for num_threads(pt) schedule(static) if (pt > 1)
    for (int c = 0; c < pt; c++) kq_prepare(&j, x, ldx, xu, M * c / pt, M * (c + 1) / pt);
    int rc = KVQ_OK;
    if (xu) { /* runs of whole groups, taken by whichever thread is free (a host that stalls one thread leaves the
               * others the rest); one per thread for a few rows, whose calls are short */
        const int64_t per = M >= KVQ_RUNS_MIN_ROWS ? KVQ_RUNS_PER_THREAD : 1, runs = groups < nt * per ? groups : nt * per;
        if (per == 1) {
#pragma omp parallel for num_threads(nt) schedule(static, 1) if (nt > 1)
            for (int64_t u = 0; u < runs; u++) kvqi_kc_run(&j, xu, kept, u, runs, groups);
        } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
            for (int64_t u = 0; u < runs; u++) kvqi_kc_run(&j, xu, kept, u, runs, groups);
        }
    } else if (!(j.xq = xq = kq_by_super_block(xq, M, K / QK_K, sizeof(int16_t) * QK_K)) ||
               !(j.dx = dx = kq_by_super_block(dx, M, K / QK_K, sizeof(float) * 8)) ||
               !(j.sx = sx = kq_by_super_block(sx, M, K / QK_K, sizeof(float) * 8)) ||
               (sx16 && !(j.sx16 = sx16 = kq_by_super_block(sx16, M, K / QK_K, sizeof(float) * 16)))) {
        rc = KVQ_ENOMEM;
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
    free(xq), free(dx), free(sx), free(xu), free(sx16), free(c16);
    return rc;
}

/* Rows ids[0..n) as float32 (ids checked by the caller): the same floats as the gguf package's dequantization,
 * (d * sc_j) * q - dmin * m_j (a multiply, then a subtract), (d * sc_j) * (q - 32) or (d * (ls_j - 32)) * T[q]. */
int kvq_kq_embed_rows(const uint8_t *w, int64_t ldw, int qt, const int64_t *ids, int64_t n, int64_t K, float *out) {
    const int bb = kq_block_bytes(qt);
    if (!bb) return KVQ_EBADTYPE;
    if (K % QK_K) return KVQ_EBADSHAPE;
    if (ldw < K / QK_K * bb) return KVQ_EROWBYTES;
    int16_t q[QK_K];
    float ds[16], dm[16];
    for (int64_t r = 0; r < n; r++)
        for (int64_t s = 0; s < K / QK_K; s++) {
            kq_unpack(w + ids[r] * ldw + s * bb, qt, q, ds, dm);
            float *yb = out + r * K + s * QK_K;
            if (qt == QT_Q2_K)
                for (int i = 0; i < QK_K; i++) yb[i] = ds[i / 16] * (float)q[i] - dm[i / 16];
            else if (kq_sub16(qt))
                for (int i = 0; i < QK_K; i++) yb[i] = ds[i / 16] * (float)q[i];
            else if (qt == QT_IQ4_XS)
                for (int i = 0; i < QK_K; i++) yb[i] = ds[i / 32] * (float)q[i];
            else
                for (int i = 0; i < QK_K; i++) yb[i] = ds[i / 32] * (float)q[i] - dm[i / 32];
        }
    return KVQ_OK;
}

