/* ---- prompt rows on AMX bfloat16 tiles (kvq_matmul_prompt) ----
 * The engine may compute a prompt's rows by another route than generated tokens' rows, chosen by the row's role
 * (its position against the prompt's length), never by the batch: here each weight of a kept copy is widened
 * to the dequantizer's float (Q8_0 d * q, Q4_0 d * (q - 8), Q5_0 d * (q - 16), Q4_1 and Q5_1 d * q + m: a
 * multiply, then an add) and rounded
 * to bfloat16 (to nearest even), each activation too, and tdpbf16ps sums 32 K values per instruction into float
 * tiles, block after block in K order. A row's result depends on its own values only (whatever M, its place in
 * a tile or the thread count: threads split the columns), so a prompt row gets the same bits whatever else is
 * computed with it; but tdpbf16ps's rounding is the hardware's own (no order of float32 operations matched it on
 * the Intel Xeon this was written on), so the bits are this CPU's. One tile store per 16 x 16 outputs instead of
 * one per block is what makes it faster than the int8 tiles' route. */
#include "../matmul.h"

#ifdef KVQ_HAVE_AMX
#include <cpuid.h>

static int amx_bf16_on;

int kvq_amx_bf16_enable(int on) {
    unsigned a = 0, b = 0, c = 0, d = 0, a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (on >= 0) {
        const int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
        amx_bf16_on = on && kvqi_amx_on && ok && ((d >> 22) & 1) && ((a1 >> 5) & 1); /* AMX-BF16, AVX512_BF16 */
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
        const __m512 m = q_has_min(qt) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mh + b * KEPT_COLS)))
                                       : _mm512_setzero_ps();
        uint16_t *o = bt + b * 512;
        if (qt == QT_Q8_0 || q_has_qh(qt)) { /* 5-bit quants as bytes in Q8_0's rows (kept_quants) */
            __m512i W[8];
            if (qt != QT_Q8_0) kept_quants(g, b, qt, W);
            for (int k = 0; k < 8; k++) { /* dword c: quants 4k..4k+3 of col c -> rows 2k, 2k + 1 */
                const __m512i v = qt == QT_Q8_0 ? _mm512_load_si512(g + b * 512 + 64 * k) : W[k];
                __m512 w[4];
                for (int i = 0; i < 4; i++) {
                    w[i] = _mm512_mul_ps(
                        d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24)));
                    if (qt == QT_Q5_1) w[i] = _mm512_add_ps(w[i], m);
                }
                bf16p_pair(w[0], w[1], idx, o + 32 * (2 * k));
                bf16p_pair(w[2], w[3], idx, o + 32 * (2 * k + 1));
            }
        } else {
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
    else if (qt == QT_Q5_0) bf16p_pack_t(g, nb, QT_Q5_0, bt);
    else if (qt == QT_Q5_1) bf16p_pack_t(g, nb, QT_Q5_1, bt);
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
    uint16_t *bt = (uint16_t *)kvqi_amx_scratch(pass_bytes * (size_t)PC);
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

/* y = x W^T (+ bias) for prompt rows over W's kept copy: KVQ_EBADTYPE when the route is off, kept is NULL or the
 * type is IQ4_NL (whose tile packing is not built; the caller then uses kvq_matmul). */
BF16P_TARGET int kvq_matmul_prompt(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                                   int64_t ldw, int qt, const uint8_t *kept, const float *bias, float *y, int64_t ldy,
                                   int nthreads) {
    if (!amx_bf16_on || !block_bytes(qt) || q_is_nl(qt)) return KVQ_EBADTYPE;
    if (M < 0 || N < 0 || K <= 0 || K % QK || ldx < K || ldy < N) return KVQ_EBADSHAPE;
    if (ldw < K / QK * block_bytes(qt)) return KVQ_EROWBYTES;
    if (M == 0 || N == 0) return KVQ_OK;
    struct job j = {x, bias, w, y, M, K, ldx, N, ldw, ldy, qt, NULL, NULL, NULL, NULL, NULL};
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
#else
int kvq_amx_bf16_enable(int on) { /* no tiles at this level */
    (void)on;
    return 0;
}

int kvq_matmul_prompt(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw,
                      int qt, const uint8_t *kept, const float *bias, float *y, int64_t ldy, int nthreads) {
    (void)x, (void)M, (void)K, (void)ldx, (void)w, (void)N, (void)ldw, (void)qt, (void)kept, (void)bias, (void)y;
    (void)ldy;
    (void)nthreads;
    return KVQ_EBADTYPE;
}
#endif
