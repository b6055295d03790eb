/* Quantised matmul y[M,N] = x[M,K] @ W[N,K]^T, float32 activations, W as raw GGML Q4_0 / Q4_1 / Q8_0 rows. */

/*
 * Block layouts (32 weights each, little-endian fp16 fields):
 *   Q4_0: d(f16) qs[16]         w = d * (q - 8)
 *   Q4_1: d(f16) m(f16) qs[16]  w = d * q + m
 *   Q8_0: d(f16) qs[32] (int8)  w = d * q
 * In the 4-bit types element i sits in the low nibble of qs[i] and element i + 16 in its high nibble.
 *
 * The default route stays in float32: each weight block is decoded in registers to w = d*q + m (one FMA
 * per 8 weights) and then multiplied into every x row with FMAs, so the result equals x @ dequant(W)^T up to
 * summation order (and one rounding of w). Folding d and m in afterwards (d*dot(q, x) + m*sum(x_block))
 * measured the same at one row but 1.4x slower at 16, as it costs more FMA-port work per x row.
 * The "i8" route (impl 3) quantises x per block to int8 and uses integer dot products instead: 20-25% faster
 * at one row when the weights are in cache, no faster at 4+ rows, and it adds x's rounding error (about 1%
 * of max|y|), so it is not the default; it stays for comparison.
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
enum { IMPL_AUTO = 0, IMPL_SCALAR = 1, IMPL_AVX2 = 2, IMPL_AVX2_I8 = 3 };
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

/* ---- int8-activation route (measurement only, see the top comment) ---- */

static void quantize_x_i8(const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *xq, float *dx) {
    int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                float a = xb[i] < 0.0f ? -xb[i] : xb[i];
                amax = a > amax ? a : amax;
            }
            float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            for (int i = 0; i < QK; i++) {
                float v = xb[i] * id; /* |v| <= 127; round half away from zero, no libm needed */
                xq[(r * nb + b) * QK + i] = (int8_t)(int)(v + (v >= 0.0f ? 0.5f : -0.5f));
            }
            dx[r * nb + b] = d;
        }
    }
}

static inline __attribute__((always_inline)) void tile_i8(const int8_t *xq, const float *dx, const float *sx,
                                                          int64_t nb, const uint8_t *wrow, int qt, float *y,
                                                          int64_t ldy, const int MT) {
    __m256 acc[4];
    float off[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(15);
    for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
    const int bb = block_bytes(qt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * bb;
        float d = f16c(blk), m = 0.0f;
        __m256i wq;
        if (qt == QT_Q8_0) {
            wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
        } else {
            const uint8_t *qs = blk + (qt == QT_Q4_1 ? 4 : 2);
            m = qt == QT_Q4_1 ? f16c(blk + 2) : -8.0f * d;
            __m128i v = _mm_loadu_si128((const __m128i *)qs);
            wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), mask);
        }
        /* maddubs wants unsigned x signed: move Q8_0's sign onto x */
        __m256i wu = qt == QT_Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
        for (int r = 0; r < MT; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (r * nb + b) * QK));
            if (qt == QT_Q8_0) xv = _mm256_sign_epi8(xv, wq);
            __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r * nb + b]), _mm256_cvtepi32_ps(s), acc[r]);
            if (qt != QT_Q8_0) off[r] += m * sx[r * nb + b];
        }
    }
    for (int r = 0; r < MT; r++) y[r * ldy] = kvq_hsum8(acc[r]) + off[r];
}

static void rows_i8(const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K, const uint8_t *w,
                    int64_t ldw, int qt, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    int64_t nb = K / QK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wrow = w + n * ldw;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4)
            tile_i8(xq + r * nb * QK, dx + r * nb, sx ? sx + r * nb : sx, nb, wrow, qt, y + r * ldy + n, ldy, 4);
        for (; r < M; r++)
            tile_i8(xq + r * nb * QK, dx + r * nb, sx ? sx + r * nb : sx, nb, wrow, qt, y + r * ldy + n, ldy, 1);
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
    const float *sx, *dx; /* int8 route only */
    const int8_t *xq;
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
        rows_i8(j->xq, j->dx, j->sx, j->M, j->K, j->w, j->ldw, j->qt, j->y, j->ldy, n0, n1);
    }
#endif
    return KVQ_OK;
}

/*
 * y[r * ldy + n] = sum_k x[r * ldx + k] * W[n, k]   for r < M, n < N.
 * w: N rows of ldw bytes, each starting with K/32 blocks of type qt (GGML type id: 2 Q4_0, 3 Q4_1, 8 Q8_0).
 * nthreads <= 0 means OpenMP's default. impl: 0 best available, 1 scalar, 2 AVX2 float32, 3 AVX2 int8 x.
 * Returns 0, or a negative KVQ_E* code (y untouched, except by KVQ_ENOMEM).
 */
int kvq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw, int qt,
               float *y, int64_t ldy, int nthreads, int impl) {
    int bb = block_bytes(qt);
    if (!bb) return KVQ_EBADTYPE;
    if (M < 0 || N < 0 || K <= 0 || K % QK || ldx < K || ldy < N) return KVQ_EBADSHAPE;
    if (ldw < K / QK * bb) return KVQ_EROWBYTES;
    int avx2 = KVQ_AVX2 && kvq_cpu_has_avx2();
    if (impl == IMPL_AUTO) impl = avx2 ? IMPL_AVX2 : IMPL_SCALAR;
    if (impl < IMPL_SCALAR || impl > IMPL_AVX2_I8 || (impl != IMPL_SCALAR && !avx2)) return KVQ_ENOIMPL;
    if (M == 0 || N == 0) return KVQ_OK;

    struct job j = {x, w, y, M, K, ldx, N, ldw, ldy, qt, impl, NULL, NULL, NULL};
    int64_t nb = K / QK;
    float *sx = NULL, *dx = NULL;
    int8_t *xq = NULL;
#if KVQ_AVX2
    if (impl == IMPL_AVX2_I8) {
        sx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
        dx = (float *)malloc(sizeof(float) * (size_t)(M * nb));
        xq = (int8_t *)malloc((size_t)(M * K));
        if (!sx || !xq || !dx) {
            free(sx), free(xq), free(dx);
            return KVQ_ENOMEM;
        }
        /* Block sums of x (exact, not from the int8 copy) for the offset term m * sum(x_block) of Q4_0/Q4_1. */
        for (int64_t r = 0; r < M; r++)
            for (int64_t b = 0; b < nb; b++) {
                const float *xb = x + r * ldx + b * QK;
                float s = 0.0f;
                for (int i = 0; i < QK; i++) s += xb[i];
                sx[r * nb + b] = s;
            }
        quantize_x_i8(x, M, K, ldx, xq, dx);
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
