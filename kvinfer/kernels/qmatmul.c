/* Matmul y[M,N] = x[M,K] @ W[N,K]^T (+ bias) for float32 activations and weights kept as GGML Q4_0 / Q4_1 /
 * Q5_0 / Q5_1 / Q8_0 / IQ4_NL blocks, or as float32 / fp16 / bf16 rows.
 *
 * One arithmetic per output element, whatever M, the tile a row lands in, the thread count or the ISA level:
 * a row's result is a fixed sequence of IEEE operations on that row and the weights alone. That is what makes
 * a request's logits independent of what else shares its step (docs/ARCHITECTURE.md, "Exactness").
 *
 * Quantised weights (block layouts, 32 weights each, little-endian fp16 fields):
 *   Q4_0: d qs[16]    w = d * (q - 8)      Q4_1: d m qs[16]   w = d * q + m      Q8_0: d qs[32]   w = d * q
 *   Q5_0: d qh[4] qs[16]     w = d * (q - 16)       Q5_1: d m qh[4] qs[16]   w = d * q + m
 *   IQ4_NL: d qs[16]  w = d * T[q] (T: 16 int8 values, KQ_IQ4NL; q a nibble as Q4_0's)
 * (4-bit: element i in the low nibble of qs[i], element i + 16 in its high nibble; Q5_0 / Q5_1: q is the 4-bit
 * quant plus 16 where bit i of qh is set for element i). Q5_1 is Q4_1 with a wider q, so it takes Q4_1's arithmetic
 * below: a result depends on d, m and q alone, and D_b stays exact. Q5_0 takes Q8_0's (and Q4_0's, the same): its
 * integers q - 16 are the ones the loader once rewrote as Q8_0 quants, so it gives that rewrite's bits; IQ4_NL too,
 * on its integers T[q] (looked up by load_q, load_q16 and kept_quants). Each x row is
 * rounded per 32-element block to int16 (x ~ dx * xq, |xq| <= 32767: relative error at most 1.5e-5 of the block's
 * largest |x|, 30x finer than fp16; llama.cpp rounds to 8 bits), so a block's dot product with the quants is exact
 * integer arithmetic, one int32 per block; it is scaled by d * dx and accumulated in float, block after block,
 * and Q4_1 / Q5_1's minimum enters as m * sum(x_block) (the exact order: tile_q). Vectors hold 8 output columns
 * (16 at the AVX-512 level, one column per lane: tile_q_lanes); tiles of up to 8 rows (16 at the AVX-512 level)
 * share each decoded block (per row and 8 columns a block costs two vpmaddwd per column, reduced; at the AVX-512 level
 * one VNNI vpdpwssd per pair of elements for 16 columns at once, no reduction).
 * From AMX_MIN_ROWS (24) rows, on a CPU whose OS grants the AMX tile state, tile multiplies compute the same int32
 * per block (amx_rows), followed by the same float operations. One int32 per block instead of an 8-lane split of
 * it is what let the tiles in, and it is faster on the vector route too (docs/BENCHMARKS.md).
 * At the AVX-512 level a weight kept in tile layout (kvq_amx_tiles_pack) is read by both routes: the tiles, and
 * below them kept_rows, whose vpdpbusd multiplies the activations' two bytes by the quants as stored: again the
 * same int32 per block (Q5_0 and Q5_1 rebuild their quants' fifth bit from the copy: kept_quants).
 *
 * This file: the quantised routes' row tiles (tile_q, tile_q_lanes, kept_rows). Float weights: fmatmul.c; the
 * call that picks a route and splits the columns over threads: matmul.c; the kept copy: kept.c; AMX: amx/.
 */
#include "matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

int kvqi_act8;

int kvq_activation_bits(int bits) {
    if (bits == 8 || bits == 16) kvqi_act8 = bits == 8;
    return kvqi_act8 ? 8 : 16;
}

int kvqi_pf_l2;

/* Set once when the library loads: AMD (cpuid vendor "AuthenticAMD") family 19h. */
__attribute__((constructor)) static void pf_init(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541u || d != 0x69746e65u || c != 0x444d4163u) return;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    const unsigned base = (a >> 8) & 0xf, family = base == 0xf ? base + ((a >> 20) & 0xff) : base;
    kvqi_pf_l2 = family == 0x19;
