/* kvq_matmul: checks a call, rounds the activations once, and runs the rows on this level's route (matmul.h's
 * tables: the quantised tiles of qmatmul.c, the float tiles of fmatmul.c, the kept copy's vector route, or from
 * AMX_MIN_ROWS rows amx/qmatmul_int8.c), threads splitting the output columns; and kvq_embed_rows, the embedding
 * lookup. */
#include "matmul.h"

/* Columns n0..n1 of every row: a pass of rows (whose activations stay in the core's cache) meets the columns a slab
 * of weights at a time (which stays there while the pass's row tiles revisit it). */
static void run_rows(const struct job *j, int64_t n0, int64_t n1) {
    const int64_t ng = j->xq ? QNG : NG;
    const int64_t slab = W_SLAB_BYTES / j->ldw / ng * ng, nc = slab > 0 ? slab : ng; /* whole output groups */
    const int64_t nb = j->K / QK;
    const int mt = j->xq ? MT_MAX : kvqi_mf_max;
    const int64_t row_bytes = j->xq ? 2 * j->K : 4 * j->K, pr = KVQ_PASS_BYTES / row_bytes / mt * mt;
    const int64_t pass = pr > mt ? pr : mt;
    for (int64_t r0 = 0; r0 < j->M; r0 += pass) {
        const int64_t r1 = j->M - r0 < pass ? j->M : r0 + pass;
        for (int64_t c0 = n0; c0 < n1; c0 += nc) {
            const int64_t c1 = c0 + nc < n1 ? c0 + nc : n1;
            for (int64_t r = r0; r < r1; r += mt) {
                const int64_t h = r1 - r < mt ? r1 - r : mt;
                if (j->kept)
                    kvqi_kepts[h](j->xu + r * nb * 2 * QK, j->dx + r * nb, j->sx + r * nb, nb, j->qt, j->kept,
                                  j->y + r * j->ldy, j->ldy, c0, c1);
                else if (j->xq)
                    kvqi_tiles_q[h](j->xq + r * nb * QK, j->dx + r * nb, j->sx + r * nb, nb, j->w, j->ldw, j->qt,
                                    j->y + r * j->ldy, j->ldy, c0, c1, r == r0);
                else
                    kvqi_tiles_f[h](j->x + r * j->ldx, j->ldx, j->K, j->w, j->ldw, j->qt, j->y + r * j->ldy, j->ldy,
                                    c0, c1);
            }
        }
    }
    if (j->bias)
        for (int64_t r = 0; r < j->M; r++)
            for (int64_t n = n0; n < n1; n++) j->y[r * j->ldy + n] = j->y[r * j->ldy + n] + j->bias[n];
}

/* Run u of runs: whole groups of ng output columns. */
static void run_cols(const struct job *j, int64_t u, int64_t runs, int64_t groups, int64_t ng) {
    const int64_t e = groups * (u + 1) / runs * ng;
    run_rows(j, groups * u / runs * ng, e < j->N ? e : j->N);
}

int kvq_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int kvq_level(void) { return KVQ_LEVEL; }

/* This level's quantised routes beside the vector tiles, chosen here once: a build with the AMX flags has the int8
 * tiles (from kvq_amx_min_rows() rows, while kvq_amx_enable grants them) and reads kept copies (kvqi_kepts below
 * the tiles); other builds neither. */
static const struct {
    int kept;
    int (*amx)(const struct job *j, int16_t *xq, float *dx, float *sx, int nt, const uint8_t *kept);
} ROUTE = {
#ifdef KVQ_HAVE_AMX
    1, kvqi_amx_matmul
#else
    0, NULL
#endif
};

/* Returns 0, or a negative KVQ_E* code (y untouched). nthreads <= 0: OpenMP's default. Threads split the
 * output columns, never K, so the thread count cannot change a result. */
