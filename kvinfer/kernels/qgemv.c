/* Quantised matmul y[M,N] = x[M,K] @ W[N,K]^T, float32 activations, W as raw GGML Q4_0 / Q4_1 / Q8_0 rows. */

/*
 * Block layouts (32 weights each, little-endian fp16 fields):
 *   Q4_0: d(f16) qs[16]         w = d * (q - 8)
 *   Q4_1: d(f16) m(f16) qs[16]  w = d * q + m
 *   Q8_0: d(f16) qs[32] (int8)  w = d * q
 * In the 4-bit types element i sits in the low nibble of qs[i] and element i + 16 in its high nibble.
 *
 * Two AVX2 routes:
 * - float32 (impl 2): each weight block is decoded in registers to w = d*q + m (one FMA per 8 weights) and
 *   then multiplied into every x row with FMAs, so the result equals x @ dequant(W)^T up to summation order
 *   (and one rounding of w). Decoding costs four int->float conversions per block, which bounds it at one x
 *   row; with 8 rows per tile the decode is shared and the FMAs dominate. Folding d and m in afterwards
 *   (d*dot(q, x) + m*sum(x_block)) measured the same at one row but 1.4x slower at 16.
 * - int16 (impl 3): x is rounded per 32-element block to 16-bit integers and each block's dot product with
 *   the raw quants is exact integer arithmetic. 1.6-1.8x faster at one row, the default for decode-sized
 *   inputs; the rounding error (at most 1.5e-5 of a block's largest |x|, 30x below fp16's) shows as ~5e-5 of
 *   max|y|. An int8 version of the same (llama.cpp's q8 activations) was no faster here and 250x coarser.
 */
#include "kernels.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVQ_AVX2 1
#else
#define KVQ_AVX2 0
#endif

#define QK 32

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8 };
enum { IMPL_AUTO = 0, IMPL_SCALAR = 1, IMPL_AVX2 = 2, IMPL_AVX2_I16 = 3 };
enum {
    KVQ_OK = 0, KVQ_EBADTYPE = -1, KVQ_EBADSHAPE = -2, KVQ_ENOIMPL = -3, KVQ_ENOMEM = -4, KVQ_EROWBYTES = -5
};

/* Per-thread share below this many weight bytes is not worth waking a second thread for. */
#define MIN_BYTES_PER_THREAD (16 * 1024)

static int block_bytes(int qt) {
    switch (qt) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    default: return 0;
    }
}

static uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2); /* blocks are only 2-byte aligned; GGUF data is little-endian like every target here */
    return v;
}

/* Portable IEEE half -> float (no F16C in the scalar build). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (ex == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* subnormal (or zero): man * 2^-24, exact in float */
        return sign ? -f : f;
    }
    if (ex == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else
        bits = sign | ((ex + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------------------------------------------------ */
/* Scalar route: decode one weight row to float, then a plain dot with every x row. */

static void decode_row_scalar(const uint8_t *w, int qt, int64_t nb, float *out) {
    int bb = block_bytes(qt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        float d = half_to_float(rd16(blk));
        float *o = out + b * QK;
        if (qt == QT_Q8_0) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int i = 0; i < QK; i++) o[i] = d * (float)q[i];
        } else {
            float m = qt == QT_Q4_1 ? half_to_float(rd16(blk + 2)) : 0.0f;
            const uint8_t *qs = blk + (qt == QT_Q4_1 ? 4 : 2);
            int off = qt == QT_Q4_0 ? 8 : 0;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)((qs[i] & 15) - off) + m;
                o[i + QK / 2] = d * (float)((qs[i] >> 4) - off) + m;
            }
        }
    }
}

static void rows_scalar(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t ldw, int qt,
                        float *y, int64_t ldy, int64_t n0, int64_t n1, float *buf) {
    int64_t nb = K / QK;
    for (int64_t n = n0; n < n1; n++) {
        decode_row_scalar(w + n * ldw, qt, nb, buf);
        for (int64_t r = 0; r < M; r++) {
            const float *xr = x + r * ldx;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += xr[k] * buf[k];
            y[r * ldy + n] = acc;
        }
    }
}

/* ------------------------------------------------------------------------------------------------------------ */
#if KVQ_AVX2

static inline float f16c(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* fp16 field broadcast to 8 floats: broadcasting the half first saves a shuffle per block. */
static inline __m256 bcast_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_set1_epi16((short)rd16(p))); }