#endif
}

int kvq_prefetch_l2(void) { return kvqi_pf_l2; }

/* Row r: xq int16 [nb * 32], dx its block scales, sx its exact float block sums. At 8 activation bits a block is
 * rounded to q in [-127, 127] (scale amax / 127, as llama.cpp's Q8_0) and stored as xq = 256 q, dx = amax / 127 /
 * 256: every route then reads the same int16 (their lo bytes are zero) and gives the same bits, and the byte routes
 * skip the lo products. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int16_t *xq, float *dx, float *sx) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * QK;
            vf s = vf_zero(), mx = vf_zero();
            for (int j = 0; j < 4; j++) {
                vf v = vf_load(xb + 8 * j);
                s = vf_add(s, v);
                mx = vf_max(mx, vf_abs(v));
            }
            const float amax = vf_hmax(mx);
            int16_t *q = xq + (r * nb + b) * QK;
            if (kvqi_act8) {
                round_i16_32(xb, amax > 0.0f ? 127.0f / amax : 0.0f, q);
                for (int i = 0; i < QK; i++) q[i] = (int16_t)(q[i] * 256);
                dx[r * nb + b] = amax / 127.0f / 256.0f;
            } else {
                round_i16_32(xb, amax > 0.0f ? 32767.0f / amax : 0.0f, q);
                dx[r * nb + b] = amax / 32767.0f;
            }
            sx[r * nb + b] = vf_hsum(s);
        }
}

void kvq_quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int16_t *xq, float *dx, float *sx) {
    quantize_rows(x, M, K, ldx, xq, dx, sx);
}

static inline q32 load_q(const uint8_t *blk, int qt) {
    if (qt == QT_Q8_0) return q32_from_q8(blk + 2);
    if (q_is_nl(qt)) return q32_from_nl(blk + 2, KQ_IQ4NL);
    if (q_has_qh(qt)) return q32_from_q5(blk + q_qh_offset(qt), blk + q_qs_offset(qt), q_offset(qt));
    return q32_from_q4(blk + q_qs_offset(qt), q_offset(qt));
}

/* d (lanes) and Q4_1 / Q5_1's m of the block at offset off of each of 8 weight rows (a tail group repeats its
 * last). */
static inline void load_dm_rows(const uint8_t *const *rows, int64_t off, vf *d, vf *m) {
    float dv[NG], mv[NG];
    for (int u = 0; u < NG; u++)
        dv[u] = kvq_half(kvq_rd16(rows[u] + off)), mv[u] = kvq_half(kvq_rd16(rows[u] + off + 2));
    *d = vf_load(dv), *m = vf_load(mv);
}

#if KVQ_LEVEL >= 2
/* ---- the AVX-512 level: 16 output columns per register, lane = column ----
 * The quants of 16 weight rows' block b are transposed so that register R_j holds, in the lane of each column,
 * that column's elements 2j and 2j + 1 as two int16; one VNNI instruction per pair then adds both products to
 * the column's own int32 lane (the activations' pair broadcast), so 16 instructions give D_b of 16 columns and
 * no reduction is left. The transpose is paid once per block and shared by every row of the tile, so a row
 * costs 16 dot-product instructions and its float work (the 8-column route spent 8 dot products and a
 * 13-instruction reduction per 8 columns). D_b is the same exact int32, and each lane then runs the float
 * operations of tile_q below: the same bits. */

/* Q5_0 / Q5_1: R[j] lane c gains 16 in the word of element 2j (low) and 2j + 1 (high) where that element's fifth
 * bit is set (bits 2j, 2j + 1 of column c's qh, the dword at rows[c] + off). */
