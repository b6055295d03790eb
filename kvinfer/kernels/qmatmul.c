/* Matmul y[M,N] = x[M,K] @ W[N,K]^T (+ bias) for float32 activations and weights kept as GGML Q4_0 / Q4_1 /
 * Q8_0 blocks, or as float32 / fp16 / bf16 rows.
 *
 * One arithmetic per output element, whatever M, the tile a row lands in, the thread count or the ISA level:
 * a row's result is a fixed sequence of IEEE operations on that row and the weights alone. That is what makes
 * a request's logits independent of what else shares its step (docs/ARCHITECTURE.md, "Exactness").
 *
 * Quantised weights (block layouts, 32 weights each, little-endian fp16 fields):
 *   Q4_0: d qs[16]    w = d * (q - 8)      Q4_1: d m qs[16]   w = d * q + m      Q8_0: d qs[32]   w = d * q
 * (4-bit: element i in the low nibble of qs[i], element i + 16 in its high nibble). Each x row is rounded per
 * 32-element block to int16 (x ~ dx * xq, |xq| <= 32767: relative error at most 1.5e-5 of the block's largest
 * |x|, 30x finer than fp16; llama.cpp rounds to 8 bits), so a block's dot product with the quants is exact
 * integer arithmetic, one int32 per block; it is scaled by d * dx and accumulated in float, block after block,
 * and Q4_1's minimum enters as m * sum(x_block) (the exact order: tile_q). Vectors hold 8 output columns (16 at
 * the AVX-512 level, one column per lane: tile_q_lanes); tiles of up to 8 rows (16 at the AVX-512 level) share
 * each decoded block (per row and 8 columns a block costs two vpmaddwd per column, reduced; at the AVX-512 level
 * one VNNI vpdpwssd per pair of elements for 16 columns at once, no reduction).
 * From AMX_MIN_ROWS (24) rows, on a CPU whose OS grants the AMX tile state, tile multiplies compute the same int32
 * per block (amx_rows), followed by the same float operations. One int32 per block instead of an 8-lane split of
 * it is what let the tiles in, and it is faster on the vector route too (docs/BENCHMARKS.md).
 * At the AVX-512 level a weight kept in tile layout (kvq_amx_tiles_pack) is read by both routes: the tiles, and
 * below them kept_rows, whose vpdpbusd multiplies the activations' two bytes by the quants as stored: again the
 * same int32 per block.
 *
 * Float weights: 8-lane FMAs over K into two accumulators (even / odd groups of 8), a sequential scalar tail.
 */
#include "ggml_blocks.h"
#include "kernels.h"
#include "simd.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
#if KVQ_LEVEL >= 2
#define MT_MAX 16 /* x rows per tile of quantised weights (a row holds one accumulator at this level) */
#else
#define MT_MAX 8 /* x rows per tile of quantised weights */
#endif
#define NG 8                         /* output columns per group: one 8-lane vector of results */
#define MF_MAX 4                     /* x rows per tile of float weights (2 accumulators each in registers) */
#define W_SLAB_BYTES (256 * 1024)    /* weight rows kept in L2 while successive row tiles revisit them */
#define MIN_BYTES_PER_THREAD (16 * 1024)
/* Weight bytes ahead of the block being read that a first pass over a slab asks the cache for. The hardware
 * prefetchers alone leave a one-row decode short (docs/BENCHMARKS.md). Later row tiles find the slab in L2 and
 * skip it. */
#define PREFETCH_BYTES 1024

static int block_bytes(int qt) {
    switch (qt) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    default: return 0;
    }
}

static int elem_bytes(int qt) { return qt == QT_F32 ? 4 : (qt == QT_F16 || qt == QT_BF16) ? 2 : 0; }

/* ---- quantised weights ---- */

/* Row r: xq int16 [nb * 32], dx its block scales, sx its exact float block sums. */
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
            round_i16_32(xb, amax > 0.0f ? 32767.0f / amax : 0.0f, xq + (r * nb + b) * QK);
            dx[r * nb + b] = amax / 32767.0f;
            sx[r * nb + b] = vf_hsum(s);
        }
}

void kvq_quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int16_t *xq, float *dx, float *sx) {
    quantize_rows(x, M, K, ldx, xq, dx, sx);
}

static inline q32 load_q(const uint8_t *blk, int qt) {
    if (qt == QT_Q8_0) return q32_from_q8(blk + 2);
    return q32_from_q4(blk + (qt == QT_Q4_1 ? 4 : 2), qt == QT_Q4_0 ? 8 : 0);
}

/* d (lanes) and Q4_1's m of the block at offset off of each of 8 weight rows (a tail group repeats its last). */
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

/* out[t], lane c: dword t (t = 0..3) of the 16 bytes at p[c] + off. */
static inline __attribute__((always_inline)) void dw_transpose16x4(const uint8_t *const *p, int64_t off,
                                                                   __m512i out[4]) {
    __m512i s[4];
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[4 * i] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[4 * i + 1] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[4 * i + 2] + off)), 2);
        s[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[4 * i + 3] + off)), 3);
    }
    /* s[i] dword 4k + t: column 4i + k's dword t. Lanes 0-7: dword t of columns 0-7 (or 8-15), lanes 8-15: t+1 */
    const __m512i i01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i i23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i ab01 = _mm512_permutex2var_epi32(s[0], i01, s[1]), ab23 = _mm512_permutex2var_epi32(s[0], i23, s[1]);
    const __m512i cd01 = _mm512_permutex2var_epi32(s[2], i01, s[3]), cd23 = _mm512_permutex2var_epi32(s[2], i23, s[3]);
    out[0] = _mm512_shuffle_i64x2(ab01, cd01, 0x44);
    out[1] = _mm512_shuffle_i64x2(ab01, cd01, 0xee);
    out[2] = _mm512_shuffle_i64x2(ab23, cd23, 0x44);
    out[3] = _mm512_shuffle_i64x2(ab23, cd23, 0xee);
}

/* R[j] (j = 0..15), lane c: elements 2j, 2j + 1 of column c's block as int16 (Q4: minus the offset). */
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
    const __m512i lo = _mm512_set1_epi16(15), o = _mm512_set1_epi16(qt == QT_Q4_0 ? 8 : 0);
    dw_transpose16x4(rows, off + (qt == QT_Q4_1 ? 4 : 2), y);
    for (int t = 0; t < 4; t++) {
        const __m512i a = _mm512_shuffle_epi8(y[t], sa), b = _mm512_shuffle_epi8(y[t], sb);
        R[2 * t] = _mm512_and_si512(a, lo);
        R[2 * t + 1] = _mm512_and_si512(b, lo);
        R[8 + 2 * t] = _mm512_srli_epi16(a, 4);
        R[9 + 2 * t] = _mm512_srli_epi16(b, 4);
        if (qt == QT_Q4_0)
            for (int i = 0; i < 2; i++) {
                R[2 * t + i] = _mm512_sub_epi16(R[2 * t + i], o);
                R[8 + 2 * t + i] = _mm512_sub_epi16(R[8 + 2 * t + i], o);
            }
    }
}

#define NG16 16

/* tile_q's float work on a block's exact int32 D, one column per lane: every 16-column route ends in this. */
static inline __attribute__((always_inline)) __m512 lanes_block(__m512 acc, __m512i D, __m512 vd, __m512 vm,
                                                                float dx, float sx, int qt) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D), _mm512_mul_ps(vd, _mm512_set1_ps(dx)), acc);
    if (qt == QT_Q4_1) acc = _mm512_fmadd_ps(vm, _mm512_set1_ps(sx), acc);
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
#define QNG NG16 /* output columns per group of the quantised route */
#else
#define QNG NG
/* Weight rows n0..n1 against MT quantised x rows, 8 output columns (one vector) at a time. The arithmetic of
 * y[r, n], the same whatever MT, the group n falls in, the thread or the level (the AMX route below included):
 *   acc = 0; for each block b in order:
 *     acc = fma(float(D_b), d_b * dx_b, acc)     D_b: the exact int32 dot product of the block's 32 quants with
 *                                                the row's 32 int16-rounded activations
 *     acc = fma(m_b, sx_b, acc)                  Q4_1 only: its minimum times the exact float sum of the block
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
                if (qt == QT_Q4_1) acc[r] = vf_fma(vm, vf_set1(sx[r * nb + b]), acc[r]);
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

typedef void (*tile_q_fn)(const int16_t *, const float *, const float *, int64_t, const uint8_t *, int64_t, int,
                          float *, int64_t, int64_t, int64_t, int);
#define KVQ_TILE_Q(MT)                                                                                          \
    static void tile_q##MT(const int16_t *xq, const float *dx, const float *sx, int64_t nb, const uint8_t *w,   \
                           int64_t ldw, int qt, float *y, int64_t ldy, int64_t n0, int64_t n1, int pf) {       \
        if (qt == QT_Q4_1) tile_q(xq, dx, sx, nb, w, ldw, QT_Q4_1, y, ldy, n0, n1, pf, MT);                    \
        else if (qt == QT_Q4_0) tile_q(xq, dx, sx, nb, w, ldw, QT_Q4_0, y, ldy, n0, n1, pf, MT);               \
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
static const tile_q_fn tiles_q[MT_MAX + 1] = {NULL, tile_q1, tile_q2, tile_q3, tile_q4, tile_q5, tile_q6,
                                              tile_q7, tile_q8, tile_q9, tile_q10, tile_q11, tile_q12,
                                              tile_q13, tile_q14, tile_q15, tile_q16};
#else
static const tile_q_fn tiles_q[MT_MAX + 1] = {NULL, tile_q1, tile_q2, tile_q3, tile_q4,
                                              tile_q5, tile_q6, tile_q7, tile_q8};
#endif

/* ---- float weights ---- */