/* Four 8-float vectors of a block's raw quants (elements 0-7, 8-15, 16-23, 24-31); offsets and scales are
 * applied per block by the caller. Zero-extending 8 bytes to 8 ints and then masking / shifting yields the
 * low-nibble and high-nibble elements without any byte shuffles. */
static inline __attribute__((always_inline)) void decode_q4(const uint8_t *qs, __m256 q[4]) {
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

static inline __attribute__((always_inline)) void decode_q8(const uint8_t *qs, __m256 q[4]) {
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * j))));
}

/* Weight rows n0..n1 against MT (1..8, a compile-time constant after inlining) rows of x, over blocks
 * b0..b1 only. Each block is decoded to float weights w = d*q + m in four registers once, then meets every x
 * row with plain FMAs. NA partial accumulators per row keep enough independent FMA chains in flight to cover
 * the FMA latency when MT is small, while MT * NA + 4 stays within the 16 ymm registers. The first K chunk
 * stores into y, later ones add to it. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const uint8_t *w,
                                                           int64_t ldw, int64_t n0, int64_t n1, int64_t b0,
                                                           int64_t b1, float *y, int64_t ldy, int first, int qt,
                                                           const int MT) {
    const int NA = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
    const int bb = block_bytes(qt);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wrow = w + n * ldw;
        __m256 acc[8][4];
        for (int r = 0; r < MT; r++)
            for (int a = 0; a < NA; a++) acc[r][a] = _mm256_setzero_ps();
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk = wrow + b * bb;
            __m256 wv[4];
            const __m256 vd = bcast_f16(blk);
            if (qt == QT_Q8_0) {
                decode_q8(blk + 2, wv);
                for (int j = 0; j < 4; j++) wv[j] = _mm256_mul_ps(wv[j], vd);
            } else {
                __m256 vm;
                if (qt == QT_Q4_1) {
                    vm = bcast_f16(blk + 2);
                    decode_q4(blk + 4, wv);
                } else {
                    vm = _mm256_mul_ps(vd, _mm256_set1_ps(-8.0f));
                    decode_q4(blk + 2, wv);
                }
                for (int j = 0; j < 4; j++) wv[j] = _mm256_fmadd_ps(wv[j], vd, vm);
            }
            for (int r = 0; r < MT; r++) {
                const float *xb = x + r * ldx + b * QK;
                for (int j = 0; j < 4; j++)
                    acc[r][j % NA] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % NA]);
            }
        }
        for (int r = 0; r < MT; r++) {
            for (int a = 1; a < NA; a++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
            float s = kvq_hsum8(acc[r][0]);
            y[r * ldy + n] = first ? s : y[r * ldy + n] + s;
        }
    }
}

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float *, int64_t, int);

/* One specialised instance per (type, tile height). */
#define KVQ_DEF_TILE(QT, MT)                                                                                    \
    static void tile_##QT##_##MT(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int64_t n0,       \
                                 int64_t n1, int64_t b0, int64_t b1, float *y, int64_t ldy, int first) {       \
        tile_f32(x, ldx, w, ldw, n0, n1, b0, b1, y, ldy, first, QT, MT);                                       \
    }
#define KVQ_DEF_TILES(QT)                                                                                       \
    KVQ_DEF_TILE(QT, 1) KVQ_DEF_TILE(QT, 2) KVQ_DEF_TILE(QT, 3) KVQ_DEF_TILE(QT, 4) KVQ_DEF_TILE(QT, 5)        \
    KVQ_DEF_TILE(QT, 6) KVQ_DEF_TILE(QT, 7) KVQ_DEF_TILE(QT, 8)                                                \
    static const tile_fn tiles_##QT[9] = {NULL,         tile_##QT##_1, tile_##QT##_2, tile_##QT##_3,          \
                                          tile_##QT##_4, tile_##QT##_5, tile_##QT##_6, tile_##QT##_7,          \
                                          tile_##QT##_8};
KVQ_DEF_TILES(QT_Q4_0)
KVQ_DEF_TILES(QT_Q4_1)
KVQ_DEF_TILES(QT_Q8_0)
#undef KVQ_DEF_TILES
#undef KVQ_DEF_TILE