static inline __attribute__((always_inline)) void or_fifth_bits16(const uint8_t *const *rows, int64_t off,
                                                                  __m512i R[16]) {
    int32_t h[16];
    for (int u = 0; u < 16; u++) memcpy(&h[u], rows[u] + off, 4);
    const __m512i qh = _mm512_loadu_si512(h), three = _mm512_set1_epi32(3), sel = _mm512_set1_epi32(0x00100010);
    for (int j = 0; j < 16; j++) { /* t: bits 2j, 2j + 1 at 0, 1; moved to bit 4 of the low and the high word */
        const __m512i t = _mm512_and_si512(_mm512_srli_epi32(qh, 2 * j), three);
        const __m512i b = _mm512_and_si512(_mm512_or_si512(_mm512_slli_epi32(t, 4), _mm512_slli_epi32(t, 19)), sel);
        R[j] = _mm512_or_si512(R[j], b);
    }
}

/* R[j] (j = 0..15), lane c: elements 2j, 2j + 1 of column c's block as int16 (q - q_offset). */
static inline __attribute__((always_inline)) void load_q16(const uint8_t *const *rows, int64_t off, int qt,
                                                           __m512i R[16]) {
    __m512i y[4];
    if (qt == QT_Q8_0) {
        /* dword t holds bytes 4t..4t+3 = pairs 2t, 2t + 1; each byte to a word's high half, then shifted down
         * arithmetically: sign-extended */
        const __m512i sa = _mm512_broadcast_i32x4(_mm_setr_epi8(-128, 0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9,
                                                                -128, 12, -128, 13));
        const __m512i sb = _mm512_broadcast_i32x4(_mm_setr_epi8(-128, 2, -128, 3, -128, 6, -128, 7, -128, 10, -128,
                                                                11, -128, 14, -128, 15));
        for (int h = 0; h < 2; h++) {
            dw_transpose16x4(rows, off + 2 + 16 * h, y);
            for (int t = 0; t < 4; t++) {
                R[8 * h + 2 * t] = _mm512_srai_epi16(_mm512_shuffle_epi8(y[t], sa), 8);
                R[8 * h + 2 * t + 1] = _mm512_srai_epi16(_mm512_shuffle_epi8(y[t], sb), 8);
            }
        }
        return;
    }
    /* 4-bit: dword t holds bytes 4t..4t+3; their low nibbles are elements 4t..4t+3 (pairs 2t, 2t + 1), their high
     * nibbles elements 16 + 4t.. (pairs 8 + 2t, 9 + 2t) */
    const __m512i sa = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -128, 1, -128, 4, -128, 5, -128, 8, -128, 9, -128, 12,
                                                            -128, 13, -128));
    const __m512i sb = _mm512_broadcast_i32x4(_mm_setr_epi8(2, -128, 3, -128, 6, -128, 7, -128, 10, -128, 11, -128,
                                                            14, -128, 15, -128));
    const __m512i lo = _mm512_set1_epi16(15), o = _mm512_set1_epi16((short)q_offset(qt));
    dw_transpose16x4(rows, off + q_qs_offset(qt), y);
    for (int t = 0; t < 4; t++) {
        const __m512i a = _mm512_shuffle_epi8(y[t], sa), b = _mm512_shuffle_epi8(y[t], sb);
        R[2 * t] = _mm512_and_si512(a, lo);
        R[2 * t + 1] = _mm512_and_si512(b, lo);
        R[8 + 2 * t] = _mm512_srli_epi16(a, 4);
        R[9 + 2 * t] = _mm512_srli_epi16(b, 4);
    }
    if (q_has_qh(qt)) or_fifth_bits16(rows, off + q_qh_offset(qt), R);
    if (q_is_nl(qt)) { /* each word's nibble (0..15) indexes the table, widened to 16-bit words */
        const __m512i tbl = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)KQ_IQ4NL)));
        for (int j = 0; j < 16; j++) R[j] = _mm512_permutexvar_epi16(R[j], tbl);
    }
    if (q_offset(qt))
        for (int j = 0; j < 16; j++) R[j] = _mm512_sub_epi16(R[j], o);
}

#define NG16 16

/* tile_q's float work on a block's exact int32 D, one column per lane: every 16-column route ends in this. */
static inline __attribute__((always_inline)) __m512 lanes_block(__m512 acc, __m512i D, __m512 vd, __m512 vm,
                                                                float dx, float sx, int qt) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D), _mm512_mul_ps(vd, _mm512_set1_ps(dx)), acc);
    if (q_has_min(qt)) acc = _mm512_fmadd_ps(vm, _mm512_set1_ps(sx), acc);
    return acc;
}

