/* Matmul y[M,N] = x[M,K] @ W[N,K]^T for float32 / fp16 / bf16 weight rows: 8-lane FMAs over K into two
 * accumulators (even / odd groups of 8), a sequential scalar tail; at the AVX-512 level the same operations two
 * columns per 16-lane register (tile_f16). The row tiles, indexed by rows, are this level's kvqi_tiles_f, which
 * matmul.c's driver calls; a row's arithmetic is fixed whatever the tile it lands in. */
#include "matmul.h"

static inline vf load_w8(const uint8_t *row, int64_t k, int qt) {
    if (qt == QT_F32) return vf_load((const float *)row + k);
    if (qt == QT_BF16) return vf_load_bf16((const uint16_t *)row + k);
    return vf_load_half((const uint16_t *)row + k);
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
const tile_f_fn kvqi_tiles_f[MF_MAX + 1] = {NULL, tile_f1, tile_f2, tile_f3, tile_f4};
const int kvqi_mf_max = MF_MAX;
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
const tile_f_fn kvqi_tiles_f[MF16_MAX + 1] = {NULL, tile_f16_1, tile_f16_2, tile_f16_3, tile_f16_4,
                                                  tile_f16_5, tile_f16_6, tile_f16_7, tile_f16_8};
const int kvqi_mf_max = MF16_MAX;
#endif