/* Cache blocking. A tile's x rows over one K chunk should stay in L1 while weight rows stream past (every
 * x element is loaded once per FMA, so L2 would halve the FMA rate): K is split into equal chunks of at most
 * 24 KiB of x (768 columns for an 8-row tile, 6144 for one row). And a slab of weight rows should stay in L2
 * while successive 8-row tiles of x (prefill) revisit it. */
#define X_TILE_BYTES (24 * 1024)
#define W_SLAB_BYTES (256 * 1024)

static void rows_avx2(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t ldw, int qt,
                      float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const tile_fn *tiles = qt == QT_Q4_1 ? tiles_QT_Q4_1 : qt == QT_Q4_0 ? tiles_QT_Q4_0 : tiles_QT_Q8_0;
    int64_t nb = K / QK, mt = M < 8 ? M : 8;
    int64_t kc = X_TILE_BYTES / ((int64_t)sizeof(float) * QK * mt);
    int64_t nc = W_SLAB_BYTES / ldw;
    if (kc < 1) kc = 1;
    kc = (nb + (nb + kc - 1) / kc - 1) / ((nb + kc - 1) / kc); /* equal chunks: no short tail chunk */
    if (nc < 1) nc = 1;
    for (int64_t c0 = n0; c0 < n1; c0 += nc) {
        int64_t c1 = c0 + nc < n1 ? c0 + nc : n1;
        for (int64_t b0 = 0; b0 < nb; b0 += kc) {
            int64_t b1 = b0 + kc < nb ? b0 + kc : nb;
            for (int64_t r = 0; r < M; r += 8) {
                int64_t h = M - r < 8 ? M - r : 8;
                tiles[h](x + r * ldx, ldx, w, ldw, c0, c1, b0, b1, y + r * ldy, ldy, b0 == 0);
            }
        }
    }
}

/* ---- int16-activation route ----
 * x is rounded per 32-element block to int16 (x ~ dx * xq, |xq| <= 32767: a relative error of at most 1.5e-5
 * of the block's largest |x|, 30x finer than fp16) and each block's dot product with the raw quants is exact
 * integer arithmetic (vpmaddwd), scaled once per block by d * dx; Q4_1's minimum enters as m * sum(x_block)
 * with the exact float sum. Per weight block that is one widening load, two multiply-adds per x row and one
 * int->float conversion, against four conversions and eight FMAs on the float route, which bounds it. */

static void quantize_x_i16(const float *x, int64_t M, int64_t K, int64_t ldx, int16_t *xq, float *dx, float *sx) {
    int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * QK;
            __m256 s = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
            const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            for (int j = 0; j < 4; j++) {
                __m256 v = _mm256_loadu_ps(xb + 8 * j);
                s = _mm256_add_ps(s, v);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v, absmask));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float d = amax / 32767.0f, id = amax > 0.0f ? 32767.0f / amax : 0.0f;
            const __m256 vid = _mm256_set1_ps(id);
            int16_t *q = xq + (r * nb + b) * QK;
            for (int j = 0; j < 4; j += 2) {
                /* round to nearest (ties to even); |x * id| <= 32767 up to float rounding, and packs
                 * saturates at 32767 in any case */
                __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), vid));
                __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j + 8), vid));
                /* packs interleaves 128-bit lanes; the permute puts the 16 values back in order */
                __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xd8);
                _mm256_storeu_si256((__m256i *)(q + 8 * j), p);
            }
            dx[r * nb + b] = d;
            sx[r * nb + b] = kvq_hsum8(s);
        }
    }
}

/* The 32 raw quants of a weight block as two 16 x int16 vectors (elements 0-15, 16-31), Q4_0's -8 applied. */
static inline __attribute__((always_inline)) void load_q_i16(const uint8_t *blk, int qt, __m256i *lo, __m256i *hi) {
    if (qt == QT_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
    } else {
        /* each byte widened to 16 bits holds element i (low nibble) and i + 16 (high nibble) */
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + (qt == QT_Q4_1 ? 4 : 2))));
        *lo = _mm256_and_si256(v, _mm256_set1_epi16(15));
        *hi = _mm256_srli_epi16(v, 4);
        if (qt == QT_Q4_0) {
            *lo = _mm256_sub_epi16(*lo, _mm256_set1_epi16(8));
            *hi = _mm256_sub_epi16(*hi, _mm256_set1_epi16(8));
        }
    }
}