/* tile_q's arithmetic, 16 columns at a time (see above). */
static inline __attribute__((always_inline)) void tile_q_lanes(const int16_t *xq, const float *dx,
                                                               const float *sx, int64_t nb, const uint8_t *w,
                                                               int64_t ldw, int qt, float *y, int64_t ldy,
                                                               int64_t n0, int64_t n1, int prefetch, const int MT) {
    const int bb = block_bytes(qt);
    for (int64_t n = n0; n < n1; n += NG16) {
        const int g = n1 - n < NG16 ? (int)(n1 - n) : NG16;
        const uint8_t *rows[NG16];
        for (int u = 0; u < NG16; u++) rows[u] = w + (n + (u < g ? u : g - 1)) * ldw;
        __m512 acc[MT_MAX];
#pragma GCC unroll 16
        for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const int64_t off = b * bb;
            if (prefetch) /* the next group's rows, a group ahead (rows are contiguous) */
                for (int u = 0; u < NG16; u++) __builtin_prefetch(rows[u] + off + NG16 * ldw);
            vf d0, m0, d1, m1;
            if (g == NG16) {
                vf_load_half2_strided(rows[0] + off, (int)ldw, &d0, &m0);
                vf_load_half2_strided(rows[8] + off, (int)ldw, &d1, &m1);
            } else {
                load_dm_rows(rows, off, &d0, &m0);
                load_dm_rows(rows + 8, off, &d1, &m1);
            }
            const __m512 vd = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
            const __m512 vm = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
            __m512i R[16];
            load_q16(rows, off, qt, R);
#pragma GCC unroll 16
            for (int r = 0; r < MT; r++) {
                const int16_t *xr = xq + (r * nb + b) * QK;
                /* four chains of dependent VNNI instructions, not one of 16: a chain's latency, not the
                 * instructions, bounded this loop (docs/BENCHMARKS.md). Exact integers: any order. */
                __m512i Dp[4];
#pragma GCC unroll 16
                for (int jj = 0; jj < 16; jj++) {
                    int32_t xp;
                    memcpy(&xp, xr + 2 * jj, 4);
                    Dp[jj & 3] = _mm512_dpwssd_epi32(jj < 4 ? _mm512_setzero_si512() : Dp[jj & 3], R[jj],
                                                     _mm512_set1_epi32(xp));
                }
                const __m512i D = _mm512_add_epi32(_mm512_add_epi32(Dp[0], Dp[1]), _mm512_add_epi32(Dp[2], Dp[3]));
                acc[r] = lanes_block(acc[r], D, vd, vm, dx[r * nb + b], sx[r * nb + b], qt);
            }
        }
        const __mmask16 keep = g == NG16 ? (__mmask16)0xffff : (__mmask16)((1u << g) - 1);
#pragma GCC unroll 16
        for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(y + r * ldy + n, keep, acc[r]);
    }
}
#define tile_q tile_q_lanes
#else
/* Weight rows n0..n1 against MT quantised x rows, 8 output columns (one vector) at a time. The arithmetic of
 * y[r, n], the same whatever MT, the group n falls in, the thread or the level (the AMX route below included):
 *   acc = 0; for each block b in order:
 *     acc = fma(float(D_b), d_b * dx_b, acc)     D_b: the exact int32 dot product of the block's 32 quants with
 *                                                the row's 32 int16-rounded activations
 *     acc = fma(m_b, sx_b, acc)                  Q4_1, Q5_1 only: the minimum times the exact float sum of the block
 *   y = acc.
 * One int32 per block (not a lane split of it) is what a tile multiply unit hands back, so every route computes
 * D_b its own way: here two vpmaddwd (or VNNI) per block and row, eight outputs' partial sums reduced together. */
