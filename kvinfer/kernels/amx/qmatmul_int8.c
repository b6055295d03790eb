/* ---- AMX tiles (the avx512 level, when the OS grants the tile state): the same D_b, 16 rows x 32 columns ----
 * A tile multiply takes int8 operands, so each int16 activation is split exactly, x = 256 * hi + lo (hi signed,
 * lo unsigned): D_b = 256 * (hi . q) + (lo . q), two tile products per block, both exact in int32 and so is
 * their sum. The float work after it is tile_q's, operation for operation, 16 lanes at a time (each lane its own
 * IEEE operations, so the width is not part of the result). Used from AMX_MIN_ROWS rows (below it the vector
 * route was faster end to end). */
#include "../matmul.h"

#ifdef KVQ_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
/* (AMX_MIN_ROWS and AMX_COLS are in matmul.h: the driver and the kept layout use them too) */

int kvqi_amx_on;

/* on = 1: use the tiles if the OS grants their state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0: do
 * not; -1: change nothing. Returns whether they are used (process-wide). */
int kvq_amx_enable(int on) {
    if (on >= 0) kvqi_amx_on = on && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return kvqi_amx_on;
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
void kvqi_amx_pack(const uint8_t *w, int64_t ldw, int qt, int64_t nb, int64_t c0, int64_t c1, int8_t *bt,
                   float *d, float *m) {
    const int bb = block_bytes(qt), qoff = q_qs_offset(qt);
    const int64_t nc = c1 - c0;
    const __m128i mask = _mm_set1_epi8(15), off = _mm_set1_epi8((char)q_offset(qt));
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
                    lo[u] = _mm_and_si128(v, mask);
                    hi[u] = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
                    if (q_has_qh(qt)) { /* the fifth bits: elements 0..15 in lo, 16..31 in hi */
                        uint32_t h;
                        memcpy(&h, blk + q_qh_offset(qt), 4);
                        lo[u] = _mm_or_si128(lo[u], q5_high16(h & 0xffffu));
                        hi[u] = _mm_or_si128(hi[u], q5_high16(h >> 16));
                    }
                    lo[u] = _mm_sub_epi8(lo[u], off), hi[u] = _mm_sub_epi8(hi[u], off);
                }
            }
            float *db = d + b * AMX_COLS + cb, *mb = m + b * AMX_COLS + cb;
            if (full) {
                vf vd, vm;
                vf_load_half2_strided(row[0] + b * bb, (int)ldw, &vd, &vm); /* F16C: exact, as kvq_half */
                vf_store(db, vd);
                if (q_has_min(qt)) vf_store(mb, vm);
            } else {
                for (int u = 0; u < 8; u++) {
                    const int live = cb + u < nc;
                    db[u] = live ? _cvtsh_ss(kvq_rd16(row[u] + b * bb)) : 0.0f;
                    mb[u] = live && q_has_min(qt) ? _cvtsh_ss(kvq_rd16(row[u] + b * bb + 2)) : 0.0f;
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

/* A thread's AMX scratch (the operands of a span of its column passes), kept between calls: a fresh allocation of
 * this size is a fresh mapping, whose page faults cost more than the multiplies of a small matmul. At most
 * AMX_SCRATCH_BYTES (plus the passes' pointers) per thread, so the span stays in L2 and a large model's biggest
 * weight does not grow it. */
#define AMX_SCRATCH_BYTES (1536 * 1024)
uint8_t *kvqi_amx_scratch(size_t n) {
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
    uint8_t *scr = kvqi_amx_scratch(btb + 2 * fb + sizeof(void *) * (size_t)(2 * PC));
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
                kvqi_amx_pack(j->w, j->ldw, j->qt, nb, c0, c1, btp, dp, mp);
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
    if (q_has_min(j->qt)) /* Q4_1, Q5_1 */
        return kept ? amx_rows_t(j, xh, xl, n0, n1, kept, 1, 1) : amx_rows_t(j, xh, xl, n0, n1, NULL, 0, 1);
    return kept ? amx_rows_t(j, xh, xl, n0, n1, kept, 1, 0) : amx_rows_t(j, xh, xl, n0, n1, NULL, 0, 0);
}

/* Splits the int16 activations into their tile bytes and runs amx_rows on whole column passes per thread. */
int kvqi_amx_matmul(const struct job *j, int16_t *xq, float *dx, float *sx, int nt, const uint8_t *kept) {
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
        kvq_quantize_rows(j->x + r0 * j->ldx, r1 - r0, K, j->ldx, xq + r0 * K, dx + r0 * nb, sx + r0 * nb);
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
#else
int kvq_amx_enable(int on) { /* no tiles at this level */
    (void)on;
    return 0;
}

int kvq_amx_min_rows(void) { return 0; }
#endif