static inline vf load_w8(const uint8_t *row, int64_t k, int qt) {
    if (qt == QT_F32) return vf_load((const float *)row + k);
    if (qt == QT_BF16) return vf_load_bf16((const uint16_t *)row + k);
    return vf_load_half((const uint16_t *)row + k);
}

static inline float load_w1(const uint8_t *row, int64_t k, int qt) {
    if (qt == QT_F32) return ((const float *)row)[k];
    uint16_t h = ((const uint16_t *)row)[k];
    return qt == QT_BF16 ? kvq_bf16(h) : kvq_half(h);
}

static inline __attribute__((always_inline)) void tile_f(const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                                                         int64_t ldw, int qt, float *y, int64_t ldy, int64_t n0,
                                                         int64_t n1, const int MT) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wrow = w + n * ldw;
        vf acc[MF_MAX][2];
        float tail[MF_MAX];
        for (int r = 0; r < MT; r++) acc[r][0] = acc[r][1] = vf_zero(), tail[r] = 0.0f;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) { /* even groups of 8 into acc[r][0], odd ones into acc[r][1] */
            const vf w0 = load_w8(wrow, k, qt), w1 = load_w8(wrow, k + 8, qt);
            for (int r = 0; r < MT; r++) {
                acc[r][0] = vf_fma(w0, vf_load(x + r * ldx + k), acc[r][0]);
                acc[r][1] = vf_fma(w1, vf_load(x + r * ldx + k + 8), acc[r][1]);
            }
        }
        if (k + 8 <= K) {
            const vf w0 = load_w8(wrow, k, qt);
            for (int r = 0; r < MT; r++) acc[r][0] = vf_fma(w0, vf_load(x + r * ldx + k), acc[r][0]);
            k += 8;
        }
        for (; k < K; k++) {
            const float wk = load_w1(wrow, k, qt);
            for (int r = 0; r < MT; r++) tail[r] = fmaf(wk, x[r * ldx + k], tail[r]);
        }
        for (int r = 0; r < MT; r++) y[r * ldy + n] = vf_hsum(vf_add(acc[r][0], acc[r][1])) + tail[r];
    }
}

typedef void (*tile_f_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, int, float *, int64_t, int64_t,
                          int64_t);
/* NAME: KERNEL (tile_f, tile_f16) for MT rows, one compiled copy per float weight type */
#define KVQ_FLOAT_TILE(NAME, KERNEL, MT)                                                                        \
    static void NAME(const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t ldw, int qt, float *y,   \
                     int64_t ldy, int64_t n0, int64_t n1) {                                                    \
        if (qt == QT_F32) KERNEL(x, ldx, K, w, ldw, QT_F32, y, ldy, n0, n1, MT);                               \
        else if (qt == QT_BF16) KERNEL(x, ldx, K, w, ldw, QT_BF16, y, ldy, n0, n1, MT);                        \
        else KERNEL(x, ldx, K, w, ldw, QT_F16, y, ldy, n0, n1, MT);                                            \
    }
#if KVQ_LEVEL < 2 /* (the AVX-512 level runs tile_f16 below: tile_f's arithmetic, 16 lanes) */
#define KVQ_TILE_F(MT) KVQ_FLOAT_TILE(tile_f##MT, tile_f, MT)
KVQ_TILE_F(1)
KVQ_TILE_F(2)
KVQ_TILE_F(3)
KVQ_TILE_F(4)
static const tile_f_fn tiles_f[MF_MAX + 1] = {NULL, tile_f1, tile_f2, tile_f3, tile_f4};
#endif

#if KVQ_LEVEL >= 2
/* tile_f at the AVX-512 level: a column's two 8-lane accumulators side by side in one register (lanes 0-7 the even
 * groups of 8, lanes 8-15 the odd ones), so one FMA does what tile_f's two do, and two output columns at a time
 * share each row's loads. Each lane runs tile_f's operations in tile_f's order, then the halves are added and
 * summed as there: the same bits, on up to MF16_MAX rows (2 * MT accumulators in registers). The float32 weights
 * of a safetensors model, prefill-sized (Intel Xeon, 2 threads, smollm2-135m's matmuls at 512 rows): see docs/BENCHMARKS.md, "Float weights". */
#define MF16_MAX 8

static inline __m512 load_w16(const uint8_t *row, int64_t k, int qt) {
    if (qt == QT_F32) return _mm512_loadu_ps((const float *)row + k);
    if (qt == QT_BF16) return v16_load_bf16((const uint16_t *)row + k);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k)));
}

static inline __attribute__((always_inline)) void tile_f16(const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                                                           int64_t ldw, int qt, float *y, int64_t ldy, int64_t n0,
                                                           int64_t n1, const int MT) {
    for (int64_t n = n0; n < n1; n += 2) {
        const int two = n + 1 < n1; /* an odd last column: computed twice, stored once */
        const uint8_t *wr[2] = {w + n * ldw, w + (n + two) * ldw};
        __m512 acc[MF16_MAX][2];
        float tail[MF16_MAX][2];
#pragma GCC unroll 8
        for (int r = 0; r < MT; r++)
            acc[r][0] = acc[r][1] = _mm512_setzero_ps(), tail[r][0] = tail[r][1] = 0.0f;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m512 w0 = load_w16(wr[0], k, qt), w1 = load_w16(wr[1], k, qt);
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
                __asm__("" : "+v"(xv)); /* one load for both columns' FMAs (GCC would fold it into each, slower) */
                acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
            }
        }
        if (k + 8 <= K) { /* one more group of 8: the even accumulator (the low lanes) alone */
            const __m512 w0 = _mm512_zextps256_ps512(load_w8(wr[0], k, qt));
            const __m512 w1 = _mm512_zextps256_ps512(load_w8(wr[1], k, qt));
            for (int r = 0; r < MT; r++) {
                const __m512 xv = _mm512_zextps256_ps512(vf_load(x + r * ldx + k));
                acc[r][0] = _mm512_mask3_fmadd_ps(w0, xv, acc[r][0], 0x00ff);
                acc[r][1] = _mm512_mask3_fmadd_ps(w1, xv, acc[r][1], 0x00ff);
            }
            k += 8;
        }
        for (; k < K; k++) {
            const float w0 = load_w1(wr[0], k, qt), w1 = load_w1(wr[1], k, qt);
            for (int r = 0; r < MT; r++) {
                tail[r][0] = fmaf(w0, x[r * ldx + k], tail[r][0]);
                tail[r][1] = fmaf(w1, x[r * ldx + k], tail[r][1]);
            }
        }
        /* vf_hsum(lo + hi) + tail of 8 accumulators at a time (a transpose-add, not 8 horizontal sums) */
        for (int i0 = 0; i0 < 2 * MT; i0 += 8) {
            __m512 z[8];
            float t8[8], s8[8];
            for (int i = 0; i < 8; i++) {
                const int live = i0 + i < 2 * MT;
                z[i] = live ? acc[(i0 + i) / 2][(i0 + i) % 2] : _mm512_setzero_ps();
                t8[i] = live ? tail[(i0 + i) / 2][(i0 + i) % 2] : 0.0f;
            }
            vf_store(s8, vf_add(hsum_pairs8(z), vf_load(t8)));
            for (int i = 0; i < 8 && i0 + i < 2 * MT; i++)
                if ((i0 + i) % 2 <= two) y[(i0 + i) / 2 * ldy + n + (i0 + i) % 2] = s8[i];
        }
    }
}