static inline __attribute__((always_inline)) void tile_q(const int16_t *xq, const float *dx, const float *sx,
                                                         int64_t nb, const uint8_t *w, int64_t ldw, int qt,
                                                         float *y, int64_t ldy, int64_t n0, int64_t n1,
                                                         int prefetch, const int MT) {
    const int bb = block_bytes(qt);
    for (int64_t n = n0; n < n1; n += NG) {
        const int g = n1 - n < NG ? (int)(n1 - n) : NG;
        const uint8_t *rows[NG];
        for (int u = 0; u < NG; u++) rows[u] = w + (n + (u < g ? u : g - 1)) * ldw;
        vf acc[MT_MAX];
        for (int r = 0; r < MT; r++) acc[r] = vf_zero();
        for (int64_t b = 0; b < nb; b++) {
            const int64_t off = b * bb;
            if (prefetch) /* the next group's rows, a group ahead (rows are contiguous) */
                for (int u = 0; u < NG; u++) __builtin_prefetch(rows[u] + off + NG * ldw);
            vf vd, vm;
            if (g == NG) vf_load_half2_strided(rows[0] + off, (int)ldw, &vd, &vm);
            else load_dm_rows(rows, off, &vd, &vm);
            vi dot[MT_MAX][NG];
            for (int u = 0; u < NG; u++) {
                const q32 q = load_q(rows[u] + off, qt);
                for (int r = 0; r < MT; r++) dot[r][u] = q32_dot(q, xq + (r * nb + b) * QK);
            }
            vi dsum[MT_MAX];
            for (int r = 0; r < MT; r++) dsum[r] = vi_sum8(dot[r]);
            for (int r = 0; r < MT; r++) {
                acc[r] = vf_fma(vi_to_vf(dsum[r]), vf_mul(vd, vf_set1(dx[r * nb + b])), acc[r]);
                if (q_has_min(qt)) acc[r] = vf_fma(vm, vf_set1(sx[r * nb + b]), acc[r]);
            }
        }
        for (int r = 0; r < MT; r++) {
            if (g == NG) {
                vf_store(y + r * ldy + n, acc[r]);
            } else {
                float t[NG];
                vf_store(t, acc[r]);
                for (int u = 0; u < g; u++) y[r * ldy + n + u] = t[u];
            }
        }
    }
}

#endif

#define KVQ_TILE_Q(MT)                                                                                          \
    static void tile_q##MT(const int16_t *xq, const float *dx, const float *sx, int64_t nb, const uint8_t *w,   \
                           int64_t ldw, int qt, float *y, int64_t ldy, int64_t n0, int64_t n1, int pf) {       \
        if (qt == QT_Q4_1) tile_q(xq, dx, sx, nb, w, ldw, QT_Q4_1, y, ldy, n0, n1, pf, MT);                    \
        else if (qt == QT_Q5_1) tile_q(xq, dx, sx, nb, w, ldw, QT_Q5_1, y, ldy, n0, n1, pf, MT);               \
        else if (qt == QT_Q5_0) tile_q(xq, dx, sx, nb, w, ldw, QT_Q5_0, y, ldy, n0, n1, pf, MT);               \
        else if (qt == QT_Q4_0) tile_q(xq, dx, sx, nb, w, ldw, QT_Q4_0, y, ldy, n0, n1, pf, MT);               \
        else if (qt == QT_IQ4_NL) tile_q(xq, dx, sx, nb, w, ldw, QT_IQ4_NL, y, ldy, n0, n1, pf, MT);           \
        else tile_q(xq, dx, sx, nb, w, ldw, QT_Q8_0, y, ldy, n0, n1, pf, MT);                                  \
    }
KVQ_TILE_Q(1)
KVQ_TILE_Q(2)
KVQ_TILE_Q(3)
KVQ_TILE_Q(4)
KVQ_TILE_Q(5)
KVQ_TILE_Q(6)
KVQ_TILE_Q(7)
KVQ_TILE_Q(8)
#if KVQ_LEVEL >= 2
KVQ_TILE_Q(9)
KVQ_TILE_Q(10)
KVQ_TILE_Q(11)
KVQ_TILE_Q(12)
KVQ_TILE_Q(13)
KVQ_TILE_Q(14)
KVQ_TILE_Q(15)
KVQ_TILE_Q(16)
const tile_q_fn kvqi_tiles_q[MT_MAX + 1] = {NULL, tile_q1, tile_q2, tile_q3, tile_q4, tile_q5, tile_q6,
                                         tile_q7, tile_q8, tile_q9, tile_q10, tile_q11, tile_q12,
                                         tile_q13, tile_q14, tile_q15, tile_q16};