static inline int32_t rd32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The fp16 scales d (and Q4_1's minimums m) of 8 consecutive blocks as 8 floats each: the first 4 bytes of
 * each block are d then m (or, in Q4_0 / Q8_0, the first quants, unused), split into halves with a byte
 * shuffle and converted together. */
static inline __attribute__((always_inline)) void scales8(const uint8_t *blk, int bb, __m256 *d, __m256 *m) {
    const __m128i sep = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m128i p0 = _mm_shuffle_epi8(_mm_setr_epi32(rd32(blk), rd32(blk + bb), rd32(blk + 2 * bb), rd32(blk + 3 * bb)), sep);
    __m128i p1 = _mm_shuffle_epi8(
        _mm_setr_epi32(rd32(blk + 4 * bb), rd32(blk + 5 * bb), rd32(blk + 6 * bb), rd32(blk + 7 * bb)), sep);
    *d = _mm256_cvtph_ps(_mm_unpacklo_epi64(p0, p1));
    *m = _mm256_cvtph_ps(_mm_unpackhi_epi64(p0, p1));
}

/* Integer dot product of the 32 quants lo/hi with x row block q (32 int16), as 8 int32 lanes. */
static inline __attribute__((always_inline)) __m256i dot_i16(__m256i lo, __m256i hi, const int16_t *q) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)q)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 16))));
}

/* Weight rows n0..n1 against MT (1..4) quantised x rows. Blocks go 8 at a time: their scales are converted
 * together and multiplied by x's block scales (Q4_1's m * sum(x_block) terms accumulate in a vector of their
 * own), so a block costs one widening load and, per x row, two multiply-adds, a conversion and an FMA with a
 * broadcast scale. Consecutive blocks go to NA accumulators so the FMA latency chain does not bound the loop.
 * The leftover nb % 8 blocks take the same arithmetic with their scales converted one by one. */
static inline __attribute__((always_inline)) void tile_i16(const int16_t *xq, const float *dx, const float *sx,
                                                           int64_t nb, const uint8_t *w, int64_t ldw, int qt,
                                                           float *y, int64_t ldy, int64_t n0, int64_t n1,
                                                           const int MT) {
    const int NA = MT == 1 ? 4 : MT == 2 ? 2 : 1;
    const int bb = block_bytes(qt);
    const int64_t nb8 = nb & ~(int64_t)7;
    float sc[4][8] __attribute__((aligned(32)));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wrow = w + n * ldw;
        __m256 acc[4][4], off[4];
        for (int r = 0; r < MT; r++) {
            off[r] = _mm256_setzero_ps();
            for (int a = 0; a < NA; a++) acc[r][a] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < nb8; b += 8) {
            const uint8_t *blk = wrow + b * bb;
            __m256 vd, vm;
            scales8(blk, bb, &vd, &vm);
            for (int r = 0; r < MT; r++) {
                _mm256_store_ps(sc[r], _mm256_mul_ps(vd, _mm256_loadu_ps(dx + r * nb + b)));
                if (qt == QT_Q4_1) off[r] = _mm256_fmadd_ps(vm, _mm256_loadu_ps(sx + r * nb + b), off[r]);
            }
            for (int u = 0; u < 8; u++) {
                __m256i lo, hi;
                load_q_i16(blk + u * bb, qt, &lo, &hi);
                for (int r = 0; r < MT; r++) {
                    __m256i p = dot_i16(lo, hi, xq + (r * nb + b + u) * QK);
                    acc[r][u % NA] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sc[r] + u),
                                                     acc[r][u % NA]);
                }
            }
        }
        float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t b = nb8; b < nb; b++) {
            const uint8_t *blk = wrow + b * bb;
            __m256i lo, hi;
            load_q_i16(blk, qt, &lo, &hi);
            const float d = f16c(blk);
            for (int r = 0; r < MT; r++) {
                __m256i p = dot_i16(lo, hi, xq + (r * nb + b) * QK);
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[r * nb + b]), acc[r][0]);
                if (qt == QT_Q4_1) tail[r] += f16c(blk + 2) * sx[r * nb + b];
            }
        }
        for (int r = 0; r < MT; r++) {
            for (int a = 1; a < NA; a++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
            y[r * ldy + n] = kvq_hsum8(_mm256_add_ps(acc[r][0], off[r])) + tail[r];
        }
    }
}