int kvq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw, int qt,
               const uint8_t *kept, const float *bias, float *y, int64_t ldy, int nthreads) {
    if (kq_is_kquant(qt)) return kvq_kq_matmul(x, M, K, ldx, w, N, ldw, qt, kept, bias, y, ldy, nthreads);
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
    /* a copy is read where this build has the kept route and keeps this type (float rows have no kept layout) */
    if (!bb || !ROUTE.kept || !kvq_type_kept(qt)) kept = NULL;
    /* (IQ4_NL stays on the vectors: its tile packing is not built, and the bits are the same) */
    if (bb && ROUTE.amx && !q_is_nl(qt) && kvq_amx_enable(-1) && M >= kvq_amx_min_rows()) { /* (it rounds x itself) */
        const int rc = ROUTE.amx(&j, xq, dx, sx, nt, kept);
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
    const int64_t work = N * row_bytes * (M < 8 ? 1 : M / 8); /* weight bytes, times row tiles at prefill sizes */
    if ((int64_t)nt > work / MIN_BYTES_PER_THREAD) nt = (int)(work / MIN_BYTES_PER_THREAD);
    if (nt > N) nt = (int)N;
    if (nt < 1) nt = 1;
    if (bb) { /* the rows rounded (and split into bytes) by the same threads, whole rows each */
        const int pt = M * K >= KVQ_PREP_PAR_MIN && M > 1 ? (nt < M ? nt : (int)M) : 1;
#pragma omp parallel for num_threads(pt) schedule(static) if (pt > 1)
        for (int c = 0; c < pt; c++) {
            const int64_t r0 = M * c / pt, r1 = M * (c + 1) / pt, nb = K / QK;
            if (r1 <= r0) continue;
            kvq_quantize_rows(x + r0 * ldx, r1 - r0, K, ldx, xq + r0 * K, dx + r0 * nb, sx + r0 * nb);
            if (xu) kvq_split_bytes(xq + r0 * K, r1 - r0, K, 128, xu + r0 * K * 2);
        }
    }
    if (nt == 1) {
        run_rows(&j, 0, N); /* no OpenMP region: saves its fixed cost on small calls */
    } else {
        /* runs of whole groups, taken by whichever thread is free (a host that stalls one thread leaves the others
         * the rest) */
        const int64_t ng = bb ? QNG : NG, groups = (N + ng - 1) / ng;
        const int64_t per = M >= KVQ_RUNS_MIN_ROWS ? KVQ_RUNS_PER_THREAD : 1, runs = groups < nt * per ? groups : nt * per;
        if (per == 1) {
#pragma omp parallel for num_threads(nt) schedule(static, 1)
            for (int64_t u = 0; u < runs; u++) run_cols(&j, u, runs, groups, ng);
        } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
            for (int64_t u = 0; u < runs; u++) run_cols(&j, u, runs, groups, ng);
        }
    }
    free(xq), free(dx), free(sx), free(xu);
    return KVQ_OK;
}

/* kvq_matmul with its arguments in one int64 array: ctypes converts each argument of a call separately, and one
 * pointer is several microseconds cheaper than thirteen scalars (QuantLinear's hot path). a[0..11] are kvq_matmul's
 * arguments in order without kept, a[12] is kept: the slots a caller writes per call (x, M, y, nthreads) keep their
 * places. */
int kvq_matmul_packed(const int64_t *a) {
    return kvq_matmul((const float *)(intptr_t)a[0], a[1], a[2], a[3], (const uint8_t *)(intptr_t)a[4], a[5], a[6],
                      (int)a[7], (const uint8_t *)(intptr_t)a[12], (const float *)(intptr_t)a[8],
                      (float *)(intptr_t)a[9], a[10], (int)a[11]);
}

/* Rows ids[0..n) of a GGML matrix (N rows of K elements, ldw bytes apart) as float32 out[n, K]: the embedding
 * lookup. The same floats as kvinfer.loaders.dequant: Q8_0 d * q, Q4_0 d * (q - 8), Q5_0 d * (q - 16), IQ4_NL
 * d * table[q], Q4_1 and Q5_1 d * q + m (a multiply, then an add), fp16 / bf16 widened exactly. Returns KVQ_EBADSHAPE (out untouched) if
 * an id is outside [0, N). */
static int embed_gguf_rows(const uint8_t *w, int64_t ldw, int qt, const int64_t *ids, int64_t n, int64_t N,
                           int64_t K, float *out);

int kvq_embed_rows(const uint8_t *w, int64_t ldw, int qt, const uint8_t *kept, const int64_t *ids, int64_t n,
                   int64_t N, int64_t K, float *out) {
    /* A weight with a kept copy (kept, as kvq_matmul takes it) may have dropped its GGUF rows (kvq_kept_rows): the
     * rows asked for come from the copy, byte for byte, and then decode as usual. */
    if (kept && n > 0 && K > 0) {
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
            else if (qt == QT_IQ4_NL)
                for (int i = 0; i < 16; i++) {
                    yb[i] = (float)KQ_IQ4NL[blk[2 + i] & 15] * d;
                    yb[i + 16] = (float)KQ_IQ4NL[blk[2 + i] >> 4] * d;
                }
            else if (qt == QT_Q4_0)
                for (int i = 0; i < 16; i++) {
                    yb[i] = (float)((blk[2 + i] & 15) - 8) * d;
                    yb[i + 16] = (float)((blk[2 + i] >> 4) - 8) * d;
                }
            else if (qt == QT_Q5_0) {
                uint32_t h;
                memcpy(&h, blk + 2, 4);
                for (int i = 0; i < 16; i++) {
                    yb[i] = (float)((int)((blk[6 + i] & 15) | (((h >> i) & 1u) << 4)) - 16) * d;
                    yb[i + 16] = (float)((int)((blk[6 + i] >> 4) | (((h >> (i + 16)) & 1u) << 4)) - 16) * d;
                }
            } else if (qt == QT_Q5_1) {
                const float m = kvq_half(kvq_rd16(blk + 2));
                uint32_t h;
                memcpy(&h, blk + 4, 4);
                for (int i = 0; i < 16; i++) {
                    yb[i] = (float)((blk[8 + i] & 15) | (((h >> i) & 1u) << 4)) * d + m;
                    yb[i + 16] = (float)((blk[8 + i] >> 4) | (((h >> (i + 16)) & 1u) << 4)) * d + m;
                }
            } else {
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