#define KVQ_TILE_F16(MT) KVQ_FLOAT_TILE(tile_f16_##MT, tile_f16, MT)
KVQ_TILE_F16(1)
KVQ_TILE_F16(2)
KVQ_TILE_F16(3)
KVQ_TILE_F16(4)
KVQ_TILE_F16(5)
KVQ_TILE_F16(6)
KVQ_TILE_F16(7)
KVQ_TILE_F16(8)
static const tile_f_fn tiles_f16[MF16_MAX + 1] = {NULL, tile_f16_1, tile_f16_2, tile_f16_3, tile_f16_4,
                                                  tile_f16_5, tile_f16_6, tile_f16_7, tile_f16_8};
#endif

struct job {
    const float *x, *bias;
    const uint8_t *w;
    float *y;
    int64_t M, K, ldx, N, ldw, ldy;
    int qt;
    const int16_t *xq;
    const float *dx, *sx;
    const uint8_t *xu, *kept; /* kept_rows' activation bytes and the weight's kept copy, or NULL */
};

/* The int16 activations as kept_rows reads them: per row and block, 32 bytes hi + 128, then 32 bytes lo. */
void kvq_split_bytes(const int16_t *xq, int64_t M, int64_t K, uint8_t *xu) {
    for (int64_t i = 0; i < M * K; i += QK)
        for (int e = 0; e < QK; e++) {
            xu[2 * i + e] = (uint8_t)((xq[i + e] >> 8) + 128);
            xu[2 * i + QK + e] = (uint8_t)(xq[i + e] & 0xff);
        }
}

/* ---- kept copies: the registry (every level) ---- */
#define AMX_KEPT_MAX 4096
static struct amx_kept {
    const uint8_t *w, *tiles;
    int64_t N, K, ldw;
    int qt;
} amx_kept[AMX_KEPT_MAX];
static int amx_nkept;
static pthread_mutex_t amx_kept_lock = PTHREAD_MUTEX_INITIALIZER;

/* tiles != NULL: matmuls of w (N x K, ldw, qt) read their tiles from it (kvq_amx_tiles_pack's output, kept alive
 * by the caller until it registers NULL for w). Every level keeps the registry; which types have a kept layout
 * depends on the level (kvq_amx_tiles_bytes). */
int kvq_amx_tiles_register(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, const uint8_t *tiles) {
    int rc = KVQ_OK;
    pthread_mutex_lock(&amx_kept_lock);
    int i = 0;
    while (i < amx_nkept && amx_kept[i].w != w) i++;
    if (!tiles) {
        if (i < amx_nkept) {
            amx_kept[i] = amx_kept[amx_nkept - 1];
            __atomic_store_n(&amx_nkept, amx_nkept - 1, __ATOMIC_RELAXED);
        }
    } else if (i == AMX_KEPT_MAX) {
        rc = KVQ_ENOMEM;
    } else {
        amx_kept[i] = (struct amx_kept){w, tiles, N, K, ldw, qt};
        if (i == amx_nkept) __atomic_store_n(&amx_nkept, amx_nkept + 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&amx_kept_lock);
    return rc;
}

const uint8_t *kvq_kept_lookup(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt) {
    if (__atomic_load_n(&amx_nkept, __ATOMIC_RELAXED) == 0) return NULL;
    const uint8_t *t = NULL;
    pthread_mutex_lock(&amx_kept_lock);
    for (int i = 0; i < amx_nkept; i++)
        if (amx_kept[i].w == w) {
            const struct amx_kept *e = &amx_kept[i];
            if (e->N == N && e->K == K && e->ldw == ldw && e->qt == qt) t = e->tiles;
            break;
        }
    pthread_mutex_unlock(&amx_kept_lock);
    return t;
}


/* ---- AMX tiles (the avx512 level, when the OS grants the tile state): the same D_b, 16 rows x 32 columns ----
 * A tile multiply takes int8 operands, so each int16 activation is split exactly, x = 256 * hi + lo (hi signed,
 * lo unsigned): D_b = 256 * (hi . q) + (lo . q), two tile products per block, both exact in int32 and so is
 * their sum. The float work after it is tile_q's, operation for operation, 16 lanes at a time (each lane its own
 * IEEE operations, so the width is not part of the result). Used from AMX_MIN_ROWS rows (below it the vector
 * route was faster end to end). */
#if KVQ_LEVEL >= 2 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVQ_HAVE_AMX 1
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
/* Tiles vs vectors, end to end: the vector route won up to 20 sequences, the tiles drew at 24 and won at 32
 * (docs/BENCHMARKS.md, "Figures behind code decisions"). */
#define AMX_MIN_ROWS 24
#define AMX_COLS 32 /* output columns per pass: two 16-column tiles */

static int amx_on;

/* on = 1: use the tiles if the OS grants their state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0: do
 * not; -1: change nothing. Returns whether they are used (process-wide). */
int kvq_amx_enable(int on) {
    if (on >= 0) amx_on = on && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_on;
}

int kvq_amx_min_rows(void) { return AMX_MIN_ROWS; }

static void amx_config(void) {
    struct kvq_tile_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64; /* C: hi / lo products of column tiles 0, 1 */
    for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = 32; /* A: hi / lo bytes of 16 rows' block */
    for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64;  /* B: one block of 16 columns, VNNI layout */
    _tile_loadconfig(&c);
}

/* Row k (k = 0..3) of a B tile gets dword k of 4 consecutive columns' a, b, c, e: a 4 x 4 dword transpose. */
static inline void amx_put4(__m128i a, __m128i b, __m128i c, __m128i e, int8_t *dst) {
    const __m128i t0 = _mm_unpacklo_epi32(a, b), t1 = _mm_unpackhi_epi32(a, b);
    const __m128i t2 = _mm_unpacklo_epi32(c, e), t3 = _mm_unpackhi_epi32(c, e);
    _mm_storeu_si128((__m128i *)dst, _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(dst + 64), _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(dst + 128), _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128((__m128i *)(dst + 192), _mm_unpackhi_epi64(t1, t3));
}

/* Columns c0..c1 (at most AMX_COLS) of W as tile operands: bt[b][t][k][4 * col + i] = q(c0 + 16 t + col, 32 b +
 * 4 k + i), and their d, m as floats; columns past c1 are zeros. */
static void amx_pack(const uint8_t *w, int64_t ldw, int qt, int64_t nb, int64_t c0, int64_t c1, int8_t *bt,
                     float *d, float *m) {
    const int bb = block_bytes(qt), qoff = qt == QT_Q4_1 ? 4 : 2;
    const int64_t nc = c1 - c0;
    const __m128i mask = _mm_set1_epi8(15), eight = _mm_set1_epi8(qt == QT_Q4_0 ? 8 : 0);
    for (int o8 = 0; o8 < AMX_COLS / 8; o8++) { /* 8 columns at a time: two 4 x 4 transposes, d and m as vectors */
        const int64_t cb = 8 * o8;
        const int full = cb + 8 <= nc;
        const uint8_t *row[8];
        for (int u = 0; u < 8; u++) row[u] = w + (cb + u < nc ? c0 + cb + u : c0) * ldw;
        int8_t *dst0 = bt + (o8 / 2) * 8 * 64 + (o8 % 2) * 32;
        for (int64_t b = 0; b < nb; b++) {
            __m128i lo[8], hi[8];
            for (int u = 0; u < 8; u++) {
                const uint8_t *blk = row[u] + b * bb;
                if (!full && cb + u >= nc) {
                    lo[u] = hi[u] = _mm_setzero_si128();
                } else if (qt == QT_Q8_0) {
                    lo[u] = _mm_loadu_si128((const __m128i *)(blk + 2));
                    hi[u] = _mm_loadu_si128((const __m128i *)(blk + 18));
                } else {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + qoff));
                    lo[u] = _mm_sub_epi8(_mm_and_si128(v, mask), eight);
                    hi[u] = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight);
                }
            }
            float *db = d + b * AMX_COLS + cb, *mb = m + b * AMX_COLS + cb;
            if (full) {
                vf vd, vm;
                vf_load_half2_strided(row[0] + b * bb, (int)ldw, &vd, &vm); /* F16C: exact, as kvq_half */
                vf_store(db, vd);
                if (qt == QT_Q4_1) vf_store(mb, vm);
            } else {
                for (int u = 0; u < 8; u++) {
                    const int live = cb + u < nc;
                    db[u] = live ? _cvtsh_ss(kvq_rd16(row[u] + b * bb)) : 0.0f;
                    mb[u] = live && qt == QT_Q4_1 ? _cvtsh_ss(kvq_rd16(row[u] + b * bb + 2)) : 0.0f;
                }
            }
            int8_t *dst = dst0 + b * 2 * 8 * 64;
            amx_put4(lo[0], lo[1], lo[2], lo[3], dst);
            amx_put4(lo[4], lo[5], lo[6], lo[7], dst + 16);
            amx_put4(hi[0], hi[1], hi[2], hi[3], dst + 4 * 64);
            amx_put4(hi[4], hi[5], hi[6], hi[7], dst + 4 * 64 + 16);
        }
    }
}