typedef void (*tile16_fn)(const int16_t *, const float *, const float *, int64_t, const uint8_t *, int64_t, float *,
                          int64_t, int64_t, int64_t);
#define KVQ_DEF_TILE16(QT, MT)                                                                                  \
    static void tile16_##QT##_##MT(const int16_t *xq, const float *dx, const float *sx, int64_t nb,            \
                                   const uint8_t *w, int64_t ldw, float *y, int64_t ldy, int64_t n0,           \
                                   int64_t n1) {                                                               \
        tile_i16(xq, dx, sx, nb, w, ldw, QT, y, ldy, n0, n1, MT);                                               \
    }
#define KVQ_DEF_TILES16(QT)                                                                                     \
    KVQ_DEF_TILE16(QT, 1) KVQ_DEF_TILE16(QT, 2) KVQ_DEF_TILE16(QT, 3) KVQ_DEF_TILE16(QT, 4)                    \
    static const tile16_fn tiles16_##QT[5] = {NULL, tile16_##QT##_1, tile16_##QT##_2, tile16_##QT##_3,         \
                                              tile16_##QT##_4};
KVQ_DEF_TILES16(QT_Q4_0)
KVQ_DEF_TILES16(QT_Q4_1)
KVQ_DEF_TILES16(QT_Q8_0)
#undef KVQ_DEF_TILES16
#undef KVQ_DEF_TILE16

static void rows_i16(const int16_t *xq, const float *dx, const float *sx, int64_t M, int64_t K, const uint8_t *w,
                     int64_t ldw, int qt, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const tile16_fn *tiles = qt == QT_Q4_1 ? tiles16_QT_Q4_1 : qt == QT_Q4_0 ? tiles16_QT_Q4_0 : tiles16_QT_Q8_0;
    int64_t nb = K / QK;
    /* a slab of weight rows stays in L2 while successive 4-row tiles of x revisit it */
    int64_t nc = W_SLAB_BYTES / ldw;
    if (nc < 1) nc = 1;
    for (int64_t c0 = n0; c0 < n1; c0 += nc) {
        int64_t c1 = c0 + nc < n1 ? c0 + nc : n1;
        for (int64_t r = 0; r < M; r += 4) {
            int64_t h = M - r < 4 ? M - r : 4;
            tiles[h](xq + r * nb * QK, dx + r * nb, sx + r * nb, nb, w, ldw, y + r * ldy, ldy, c0, c1);
        }
    }
}

#endif /* KVQ_AVX2 */

/* ------------------------------------------------------------------------------------------------------------ */
/* Exported API */

/* 1 when this build holds the AVX2 routes (compiled with -mavx2 -mfma -mf16c). */
int kvq_built_with_avx2(void) { return KVQ_AVX2; }

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
static int cpu_avx2;