#else
const tile_q_fn kvqi_tiles_q[MT_MAX + 1] = {NULL, tile_q1, tile_q2, tile_q3, tile_q4,
                                         tile_q5, tile_q6, tile_q7, tile_q8};
#endif

/* The int16 activations as kept_rows reads them: per row and block, 32 bytes hi + hi_offset (128: unsigned; 0: as
 * a signed byte, kquants.h kc_signed_hi), then 32 bytes lo. */
void kvq_split_bytes(const int16_t *xq, int64_t M, int64_t K, int hi_offset, uint8_t *xu) {
    for (int64_t i = 0; i < M * K; i += QK)
        for (int e = 0; e < QK; e++) {
            xu[2 * i + e] = (uint8_t)((xq[i + e] >> 8) + hi_offset);
            xu[2 * i + QK + e] = (uint8_t)(xq[i + e] & 0xff);
        }
}

#ifdef KVQ_HAVE_AMX
/* ---- the vector route over a kept weight (below AMX_MIN_ROWS, or with the tiles off) ----
 * The kept quants are already laid out as a VNNI instruction wants them, so tile_q_lanes' per-block transpose is
 * gone. vpdpbusd multiplies unsigned by signed bytes: the int16 activations go in as two unsigned bytes each,
 * hi + 128 (hi = xq >> 8) and lo = xq & 255, and with S the sum of a column's 32 quants (vpdpbusd of ones, once
 * per block for all rows) D_b = 256 * (sum((hi + 128) q) - 128 S) + sum(lo q): the same exact int32, every
 * intermediate below 2^31 in magnitude, followed by the same float operations: the same bits as every route,
 * faster than tile_q_lanes over the GGUF rows (docs/BENCHMARKS.md). */
/* Blocks of the copy asked for ahead of the one multiplied (the hardware prefetchers alone fall behind); the best
 * of the distances tried (docs/BENCHMARKS.md). */
#define KEPT_AHEAD(qt) ((qt) == QT_Q8_0 ? 4 : 32)

static inline __attribute__((always_inline)) void kept_rows(const uint8_t *xu, const float *dx, const float *sx,
                                                            int64_t nb, int qt, const uint8_t *kept, float *y,
                                                            int64_t ldy, int64_t n0, int64_t n1, const int MT) {
    const int64_t gb = kept_group_bytes(nb, qt);
    const __m512i ones = _mm512_set1_epi8(1);
    const int l8 = kvqi_act8; /* the lo bytes are zero: their products skipped */
    for (int64_t n = n0; n < n1; n += KEPT_COLS) {
        const int g = n1 - n < KEPT_COLS ? (int)(n1 - n) : KEPT_COLS;
        const uint8_t *gq = kept + n / KEPT_COLS * gb;
        const int qb = kept_qbytes(qt);
        const uint16_t *dh = (const uint16_t *)(gq + nb * qb), *mh = dh + nb * KEPT_COLS;
        __m512 acc[MT_MAX];
#pragma GCC unroll 16
        for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            for (int o = 0; o < qb; o += 64) KVQ_PREFETCH(gq + (b + KEPT_AHEAD(qt)) * qb + o);
            if (b % 2 == 0) KVQ_PREFETCH(dh + (b + KEPT_AHEAD(qt)) * KEPT_COLS);
            if (q_has_min(qt) && b % 2 == 0) KVQ_PREFETCH(mh + (b + KEPT_AHEAD(qt)) * KEPT_COLS);
            __m512i W[8];
            kept_quants(gq, b, qt, W);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, W[0]), s1 = _mm512_setzero_si512();
            s1 = _mm512_dpbusd_epi32(s1, ones, W[1]);
            for (int k = 2; k < 8; k += 2)
                s0 = _mm512_dpbusd_epi32(s0, ones, W[k]), s1 = _mm512_dpbusd_epi32(s1, ones, W[k + 1]);
            const __m512i s15 = _mm512_slli_epi32(_mm512_add_epi32(s0, s1), 15);
            const __m512 vd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(dh + b * KEPT_COLS)));
            const __m512 vm = q_has_min(qt)
                                  ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(mh + b * KEPT_COLS)))
                                  : _mm512_setzero_ps();