/* ---- weights kept in tile layout ----
 * Unpacking a pass of weights costs about a third of a 16-row matmul, every call. A weight may instead be
 * unpacked once (kvq_amx_tiles_pack) and registered under its address; its matmuls then read that copy: the AMX
 * route loads its tiles straight from it, and below AMX_MIN_ROWS (or with the tiles off) the vector route's
 * kept_rows reads it instead of transposing the GGML blocks. Per 16 output columns (a group, kept_group_bytes
 * apart): a plane of quants, block after block (kept_quants: Q8_0 as 8 rows of 64 bytes, row k holding quants
 * 32 b + 4 k + i of each column; 4-bit types as the GGML nibbles, 4 rows), then the blocks' d of the 16 columns
 * as fp16 bits, then (Q4_1) their m. That is the GGML bytes' size (Q8_0: 544 per block of 16 columns, Q4_1:
 * 320), so a one-row decode reads no more than from the GGML rows. Same quants into the same exact integer
 * products: same results (the gain: docs/BENCHMARKS.md, "Figures behind code decisions"). */
#define KEPT_COLS 16
static int kept_qbytes(int qt) { return qt == QT_Q8_0 ? 8 * 64 : 4 * 64; } /* quants of a block of 16 columns */
static int64_t kept_group_bytes(int64_t nb, int qt) {
    const int64_t b = nb * (kept_qbytes(qt) + KEPT_COLS * 2 * (qt == QT_Q4_1 ? 2 : 1));
    return (b + 63) / 64 * 64;
}

/* Block b's quants of a kept group as 8 rows of 64 signed bytes (row k: quants 4k..4k+3 of each column). A 4-bit
 * group keeps the GGML nibbles, row k (k < 4) holding the 4 bytes 4k..4k+3 of each column's block: low nibbles are
 * quants 4k.., high nibbles quants 16 + 4k... */
static inline __attribute__((always_inline)) void kept_quants(const uint8_t *gq, int64_t b, int qt, __m512i W[8]) {
    if (qt == QT_Q8_0) {
        for (int k = 0; k < 8; k++) W[k] = _mm512_load_si512(gq + b * 512 + 64 * k);
        return;
    }
    const __m512i lo = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    for (int k = 0; k < 4; k++) {
        const __m512i v = _mm512_load_si512(gq + b * 256 + 64 * k);
        W[k] = _mm512_and_si512(v, lo);
        W[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
        if (qt == QT_Q4_0) W[k] = _mm512_sub_epi8(W[k], eight), W[k + 4] = _mm512_sub_epi8(W[k + 4], eight);
    }
}

int64_t kvq_amx_tiles_bytes(int64_t N, int64_t K, int qt) {
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
        int8_t *bt = NULL; /* Q8_0 only: amx_pack's transposed bytes (4-bit groups keep the GGML nibbles) */
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
            if (qt == QT_Q8_0) amx_pack(w, ldw, qt, nb, c0, c1, bt, d, m);
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
                        dw_transpose16x4(rows, b * bb + (qt == QT_Q4_1 ? 4 : 2), y);
                        for (int k = 0; k < 4; k++) _mm512_store_si512(g + b * 256 + 64 * k, y[k]);
                    }
                    for (int c = 0; c < KEPT_COLS; c++) {
                        const int live = c0 + KEPT_COLS * t + c < N;
                        dh[b * KEPT_COLS + c] = live ? kvq_rd16(rows[c] + b * bb) : 0;
                        if (qt == QT_Q4_1) mh[b * KEPT_COLS + c] = live ? kvq_rd16(rows[c] + b * bb + 2) : 0;
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
    if (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0) return KVQ_EBADTYPE;
    if (K <= 0 || K % QK || N <= 0) return KVQ_EBADSHAPE;
    const int64_t nb = K / QK, gb = kept_group_bytes(nb, qt), bb = block_bytes(qt), qo = qt == QT_Q4_1 ? 4 : 2;
    const int qb = kept_qbytes(qt), nrows = qb / 64; /* 8 rows of quants (Q8_0) or 4 of nibble pairs */
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= N) return KVQ_EBADSHAPE;
        const uint8_t *gq = kept + ids[i] / KEPT_COLS * gb;
        const uint16_t *dh = (const uint16_t *)(gq + nb * kept_qbytes(qt)), *mh = dh + nb * KEPT_COLS;
        const int64_t u = ids[i] % KEPT_COLS;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + i * ldo + b * bb;
            for (int k = 0; k < nrows; k++) memcpy(o + qo + 4 * k, gq + b * qb + 64 * k + 4 * u, 4);
            memcpy(o, dh + b * KEPT_COLS + u, 2);
            if (qt == QT_Q4_1) memcpy(o + 2, mh + b * KEPT_COLS + u, 2);
        }
    }
    return KVQ_OK;
}

static const uint8_t *amx_kept_tiles(const struct job *j) { return kvq_kept_lookup(j->w, j->N, j->K, j->ldw, j->qt); }

/* A thread's AMX scratch (the operands of a span of its column passes), kept between calls: a fresh allocation of
 * this size is a fresh mapping, whose page faults cost more than the multiplies of a small matmul. At most
 * AMX_SCRATCH_BYTES (plus the passes' pointers) per thread, so the span stays in L2 and a large model's biggest
 * weight does not grow it. */
#define AMX_SCRATCH_BYTES (1536 * 1024)
static uint8_t *amx_scratch(size_t n) {
    static __thread uint8_t *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        cap = (n + 65535) / 65536 * 65536;
        buf = (uint8_t *)aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}

/* Output columns n0..n1 (n0 a multiple of AMX_COLS) of all M rows; xh / xl: the activations' split bytes, [M
 * rounded up to 16][K]; kept: the weight in tile layout, or NULL to unpack each pass here.
 * The passes' operands are unpacked first (all of them, or a span that fits the scratch; the same work as one
 * pass at a time), then each 16-row group of x (its bytes stay in L1) meets every pass of the span, and a block's
 * float work runs while the next block multiplies. This order beat pass after pass over all rows, with 4
 * blocks' products stored before their float work, at every row count measured (docs/BENCHMARKS.md). perf put
 * the old order's stalls on the tile loads of
 * x from L2; tile multiplies and the float work hardly overlap either way (a loop of both takes about the sum of
 * each alone). */