/* Probed once at load time, so calls never race on it. */
__attribute__((constructor)) static void probe_cpu(void) {
    __builtin_cpu_init();
    cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
static const int cpu_avx2 = 0;
#endif

/* impl 0 takes the int16 route up to this many x rows and the float32 route above: measured on a Zen 3 core,
 * the int16 route is 1.6-1.8x faster at 1 row, 1.2x at 4 and even at 8, where the float route's per-row FMAs
 * (with each weight block decoded once for 8 rows) catch up. 8-row int16 tiles were tried: 10% slower than the
 * float route at 16 and 32 rows (two multiply-adds, a conversion and an FMA per row and block, against four
 * FMAs), so the int16 tiles stop at 4 rows. */
static int64_t i16_max_rows = 7;

/* Sets that threshold (0: the float32 route always); returns the previous one. Not for use during calls. */
int64_t kvq_set_i16_max_rows(int64_t m) {
    int64_t old = i16_max_rows;
    i16_max_rows = m < 0 ? 0 : m;
    return old;
}

/* 1 when the running CPU can execute the AVX2 routes. */
int kvq_cpu_has_avx2(void) { return cpu_avx2; }

int kvq_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

struct job {
    const float *x;
    const uint8_t *w;
    float *y;
    int64_t M, K, ldx, N, ldw, ldy;
    int qt, impl;
    const float *sx, *dx; /* int16 route only */
    const int16_t *xq;
};

static int run_rows(const struct job *j, int64_t n0, int64_t n1) {
    if (j->impl == IMPL_SCALAR) {
        float *buf = (float *)malloc(sizeof(float) * (size_t)j->K);
        if (!buf) return KVQ_ENOMEM;
        rows_scalar(j->x, j->M, j->K, j->ldx, j->w, j->ldw, j->qt, j->y, j->ldy, n0, n1, buf);
        free(buf);
    }
#if KVQ_AVX2
    else if (j->impl == IMPL_AVX2) {
        rows_avx2(j->x, j->M, j->K, j->ldx, j->w, j->ldw, j->qt, j->y, j->ldy, n0, n1);
    } else {
        rows_i16(j->xq, j->dx, j->sx, j->M, j->K, j->w, j->ldw, j->qt, j->y, j->ldy, n0, n1);
    }
#endif
    return KVQ_OK;
}

/*
 * y[r * ldy + n] = sum_k x[r * ldx + k] * W[n, k]   for r < M, n < N.
 * w: N rows of ldw bytes, each starting with K/32 blocks of type qt (GGML type id: 2 Q4_0, 3 Q4_1, 8 Q8_0).
 * nthreads <= 0 means OpenMP's default. impl: 0 best available (see i16_max_rows), 1 scalar, 2 AVX2 float32 x,
 * 3 AVX2 int16-rounded x.
 * Returns 0, or a negative KVQ_E* code (y untouched, except by KVQ_ENOMEM).
 */
int kvq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw, int qt,
               float *y, int64_t ldy, int nthreads, int impl) {
    int bb = block_bytes(qt);
    if (!bb) return KVQ_EBADTYPE;
    if (M < 0 || N < 0 || K <= 0 || K % QK || ldx < K || ldy < N) return KVQ_EBADSHAPE;
    if (ldw < K / QK * bb) return KVQ_EROWBYTES;
    int avx2 = KVQ_AVX2 && kvq_cpu_has_avx2();
    if (impl == IMPL_AUTO) impl = avx2 ? (M <= i16_max_rows ? IMPL_AVX2_I16 : IMPL_AVX2) : IMPL_SCALAR;
    if (impl < IMPL_SCALAR || impl > IMPL_AVX2_I16 || (impl != IMPL_SCALAR && !avx2)) return KVQ_ENOIMPL;
    if (M == 0 || N == 0) return KVQ_OK;

    struct job j = {x, w, y, M, K, ldx, N, ldw, ldy, qt, impl, NULL, NULL, NULL};
    int64_t nb = K / QK;
    float *sx = NULL, *dx = NULL;
    int16_t *xq = NULL;
#if KVQ_AVX2
    if (impl == IMPL_AVX2_I16) {
        sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
        dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
        xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K));
        if (!sx || !xq || !dx) {
            free(sx), free(xq), free(dx);
            return KVQ_ENOMEM;
        }
        quantize_x_i16(x, M, K, ldx, xq, dx, sx);
        j.sx = sx, j.dx = dx, j.xq = xq;
    }
#endif

    int nt = nthreads > 0 ? nthreads : kvq_max_threads();
    int64_t per = MIN_BYTES_PER_THREAD;
    if ((int64_t)nt > N * nb * bb / per) nt = (int)(N * nb * bb / per);
    if (nt > N) nt = (int)N;
    if (nt < 1) nt = 1;
    int status = KVQ_OK;
    if (nt == 1) {
        status = run_rows(&j, 0, N); /* no OpenMP region at all: saves its fixed cost on small calls */
    } else {
        /* One contiguous range of output rows per thread, so each streams its own part of W exactly once. */
#pragma omp parallel num_threads(nt)
        {
            int tid = 0, nth = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            int rc = run_rows(&j, N * tid / nth, N * (tid + 1) / nth);
            if (rc) {
#pragma omp atomic write
                status = rc;
            }
        }
    }
    free(sx);
    free(xq);
    free(dx);
    return status;
}

/* kvq_matmul with its arguments in one int64 array, in the same order: ctypes converts each argument of a
 * call separately, and one pointer is several microseconds cheaper than twelve scalars. */
int kvq_matmul_packed(const int64_t *a) {
    return kvq_matmul((const float *)(intptr_t)a[0], a[1], a[2], a[3], (const uint8_t *)(intptr_t)a[4], a[5], a[6],
                      (int)a[7], (float *)(intptr_t)a[8], a[9], (int)a[10], (int)a[11]);
}