#pragma GCC unroll 16
            for (int r = 0; r < MT; r++) {
                const uint8_t *xr = xu + (r * nb + b) * 64; /* 32 bytes hi + 128, then 32 bytes lo */
                __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0; /* four short chains */
                for (int k = 0; k < 8; k += 2) {
                    int32_t a, c;
                    memcpy(&a, xr + 4 * k, 4), memcpy(&c, xr + 4 * k + 4, 4);
                    h0 = _mm512_dpbusd_epi32(h0, _mm512_set1_epi32(a), W[k]);
                    h1 = _mm512_dpbusd_epi32(h1, _mm512_set1_epi32(c), W[k + 1]);
                }
                if (!l8)
                    for (int k = 0; k < 8; k += 2) {
                        int32_t e, f;
                        memcpy(&e, xr + 32 + 4 * k, 4), memcpy(&f, xr + 32 + 4 * k + 4, 4);
                        l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(e), W[k]);
                        l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(f), W[k + 1]);
                    }
                const __m512i hi = _mm512_sub_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), s15);
                const __m512i D = _mm512_add_epi32(hi, _mm512_add_epi32(l0, l1));
                acc[r] = lanes_block(acc[r], D, vd, vm, dx[r * nb + b], sx[r * nb + b], qt);
            }
        }
        const __mmask16 keep = g == KEPT_COLS ? (__mmask16)0xffff : (__mmask16)((1u << g) - 1);
#pragma GCC unroll 16
        for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(y + r * ldy + n, keep, acc[r]);
    }
}

#define KVQ_KEPT(MT)                                                                                            \
    static void kept_rows##MT(const uint8_t *xu, const float *dx, const float *sx, int64_t nb, int qt,          \
                              const uint8_t *kept, float *y, int64_t ldy, int64_t n0, int64_t n1) {            \
        if (qt == QT_Q4_1) kept_rows(xu, dx, sx, nb, QT_Q4_1, kept, y, ldy, n0, n1, MT);                       \
        else if (qt == QT_Q4_0) kept_rows(xu, dx, sx, nb, QT_Q4_0, kept, y, ldy, n0, n1, MT);                  \
        else if (qt == QT_Q5_0) kept_rows(xu, dx, sx, nb, QT_Q5_0, kept, y, ldy, n0, n1, MT);                  \
        else if (qt == QT_Q5_1) kept_rows(xu, dx, sx, nb, QT_Q5_1, kept, y, ldy, n0, n1, MT);                  \
        else if (qt == QT_IQ4_NL) kept_rows(xu, dx, sx, nb, QT_IQ4_NL, kept, y, ldy, n0, n1, MT);              \
        else kept_rows(xu, dx, sx, nb, QT_Q8_0, kept, y, ldy, n0, n1, MT);                                     \
    }
KVQ_KEPT(1)
KVQ_KEPT(2)
KVQ_KEPT(3)
KVQ_KEPT(4)
KVQ_KEPT(5)
KVQ_KEPT(6)
KVQ_KEPT(7)
KVQ_KEPT(8)
KVQ_KEPT(9)
KVQ_KEPT(10)
KVQ_KEPT(11)
KVQ_KEPT(12)
KVQ_KEPT(13)
KVQ_KEPT(14)
KVQ_KEPT(15)
KVQ_KEPT(16)
const kept_fn kvqi_kepts[MT_MAX + 1] = {NULL, kept_rows1, kept_rows2, kept_rows3, kept_rows4, kept_rows5,
                                     kept_rows6, kept_rows7, kept_rows8, kept_rows9, kept_rows10,
                                     kept_rows11, kept_rows12, kept_rows13, kept_rows14, kept_rows15,
                                     kept_rows16};

#else
const kept_fn kvqi_kepts[MT_MAX + 1] = {NULL};
#endif