static inline __attribute__((always_inline)) int amx_rows_t(const struct job *j, const int8_t *xh,
                                                           const uint8_t *xl, int64_t n0, int64_t n1,
                                                           const uint8_t *kept, const int KEPT, const int Q41) {
    const int64_t nb = j->K / QK, K = j->K;
    const int64_t P = (n1 - n0 + AMX_COLS - 1) / AMX_COLS;
    const int direct = KEPT && j->qt == QT_Q8_0; /* tiles loaded straight from the kept copy, no bt */
    /* passes unpacked at a time: their operands fit AMX_SCRATCH_BYTES (a large weight goes in spans of passes) */
    const size_t pass_bytes = (direct ? 0 : (size_t)nb * 2 * 8 * 64) + 2 * sizeof(float) * (size_t)nb * AMX_COLS;
    int64_t PC = (int64_t)(AMX_SCRATCH_BYTES / pass_bytes);
    PC = PC < 1 ? 1 : PC > P ? P : PC;
    const size_t btb = direct ? 0 : (size_t)(PC * nb * 2 * 8 * 64), fb = sizeof(float) * (size_t)(PC * nb * AMX_COLS);
    uint8_t *scr = amx_scratch(btb + 2 * fb + sizeof(void *) * (size_t)(2 * PC));
    if (!scr) return KVQ_ENOMEM;
    int8_t *bt = direct ? NULL : (int8_t *)scr;
    float *d = (float *)(scr + btb), *m = (float *)(scr + btb + fb);
    const uint8_t **gp = (const uint8_t **)(scr + btb + 2 * fb);
    static const int8_t zeros[8 * 64] __attribute__((aligned(64)));
    const int64_t gb = kept_group_bytes(nb, j->qt);
    int32_t cbuf[2][4][16][16] __attribute__((aligned(64))); /* block b's products, read while b + 1's multiply */
    __m512 acc[16][2];
    amx_config();
    for (int64_t q0 = 0; q0 < P; q0 += PC) {
        const int64_t q1 = q0 + PC < P ? q0 + PC : P;
        for (int64_t p = q0; p < q1; p++) {
            const int64_t c0 = n0 + p * AMX_COLS, c1 = c0 + AMX_COLS < n1 ? c0 + AMX_COLS : n1;
            const uint8_t **g = gp + 2 * (p - q0);
            int8_t *btp = bt ? bt + (p - q0) * nb * 2 * 8 * 64 : NULL;
            float *dp = d + (p - q0) * nb * AMX_COLS, *mp = m + (p - q0) * nb * AMX_COLS;
            g[0] = g[1] = NULL; /* the kept groups of this pass's two tiles (NULL: past N, zeros) */
            if (KEPT) { /* d, m as floats (F16C: exact, as kvq_half); 4-bit quants as bytes */
                g[0] = kept + c0 / KEPT_COLS * gb;
                if (c0 + KEPT_COLS < j->N) g[1] = g[0] + gb;
                for (int t = 0; t < 2; t++) {
                    const uint16_t *dh = g[t] ? (const uint16_t *)(g[t] + nb * kept_qbytes(j->qt)) : NULL;
                    for (int64_t b = 0; b < nb; b++) {
                        __m512 vd = _mm512_setzero_ps(), vm = vd;
                        if (dh) vd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(dh + b * KEPT_COLS)));
                        if (dh && Q41)
                            vm = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(dh + (nb + b) * KEPT_COLS)));
                        _mm512_store_ps(dp + b * AMX_COLS + 16 * t, vd);
                        _mm512_store_ps(mp + b * AMX_COLS + 16 * t, vm);
                        if (!direct) {
                            __m512i W[8];
                            if (g[t]) kept_quants(g[t], b, j->qt, W);
                            for (int k = 0; k < 8; k++)
                                _mm512_store_si512(btp + (b * 2 + t) * 8 * 64 + 64 * k,
                                                   g[t] ? W[k] : _mm512_setzero_si512());
                        }
                    }
                }
            } else {
                amx_pack(j->w, j->ldw, j->qt, nb, c0, c1, btp, dp, mp);
            }
        }
        for (int64_t r0 = 0; r0 < j->M; r0 += 16) {
            const int rows = j->M - r0 < 16 ? (int)(j->M - r0) : 16;
            for (int64_t p = q0; p < q1; p++) {
                const int64_t c0 = n0 + p * AMX_COLS, c1 = c0 + AMX_COLS < n1 ? c0 + AMX_COLS : n1;
                const uint8_t **g = gp + 2 * (p - q0);
                const int8_t *btp = bt ? bt + (p - q0) * nb * 2 * 8 * 64 : NULL;
                const float *dp = d + (p - q0) * nb * AMX_COLS, *mp = m + (p - q0) * nb * AMX_COLS;
                for (int r = 0; r < 16; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
                for (int64_t b = 0; b <= nb; b++) {
                    if (b < nb) {
                        const int i = (int)(b & 1);
                        const int8_t *b0t = btp + (b * 2) * 8 * 64, *b1t = btp + (b * 2 + 1) * 8 * 64;
                        if (direct)
                            b0t = (const int8_t *)g[0] + b * 512, b1t = g[1] ? (const int8_t *)g[1] + b * 512 : zeros;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        _tile_loadd(4, xh + r0 * K + b * QK, K);
                        _tile_loadd(5, xl + r0 * K + b * QK, K);
                        _tile_loadd(6, b0t, 64);
                        _tile_loadd(7, b1t, 64);
                        _tile_dpbssd(0, 4, 6);
                        _tile_dpbusd(1, 5, 6);
                        _tile_dpbssd(2, 4, 7);
                        _tile_dpbusd(3, 5, 7);
                        _tile_stored(0, cbuf[i][0], 64); /* tile numbers are immediates */
                        _tile_stored(1, cbuf[i][1], 64);
                        _tile_stored(2, cbuf[i][2], 64);
                        _tile_stored(3, cbuf[i][3], 64);
                    }
                    if (b > 0) {
                        const int64_t bp = b - 1;
                        const int i = (int)(bp & 1);
                        for (int r = 0; r < rows; r++) {
                            const int64_t xb = (r0 + r) * nb + bp;
                            const __m512 sdx = _mm512_set1_ps(j->dx[xb]);
                            for (int t = 0; t < 2; t++) {
                                const __m512i hi = _mm512_load_si512(cbuf[i][2 * t][r]);
                                const __m512i lo = _mm512_load_si512(cbuf[i][2 * t + 1][r]);
                                const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
                                const __m512 sc = _mm512_mul_ps(_mm512_load_ps(dp + bp * AMX_COLS + 16 * t), sdx);
                                acc[r][t] = _mm512_fmadd_ps(f, sc, acc[r][t]);
                                if (Q41)
                                    acc[r][t] = _mm512_fmadd_ps(_mm512_load_ps(mp + bp * AMX_COLS + 16 * t),
                                                                _mm512_set1_ps(j->sx[xb]), acc[r][t]);
                            }
                        }
                    }
                }
                for (int r = 0; r < rows; r++) {
                    float out[AMX_COLS] __attribute__((aligned(64)));
                    _mm512_store_ps(out, acc[r][0]), _mm512_store_ps(out + 16, acc[r][1]);
                    float *yr = j->y + (r0 + r) * j->ldy;
                    for (int64_t n = c0; n < c1; n++) yr[n] = j->bias ? out[n - c0] + j->bias[n] : out[n - c0];
                }
            }
        }
    }
    _tile_release();
    return KVQ_OK;
}

static int amx_rows(const struct job *j, const int8_t *xh, const uint8_t *xl, int64_t n0, int64_t n1,
                    const uint8_t *kept) {
    if (j->qt == QT_Q4_1)
        return kept ? amx_rows_t(j, xh, xl, n0, n1, kept, 1, 1) : amx_rows_t(j, xh, xl, n0, n1, NULL, 0, 1);
    return kept ? amx_rows_t(j, xh, xl, n0, n1, kept, 1, 0) : amx_rows_t(j, xh, xl, n0, n1, NULL, 0, 0);
}

/* Splits the int16 activations into their tile bytes and runs amx_rows on whole column passes per thread. */
static int amx_matmul(const struct job *j, int16_t *xq, float *dx, float *sx, int nt, const uint8_t *kept) {
    const int64_t Mp = (j->M + 15) / 16 * 16, K = j->K;
    int8_t *xh = (int8_t *)aligned_alloc(64, (size_t)(Mp * K));
    uint8_t *xl = (uint8_t *)aligned_alloc(64, (size_t)(Mp * K));
    if (!xh || !xl) {
        free(xh), free(xl);
        return KVQ_ENOMEM;
    }
    memset(xh + j->M * K, 0, (size_t)((Mp - j->M) * K)), memset(xl + j->M * K, 0, (size_t)((Mp - j->M) * K));
    const int64_t passes = (j->N + AMX_COLS - 1) / AMX_COLS, nb = K / QK;
    if (nt > passes) nt = (int)passes;
    int rc = KVQ_OK;
#pragma omp parallel num_threads(nt > 1 ? nt : 1)
    {
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        const int64_t r0 = j->M * tid / nth, r1 = j->M * (tid + 1) / nth; /* this thread's rows of x */
        quantize_rows(j->x + r0 * j->ldx, r1 - r0, K, j->ldx, xq + r0 * K, dx + r0 * nb, sx + r0 * nb);
        for (int64_t i = r0 * K; i < r1 * K; i++) xh[i] = (int8_t)(xq[i] >> 8), xl[i] = (uint8_t)(xq[i] & 0xff);
#pragma omp barrier
        const int64_t e = passes * (tid + 1) / nth * AMX_COLS;
        const int r = amx_rows(j, xh, xl, passes * tid / nth * AMX_COLS, e < j->N ? e : j->N, kept);
        if (r)
#pragma omp atomic write
            rc = r;
    }
    free(xh), free(xl);
    return rc;
}

/* ---- prompt rows on AMX bfloat16 tiles (kvq_matmul_prompt) ----
 * The engine may compute a prompt's rows by another route than generated tokens' rows, chosen by the row's role
 * (its position against the prompt's length), never by the batch: here each weight of a kept copy is widened
 * to the dequantizer's float (Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m: a multiply, then an add) and rounded
 * to bfloat16 (to nearest even), each activation too, and tdpbf16ps sums 32 K values per instruction into float
 * tiles, block after block in K order. A row's result depends on its own values only (whatever M, its place in
 * a tile or the thread count: threads split the columns), so a prompt row gets the same bits whatever else is
 * computed with it; but tdpbf16ps's rounding is the hardware's own (no order of float32 operations matched it on
 * the Intel Xeon this was written on), so the bits are this CPU's. One tile store per 16 x 16 outputs instead of
 * one per block is what makes it faster than the int8 tiles' route. */
static int amx_bf16_on;

int kvq_amx_bf16_enable(int on) {
    unsigned a = 0, b = 0, c = 0, d = 0, a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (on >= 0) {
        const int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
        amx_bf16_on = on && amx_on && ok && ((d >> 22) & 1) && ((a1 >> 5) & 1); /* AMX-BF16, AVX512_BF16 */
    }
    return amx_bf16_on;
}

#define BF16P_SPAN_BYTES (256 * 1024) /* packed weights per span of passes (1.5 MiB was slower once, 1 MiB alike) */
#define BF16P_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl")))

static void bf16p_config(void) BF16P_TARGET;
static void bf16p_config(void) {
    struct kvq_tile_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64; /* C 0-3, A 4-5 (32 bf16 of 16 rows), B 6-7 */
    _tile_loadconfig(&c);
}

/* Columns of one kept group (16, one per lane) as bfloat16 B tiles: bt[b][r][2 c + i] = w(col c, K 32 b + 2 r + i).
 * g NULL: zeros (columns past N). */
BF16P_TARGET static inline void bf16p_pair(__m512 lo, __m512 hi, __m512i idx, uint16_t *dst) {
    const __m512i t = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* [K even x16, K odd x16] */
    _mm512_store_si512(dst, _mm512_permutexvar_epi16(idx, t));
}

BF16P_TARGET static inline __attribute__((always_inline)) void bf16p_pack_t(const uint8_t *g, int64_t nb, const int qt,
                                                                         uint16_t *bt) {
    if (!g) {
        memset(bt, 0, (size_t)nb * 512 * sizeof(uint16_t));
        return;
    }
    const uint16_t *dh = (const uint16_t *)(g + nb * kept_qbytes(qt)), *mh = dh + nb * KEPT_COLS;
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i m15 = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(qt == QT_Q4_0 ? 8 : 0);
    for (int64_t b = 0; b < nb; b++) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dh + b * KEPT_COLS)));
        uint16_t *o = bt + b * 512;
        if (qt == QT_Q8_0) {
            for (int k = 0; k < 8; k++) { /* dword c: quants 4k..4k+3 of col c -> rows 2k, 2k + 1 */
                const __m512i v = _mm512_load_si512(g + b * 512 + 64 * k);
                __m512 w[4];
                for (int i = 0; i < 4; i++)
                    w[i] = _mm512_mul_ps(
                        d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24)));
                bf16p_pair(w[0], w[1], idx, o + 32 * (2 * k));
                bf16p_pair(w[2], w[3], idx, o + 32 * (2 * k + 1));
            }
        } else {
            const __m512 m = qt == QT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mh + b * KEPT_COLS)))
                                           : _mm512_setzero_ps();
            for (int k = 0; k < 4; k++) { /* byte i of dword c: quant 4k+i (low nibble), 16+4k+i (high) */
                const __m512i v = _mm512_load_si512(g + b * 256 + 64 * k);
                for (int h = 0; h < 2; h++) {
                    __m512 w[4];
                    for (int i = 0; i < 4; i++) {
                        __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * i + 4 * h), m15);
                        if (qt == QT_Q4_0) q = _mm512_sub_epi32(q, eight);
                        w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
                        if (qt == QT_Q4_1) w[i] = _mm512_add_ps(w[i], m);
                    }
                    bf16p_pair(w[0], w[1], idx, o + 32 * (8 * h + 2 * k));
                    bf16p_pair(w[2], w[3], idx, o + 32 * (8 * h + 2 * k + 1));
                }
            }
        }
    }
}

BF16P_TARGET static void bf16p_pack(const uint8_t *g, int64_t nb, int qt, uint16_t *bt) {
    if (qt == QT_Q4_1) bf16p_pack_t(g, nb, QT_Q4_1, bt);
    else if (qt == QT_Q4_0) bf16p_pack_t(g, nb, QT_Q4_0, bt);
    else bf16p_pack_t(g, nb, QT_Q8_0, bt);
}

/* Output columns n0..n1 (n0 a multiple of 32) of all rows; xb: the activations as bfloat16 in tile order (per 16
 * rows and block of 32 K values, 16 rows of 64 bytes: one A tile, contiguous), Mp rows (zeros past M). The passes
 * (32 columns each) of a span are packed first, then each 32-row group of x meets every pass of the span, all of
 * K at a time (the packed weights stream from L2, two blocks ahead; chunks of K that kept x's rows in L1 measured
 * alike and were dropped). */
BF16P_TARGET static int bf16p_rows(const struct job *j, const uint16_t *xb, int64_t Mp, const uint8_t *kept,
                                   int64_t n0, int64_t n1) {
    const int64_t nb = j->K / QK, K = j->K, gb = kept_group_bytes(nb, j->qt);
    const int64_t P = (n1 - n0 + 31) / 32;
    const size_t pass_bytes = (size_t)nb * 2 * 512 * sizeof(uint16_t);
    int64_t PC = (int64_t)(BF16P_SPAN_BYTES / pass_bytes);
    PC = PC < 1 ? 1 : PC > P ? P : PC;
    uint16_t *bt = (uint16_t *)amx_scratch(pass_bytes * (size_t)PC);
    if (!bt) return KVQ_ENOMEM;
    float cbuf[4][16][16] __attribute__((aligned(64)));
    bf16p_config();
    for (int64_t q0 = 0; q0 < P; q0 += PC) {
        const int64_t q1 = q0 + PC < P ? q0 + PC : P;
        for (int64_t p = q0; p < q1; p++) {
            const int64_t c0 = n0 + 32 * p;
            uint16_t *bp = bt + (p - q0) * nb * 1024;
            for (int t = 0; t < 2; t++)
                bf16p_pack(c0 + 16 * t < j->N ? kept + (c0 / KEPT_COLS + t) * gb : NULL, nb, j->qt, bp + t * nb * 512);
        }
        for (int64_t r0 = 0; r0 < Mp; r0 += 32) {
            const int two = r0 + 16 < Mp; /* a second 16-row group: the same instructions for each row */
            const uint16_t *xa = xb + r0 * K, *xc = xb + (r0 + 16) * K; /* (tile order: 16 rows' block, 1 KiB) */
            for (int64_t p = q0; p < q1; p++) {
                const int64_t c0 = n0 + 32 * p, nc = n1 - c0 < 32 ? n1 - c0 : 32;
                const uint16_t *b0 = bt + (p - q0) * nb * 1024, *b1 = b0 + nb * 512;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t b = 0; b < nb; b++) {
                    for (int l = 0; l < 16; l++) { /* the weights two blocks ahead, from L2 (docs/BENCHMARKS.md) */
                        _mm_prefetch((const char *)(b0 + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
                        _mm_prefetch((const char *)(b1 + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
                    }
                    _tile_loadd(4, xa + b * 512, 64);
                    _tile_loadd(6, b0 + b * 512, 64);
                    _tile_loadd(7, b1 + b * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, xc + b * 512, 64);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int h = 0; h < 1 + two; h++) {
                    const int64_t rr = r0 + 16 * h;
                    if (rr + 16 <= j->M && nc == 32) { /* whole tiles straight into y */
                        float *y0 = j->y + rr * j->ldy + c0;
                        if (h == 0) {
                            _tile_stored(0, y0, j->ldy * 4);
                            _tile_stored(1, y0 + 16, j->ldy * 4);
                        } else {
                            _tile_stored(2, y0, j->ldy * 4);
                            _tile_stored(3, y0 + 16, j->ldy * 4);
                        }
                        if (j->bias) {
                            const __m512 bv0 = _mm512_loadu_ps(j->bias + c0), bv1 = _mm512_loadu_ps(j->bias + c0 + 16);
                            for (int r = 0; r < 16; r++) {
                                float *yr = y0 + r * j->ldy;
                                _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), bv0));
                                _mm512_storeu_ps(yr + 16, _mm512_add_ps(_mm512_loadu_ps(yr + 16), bv1));
                            }
                        }
                        continue;
                    }
                    if (h == 0) {
                        _tile_stored(0, cbuf[0], 64);
                        _tile_stored(1, cbuf[1], 64);
                    } else {
                        _tile_stored(2, cbuf[2], 64);
                        _tile_stored(3, cbuf[3], 64);
                    }
                    for (int r = 0; r < 16 && rr + r < j->M; r++) {
                        float *yr = j->y + (rr + r) * j->ldy + c0;
                        for (int64_t n = 0; n < nc; n++) {
                            const float v = cbuf[2 * h + n / 16][r][n % 16];
                            yr[n] = j->bias ? v + j->bias[c0 + n] : v;
                        }
                    }
                }
            }
        }
    }
    _tile_release();
    return KVQ_OK;
}

/* y = x W^T (+ bias) for prompt rows: KVQ_EBADTYPE when the route is off or W has no kept copy (the caller then
 * uses kvq_matmul). */
BF16P_TARGET int kvq_matmul_prompt(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                                   int64_t ldw, int qt, const float *bias, float *y, int64_t ldy, int nthreads) {
    if (!amx_bf16_on || !block_bytes(qt)) return KVQ_EBADTYPE;
    if (M < 0 || N < 0 || K <= 0 || K % QK || ldx < K || ldy < N) return KVQ_EBADSHAPE;
    if (ldw < K / QK * block_bytes(qt)) return KVQ_EROWBYTES;
    if (M == 0 || N == 0) return KVQ_OK;
    struct job j = {x, bias, w, y, M, K, ldx, N, ldw, ldy, qt, NULL, NULL, NULL, NULL, NULL};
    const uint8_t *kept = __atomic_load_n(&amx_nkept, __ATOMIC_RELAXED) > 0 ? amx_kept_tiles(&j) : NULL;
    if (!kept) return KVQ_EBADTYPE;
    const int64_t Mp = (M + 15) / 16 * 16, passes = (N + 31) / 32;
    /* the calling thread's buffer, kept between calls (a fresh mapping's page faults cost more than the
     * conversion) */
    static __thread uint16_t *xbuf;
    static __thread size_t xcap;
    const size_t xbytes = (size_t)(Mp * K) * sizeof(uint16_t);
    if (xbytes > xcap) {
        free(xbuf);
        xcap = (xbytes + 65535) / 65536 * 65536;
        xbuf = (uint16_t *)aligned_alloc(64, xcap);
        if (!xbuf) xcap = 0;
    }
    uint16_t *xb = xbuf;
    if (!xb) return KVQ_ENOMEM;
    if (Mp > M) memset(xb + (Mp - 16) * K, 0, (size_t)(16 * K) * sizeof(uint16_t)); /* the last group's tail */
    int nt = nthreads > 0 ? nthreads : kvq_max_threads();
    if (nt > passes) nt = (int)passes;
    int rc = KVQ_OK;
#pragma omp parallel num_threads(nt > 1 ? nt : 1)
    {
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        for (int64_t r = M * tid / nth; r < M * (tid + 1) / nth; r++) { /* rounded to nearest even */
            const float *xr = x + r * ldx;
            uint16_t *o = xb + (r / 16) * 16 * K + (r % 16) * QK; /* block b of row r at o + 512 b */
            for (int64_t b = 0; b < K / QK; b++) {
                const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + QK * b + 16),
                                                               _mm512_loadu_ps(xr + QK * b));
                _mm512_store_si512(o + 512 * b, v);
            }
        }
#pragma omp barrier
        const int64_t e = passes * (tid + 1) / nth * 32;
        const int r = bf16p_rows(&j, xb, Mp, kept, passes * tid / nth * 32, e < N ? e : N);
        if (r)
#pragma omp atomic write
            rc = r;
    }
    return rc;
}

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
    for (int64_t n = n0; n < n1; n += KEPT_COLS) {
        const int g = n1 - n < KEPT_COLS ? (int)(n1 - n) : KEPT_COLS;
        const uint8_t *gq = kept + n / KEPT_COLS * gb;
        const int qb = kept_qbytes(qt);
        const uint16_t *dh = (const uint16_t *)(gq + nb * qb), *mh = dh + nb * KEPT_COLS;
        __m512 acc[MT_MAX];
#pragma GCC unroll 16
        for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            for (int o = 0; o < qb; o += 64) __builtin_prefetch(gq + (b + KEPT_AHEAD(qt)) * qb + o);
            if (b % 2 == 0) __builtin_prefetch(dh + (b + KEPT_AHEAD(qt)) * KEPT_COLS);
            if (qt == QT_Q4_1 && b % 2 == 0) __builtin_prefetch(mh + (b + KEPT_AHEAD(qt)) * KEPT_COLS);
            __m512i W[8];
            kept_quants(gq, b, qt, W);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, W[0]), s1 = _mm512_setzero_si512();
            s1 = _mm512_dpbusd_epi32(s1, ones, W[1]);
            for (int k = 2; k < 8; k += 2)
                s0 = _mm512_dpbusd_epi32(s0, ones, W[k]), s1 = _mm512_dpbusd_epi32(s1, ones, W[k + 1]);
            const __m512i s15 = _mm512_slli_epi32(_mm512_add_epi32(s0, s1), 15);
            const __m512 vd = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(dh + b * KEPT_COLS)));
            const __m512 vm = qt == QT_Q4_1 ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(mh + b * KEPT_COLS)))
                                            : _mm512_setzero_ps();
#pragma GCC unroll 16
            for (int r = 0; r < MT; r++) {
                const uint8_t *xr = xu + (r * nb + b) * 64; /* 32 bytes hi + 128, then 32 bytes lo */
                __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0; /* four short chains */
                for (int k = 0; k < 8; k += 2) {
                    int32_t a, c, e, f;
                    memcpy(&a, xr + 4 * k, 4), memcpy(&c, xr + 4 * k + 4, 4);
                    memcpy(&e, xr + 32 + 4 * k, 4), memcpy(&f, xr + 32 + 4 * k + 4, 4);
                    h0 = _mm512_dpbusd_epi32(h0, _mm512_set1_epi32(a), W[k]);
                    h1 = _mm512_dpbusd_epi32(h1, _mm512_set1_epi32(c), W[k + 1]);
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

typedef void (*kept_fn)(const uint8_t *, const float *, const float *, int64_t, int, const uint8_t *, float *,
                        int64_t, int64_t, int64_t);
#define KVQ_KEPT(MT)                                                                                            \
    static void kept_rows##MT(const uint8_t *xu, const float *dx, const float *sx, int64_t nb, int qt,          \
                              const uint8_t *kept, float *y, int64_t ldy, int64_t n0, int64_t n1) {            \
        if (qt == QT_Q4_1) kept_rows(xu, dx, sx, nb, QT_Q4_1, kept, y, ldy, n0, n1, MT);                       \
        else if (qt == QT_Q4_0) kept_rows(xu, dx, sx, nb, QT_Q4_0, kept, y, ldy, n0, n1, MT);                  \
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
static const kept_fn kepts[MT_MAX + 1] = {NULL, kept_rows1, kept_rows2, kept_rows3, kept_rows4, kept_rows5,
                                          kept_rows6, kept_rows7, kept_rows8, kept_rows9, kept_rows10,
                                          kept_rows11, kept_rows12, kept_rows13, kept_rows14, kept_rows15,
                                          kept_rows16};

#else
int kvq_amx_enable(int on) { /* no tiles at this level */
    (void)on;
    return 0;
}

int kvq_amx_min_rows(void) { return 0; }

/* Below the avx512 level only the K-quants have a kept layout (kquants.c; none at the generic level). */
int64_t kvq_amx_tiles_bytes(int64_t N, int64_t K, int qt) {
    return kq_is_kquant(qt) ? kvq_kq_kept_bytes(N, K, qt) : 0;
}

int kvq_amx_tiles_pack(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, uint8_t *dst, int nthreads) {
    return kq_is_kquant(qt) ? kvq_kq_kept_pack(w, N, K, ldw, qt, dst, nthreads) : KVQ_EBADTYPE;
}

int kvq_kept_rows(const uint8_t *kept, int64_t N, int64_t K, int qt, const int64_t *ids, int64_t n, uint8_t *out,
                  int64_t ldo) {
    return kq_is_kquant(qt) ? kvq_kq_kept_rows(kept, N, K, qt, ids, n, out, ldo) : KVQ_EBADTYPE;
}

int kvq_amx_bf16_enable(int on) { /* no tiles at this level */
    (void)on;
    return 0;
}

int kvq_matmul_prompt(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw,
                      int qt, const float *bias, float *y, int64_t ldy, int nthreads) {
    (void)x, (void)M, (void)K, (void)ldx, (void)w, (void)N, (void)ldw, (void)qt, (void)bias, (void)y, (void)ldy;
    (void)nthreads;
    return KVQ_EBADTYPE;
}
#endif

/* ---- driver ---- */



static void run_rows(const struct job *j, int64_t n0, int64_t n1) {
    const int64_t ng = j->xq ? QNG : NG;
    const int64_t slab = W_SLAB_BYTES / j->ldw / ng * ng, nc = slab > 0 ? slab : ng; /* whole output groups */
    const int64_t nb = j->K / QK;
#if KVQ_LEVEL >= 2
    const int mt = j->xq ? MT_MAX : MF16_MAX;
#else
    const int mt = j->xq ? MT_MAX : MF_MAX;
#endif
    for (int64_t c0 = n0; c0 < n1; c0 += nc) {
        const int64_t c1 = c0 + nc < n1 ? c0 + nc : n1;
        for (int64_t r = 0; r < j->M; r += mt) {
            const int64_t h = j->M - r < mt ? j->M - r : mt;
#ifdef KVQ_HAVE_AMX
            if (j->kept)
                kepts[h](j->xu + r * nb * 2 * QK, j->dx + r * nb, j->sx + r * nb, nb, j->qt, j->kept,
                         j->y + r * j->ldy, j->ldy, c0, c1);
            else
#endif
            if (j->xq)
                tiles_q[h](j->xq + r * nb * QK, j->dx + r * nb, j->sx + r * nb, nb, j->w, j->ldw, j->qt,
                           j->y + r * j->ldy, j->ldy, c0, c1, r == 0);
            else
#if KVQ_LEVEL >= 2
                tiles_f16[h](j->x + r * j->ldx, j->ldx, j->K, j->w, j->ldw, j->qt, j->y + r * j->ldy, j->ldy, c0, c1);
#else
                tiles_f[h](j->x + r * j->ldx, j->ldx, j->K, j->w, j->ldw, j->qt, j->y + r * j->ldy, j->ldy, c0, c1);
#endif
        }
        if (j->bias)
            for (int64_t r = 0; r < j->M; r++)
                for (int64_t n = c0; n < c1; n++) j->y[r * j->ldy + n] = j->y[r * j->ldy + n] + j->bias[n];
    }
}

int kvq_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int kvq_level(void) { return KVQ_LEVEL; }

/* Returns 0, or a negative KVQ_E* code (y untouched). nthreads <= 0: OpenMP's default. Threads split the
 * output columns, never K, so the thread count cannot change a result. */
int kvq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw, int qt,
               const float *bias, float *y, int64_t ldy, int nthreads) {
    if (kq_is_kquant(qt)) return kvq_kq_matmul(x, M, K, ldx, w, N, ldw, qt, bias, y, ldy, nthreads);
    const int bb = block_bytes(qt), eb = elem_bytes(qt);
    if (!bb && !eb) return KVQ_EBADTYPE;
    if (M < 0 || N < 0 || K <= 0 || (bb && K % QK) || ldx < K || ldy < N) return KVQ_EBADSHAPE;
    const int64_t row_bytes = bb ? K / QK * bb : K * eb;
    if (ldw < row_bytes) return KVQ_EROWBYTES;
    if (M == 0 || N == 0) return KVQ_OK;

    struct job j = {x, bias, w, y, M, K, ldx, N, ldw, ldy, qt, NULL, NULL, NULL, NULL, NULL};
    int16_t *xq = NULL;
    float *dx = NULL, *sx = NULL;
    if (bb) {
        const int64_t nb = K / QK;
        xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
        dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
        sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
        if (!xq || !dx || !sx) {
            free(xq), free(dx), free(sx);
            return KVQ_ENOMEM;
        }
        j.xq = xq, j.dx = dx, j.sx = sx;
    }
    int nt = nthreads > 0 ? nthreads : kvq_max_threads();
    uint8_t *xu = NULL;
#ifdef KVQ_HAVE_AMX
    const uint8_t *kept = bb && __atomic_load_n(&amx_nkept, __ATOMIC_RELAXED) > 0 ? amx_kept_tiles(&j) : NULL;
    if (bb && amx_on && M >= AMX_MIN_ROWS) { /* (it rounds x itself, on all its threads) */
        const int rc = amx_matmul(&j, xq, dx, sx, nt, kept);
        free(xq), free(dx), free(sx);
        return rc;
    }
    if (kept) {
        xu = (uint8_t *)malloc((size_t)(M * K * 2));
        if (!xu) {
            free(xq), free(dx), free(sx);
            return KVQ_ENOMEM;
        }
        j.xu = xu, j.kept = kept;
    }
#endif
    if (bb) quantize_rows(x, M, K, ldx, xq, dx, sx);
#ifdef KVQ_HAVE_AMX
    if (xu) kvq_split_bytes(xq, M, K, xu);
#endif
    const int64_t work = N * row_bytes * (M < 8 ? 1 : M / 8); /* weight bytes, times row tiles at prefill sizes */
    if ((int64_t)nt > work / MIN_BYTES_PER_THREAD) nt = (int)(work / MIN_BYTES_PER_THREAD);
    if (nt > N) nt = (int)N;
    if (nt < 1) nt = 1;
    if (nt == 1) {
        run_rows(&j, 0, N); /* no OpenMP region: saves its fixed cost on small calls */
    } else {
#pragma omp parallel num_threads(nt)
        {
            int tid = 0, nth = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            const int64_t ng = bb ? QNG : NG, groups = (N + ng - 1) / ng, e = groups * (tid + 1) / nth * ng;
            run_rows(&j, groups * tid / nth * ng, e < N ? e : N); /* whole groups each */
        }
    }
    free(xq), free(dx), free(sx), free(xu);
    return KVQ_OK;
}

/* kvq_matmul with its arguments in one int64 array, in the same order: ctypes converts each argument of a call
 * separately, and one pointer is several microseconds cheaper than twelve scalars (QuantLinear's hot path). */
int kvq_matmul_packed(const int64_t *a) {
    return kvq_matmul((const float *)(intptr_t)a[0], a[1], a[2], a[3], (const uint8_t *)(intptr_t)a[4], a[5], a[6],
                      (int)a[7], (const float *)(intptr_t)a[8], (float *)(intptr_t)a[9], a[10], (int)a[11]);
}

/* Rows ids[0..n) of a GGML matrix (N rows of K elements, ldw bytes apart) as float32 out[n, K]: the embedding
 * lookup. The same floats as kvinfer.loaders.dequant: Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m (a multiply,
 * then an add), fp16 / bf16 widened exactly. Returns KVQ_EBADSHAPE (out untouched) if an id is outside [0, N). */
static int embed_gguf_rows(const uint8_t *w, int64_t ldw, int qt, const int64_t *ids, int64_t n, int64_t N,
                           int64_t K, float *out);

int kvq_embed_rows(const uint8_t *w, int64_t ldw, int qt, const int64_t *ids, int64_t n, int64_t N, int64_t K,
                   float *out) {
    /* A weight with a kept copy may have dropped its GGUF rows (kvq_kept_rows): the rows asked for come from the
     * copy, byte for byte, and then decode as usual. */
    const uint8_t *kept = n > 0 && K > 0 ? kvq_kept_lookup(w, N, K, ldw, qt) : NULL;
    if (kept) {
        uint8_t *rows = (uint8_t *)malloc((size_t)(n * ldw));
        int64_t *seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
        int rc = rows && seq ? kvq_kept_rows(kept, N, K, qt, ids, n, rows, ldw) : KVQ_ENOMEM;
        if (rc == KVQ_OK) {
            for (int64_t i = 0; i < n; i++) seq[i] = i;
            rc = embed_gguf_rows(rows, ldw, qt, seq, n, n, K, out);
        }
        free(rows), free(seq);
        if (rc != KVQ_EBADTYPE) return rc;
    }
    return embed_gguf_rows(w, ldw, qt, ids, n, N, K, out);
}

static int embed_gguf_rows(const uint8_t *w, int64_t ldw, int qt, const int64_t *ids, int64_t n, int64_t N,
                           int64_t K, float *out) {
    if (kq_is_kquant(qt)) {
        if (n < 0 || K <= 0) return KVQ_EBADSHAPE;
        for (int64_t r = 0; r < n; r++)
            if (ids[r] < 0 || ids[r] >= N) return KVQ_EBADSHAPE;
        return kvq_kq_embed_rows(w, ldw, qt, ids, n, K, out);
    }
    const int bb = block_bytes(qt), eb = elem_bytes(qt);
    if (!bb && !eb) return KVQ_EBADTYPE;
    if (n < 0 || K <= 0 || (bb && K % QK)) return KVQ_EBADSHAPE;
    if (ldw < (bb ? K / QK * bb : K * eb)) return KVQ_EROWBYTES;
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= N) return KVQ_EBADSHAPE;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + ids[r] * ldw;
        float *y = out + r * K;
        if (!bb) {
            for (int64_t k = 0; k < K; k++) y[k] = load_w1(row, k, qt);
            continue;
        }
        for (int64_t b = 0; b < K / QK; b++) {
            const uint8_t *blk = row + b * bb;
            const float d = kvq_half(kvq_rd16(blk));
            float *yb = y + b * QK;
            if (qt == QT_Q8_0)
                for (int i = 0; i < QK; i++) yb[i] = (float)(int8_t)blk[2 + i] * d;
            else if (qt == QT_Q4_0)
                for (int i = 0; i < 16; i++) {
                    yb[i] = (float)((blk[2 + i] & 15) - 8) * d;
                    yb[i + 16] = (float)((blk[2 + i] >> 4) - 8) * d;
                }
            else {
                const float m = kvq_half(kvq_rd16(blk + 2));
                for (int i = 0; i < 16; i++) {
                    yb[i] = (float)(blk[4 + i] & 15) * d + m;
                    yb[i + 16] = (float)(blk[4 + i] >> 4) * d + m;
                }
            }
        }
    }
    return KVQ_OK;
}
