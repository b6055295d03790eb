/* Decode attention straight from the paged KV cache: one query token per sequence, keys and values read in
 * place through each sequence's block table (no gathered copy, no padding to the longest sequence).
 *
 *   q      float32 [B, H, D]              this step's queries (RoPE already applied)
 *   kpool  float32 [NB, BS, KVH, D]       one layer's key block pool; vpool the same for values
 *   tables int64   [B, T]                 block ids, T >= ceil(lens[b] / BS)
 *   lens   int64   [B]                    tokens in each sequence's cache, this step's token included
 *   out    float32 [B, H, D]
 *   slopes float32 [H] or NULL            ALiBi: score += slope * (key position - query position)
 *   window 0, or attend only to the last `window` positions (sliding-window attention)
 *
 * Query heads h share kv head h / (H / KVH) (MHA, GQA and MQA alike). A work item is one kv head of one
 * sequence with all the query heads that share it, so each key and value row is read once per step; with
 * too few sequences to occupy the threads, the items are chunks of a sequence's blocks whose partial
 * softmaxes are merged afterwards. Scores are exact float32 softmax (max subtracted), so results match
 * scaled_dot_product_attention up to summation order.
 */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PA_AVX2 1
#else
#define PA_AVX2 0
#endif

enum { PA_OK = 0, PA_EBADSHAPE = -2, PA_ENOMEM = -4 };


static inline float dot(const float *a, const float *b, int64_t d) {
    int64_t i = 0;
    float s = 0.0f;
#if PA_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = kvq_hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

#if PA_AVX2
/* exp of 8 floats: Cephes' expf polynomial after range reduction by ln 2 (about 2 ulp); inputs are clamped to
 * [-87, 88], so exp of a very negative score is ~1e-38 rather than 0, which no softmax sum can notice. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* s[i] = exp(s[i] - mx) for i < n; returns the sum. */
float kvq_exp_shift_sum(float *s, int64_t n, float mx) {
    int64_t i = 0;
    float sum = 0.0f;
#if PA_AVX2
    __m256 m = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, acc);
    for (int k = 0; k < 8; k++) sum += tmp[k];
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    return sum;
}

/* y[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u for i < n. */
void kvq_silu_mul(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = 0;
#if PA_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_sub_ps(zero, x));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* acc[0:d] += p * v[0:d] */
static inline void axpy(float *acc, float p, const float *v, int64_t d) {
    int64_t i = 0;
#if PA_AVX2
    __m256 pp = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < d; i++) acc[i] += p * v[i];
}

#if PA_AVX2
/* The loops over i < 8 below have constant bounds: gcc unrolls them and keeps the arrays in registers. */

/* acc[0:64] += sum over t in [t0, t1) of p[t] * v[t * row : t * row + 64] */
static inline void acc_block64(float *acc, const float *p, const float *v, int64_t row, int64_t t0, int64_t t1) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t t = t0; t < t1; t++) {
        const __m256 pp = _mm256_set1_ps(p[t]);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + t * row + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

/* s[t] = scale * dot(q, k[t * row : t * row + 64]) for t in [t0, t1), q held in registers. */
static inline void scores_block64(float *s, const float *q, const float *k, int64_t row, int64_t t0, int64_t t1,
                                  float scale) {
    __m256 qv[8];
    for (int i = 0; i < 8; i++) qv[i] = _mm256_loadu_ps(q + 8 * i);
    for (int64_t t = t0; t < t1; t++) {
        __m256 x[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* two chains hide the FMA latency */
        for (int i = 0; i < 8; i++) x[i & 1] = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + t * row + 8 * i), x[i & 1]);
        s[t] = kvq_hsum8(_mm256_add_ps(x[0], x[1])) * scale;
    }
}
#endif

/* Positions of block bi that lie in [first, len). */
static inline int64_t block_start(int64_t bi, int64_t bs, int64_t first) { return bi * bs > first ? bi * bs : first; }
static inline int64_t block_end(int64_t bi, int64_t bs, int64_t len) { return (bi + 1) * bs < len ? (bi + 1) * bs : len; }

/* Ask for the next block's rows of one kv head (D floats at offset off in each of its BS rows) while this
 * block is being worked on: blocks sit anywhere in the pool, so the hardware prefetchers cannot guess them. */
static inline void prefetch_rows(const float *pool, int64_t blk, int64_t NB, int64_t BS, int64_t row, int64_t off,
                                 int64_t D) {
    if (blk < 0 || blk >= NB) return; /* checked (and reported) when the block is reached */
    const char *p = (const char *)(pool + blk * BS * row + off);
    for (int64_t t = 0; t < BS; t++)
        for (int64_t i = 0; i < D * (int64_t)sizeof(float); i += 64) __builtin_prefetch(p + t * row * sizeof(float) + i);
}

/* One work item: sequence b, kv head g with the G query heads that share it, attended positions [t0, t1).
 * Writes, per query head, the unnormalised partial softmax (m = max score, l = sum of exp(s - m),
 * o = sum of exp(s - m) * v) to part[h * (D + 2)...]; an empty range gives l = 0. Tokens are the outer loop
 * and the G heads the inner one, so each key and value row is read from memory once for all of them.
 * scores is scratch of at least G * (t1 - t0) floats. */
static int pa_part(const struct pa_job *j, int64_t b, int64_t g, int64_t t0, int64_t t1, float *scores,
                   float *part) {
    const int64_t G = j->H / j->KVH, D = j->D, BS = j->BS, len = j->lens[b], n = t1 - t0;
    const int64_t *table = j->tables + b * j->T;
    const float *q = j->q + b * j->q_stride + g * G * D;
    const int64_t row = j->KVH * D; /* floats per token in a block */
    if (n <= 0) {
        for (int64_t h = 0; h < G; h++) {
            float *ph = part + h * (D + 2);
            ph[0] = -INFINITY, ph[1] = 0.0f;
            memset(ph + 2, 0, sizeof(float) * (size_t)D);
        }
        return PA_OK;
    }
    /* Block by block (no division per token). */
    for (int64_t bi = t0 / BS; bi * BS < t1; bi++) {
        const int64_t blk = table[bi];
        if (blk < 0 || blk >= j->NB) return KVQ_EBADBLOCK;
        const int64_t ts = block_start(bi, BS, t0), te = block_end(bi, BS, t1);
        const float *k = j->kpool + (blk * BS - bi * BS) * row + g * D;
        if ((bi + 1) * BS < t1) prefetch_rows(j->kpool, table[bi + 1], j->NB, BS, row, g * D, D);
        for (int64_t h = 0; h < G; h++) {
            float *s = scores + h * n - t0;
#if PA_AVX2
            if (D == 64) {
                scores_block64(s, q + h * D, k, row, ts, te, j->scale);
                continue;
            }
#endif
            for (int64_t t = ts; t < te; t++) s[t] = dot(q + h * D, k + t * row, D) * j->scale;
        }
    }
    for (int64_t h = 0; h < G; h++) {
        float *s = scores + h * n, *ph = part + h * (D + 2);
        if (j->slopes) {
            float slope = j->slopes[g * G + h];
            for (int64_t i = 0; i < n; i++) s[i] += slope * (float)(t0 + i - (len - 1));
        }
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
        ph[0] = mx;
        ph[1] = kvq_exp_shift_sum(s, n, mx);
        memset(ph + 2, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t bi = t0 / BS; bi * BS < t1; bi++) {
        const int64_t ts = block_start(bi, BS, t0), te = block_end(bi, BS, t1);
        const float *v = j->vpool + (table[bi] * BS - bi * BS) * row + g * D;
        if ((bi + 1) * BS < t1) prefetch_rows(j->vpool, table[bi + 1], j->NB, BS, row, g * D, D);
        for (int64_t h = 0; h < G; h++) {
            const float *p = scores + h * n - t0;
            float *o = part + h * (D + 2) + 2;
#if PA_AVX2
            if (D == 64) { /* the common head size: the accumulator stays in registers across the block */
                acc_block64(o, p, v, row, ts, te);
                continue;
            }
#endif
            for (int64_t t = ts; t < te; t++) axpy(o, p[t], v + t * row, D);
        }
    }
    return PA_OK;
}

int kvq_paged_decode_run(const struct pa_job *jp, int nthreads) {
    const struct pa_job j = *jp;
    if (j.B < 0 || j.H <= 0 || j.KVH <= 0 || j.H % j.KVH || j.D <= 0 || j.BS <= 0 || j.T < 0 || j.NB <= 0 ||
        j.q_stride < j.H * j.D || j.out_stride < j.H * j.D)
        return PA_EBADSHAPE;
    int64_t maxlen = 0;
    for (int64_t b = 0; b < j.B; b++) {
        if (j.lens[b] <= 0 || j.lens[b] > j.T * j.BS) return PA_EBADSHAPE;
        if (j.lens[b] > maxlen) maxlen = j.lens[b];
    }
    if (j.B == 0) return PA_OK;
    int nt = nthreads > 0 ? nthreads : 1;
    /* A work item is one (sequence, kv head) pair, or, when there are too few of those to give every thread
     * two, a chunk of that pair's blocks (flash-decoding's split): then each chunk's partial softmax is merged
     * below. Either way every key and value row is read once per step. */
    const int64_t G = j.H / j.KVH, D = j.D, pairs = j.B * j.KVH;
    const int64_t C = pairs >= 2 * (int64_t)nt ? 1 : (2 * nt + pairs - 1) / pairs;
    const int64_t items = pairs * C;
    float *part = (float *)malloc(sizeof(float) * (size_t)(items * G * (D + 2)));
    if (!part) return PA_ENOMEM;
    if (nt > items) nt = (int)items;
    int status = PA_OK;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * maxlen));
        /* Sequence lengths vary a lot: hand out items one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / (j.KVH * C), g = it / C % j.KVH, c = it % C, len = j.lens[b];
            const int64_t first = (j.window > 0 && len > j.window) ? len - j.window : 0;
            /* chunk c of C: whole blocks, as even as the block count allows */
            const int64_t b0 = first / j.BS, nblk = (len - 1) / j.BS + 1 - b0;
            int64_t t0 = (b0 + c * nblk / C) * j.BS, t1 = (b0 + (c + 1) * nblk / C) * j.BS;
            t0 = t0 > first ? t0 : first;
            t1 = t1 < len ? t1 : len;
            int rc = scores ? pa_part(&j, b, g, t0, t1, scores, part + it * G * (D + 2)) : PA_ENOMEM;
            if (rc) {
#pragma omp atomic write
                status = rc;
            }
        }
        free(scores);
    }
    if (status == PA_OK) {
        for (int64_t b = 0; b < j.B; b++)
            for (int64_t h = 0; h < j.H; h++) {
                const int64_t g = h / G;
                const float *p0 = part + ((b * j.KVH + g) * C * G + h % G) * (D + 2);
                const int64_t cs = G * (D + 2); /* between the chunks of one head */
                float mx = -INFINITY, l = 0.0f;
                for (int64_t c = 0; c < C; c++)
                    if (p0[c * cs + 1] > 0.0f && p0[c * cs] > mx) mx = p0[c * cs];
                float *out = j.out + b * j.out_stride + h * D;
                memset(out, 0, sizeof(float) * (size_t)D);
                for (int64_t c = 0; c < C; c++) {
                    const float *pc = p0 + c * cs;
                    if (pc[1] <= 0.0f) continue;
                    const float w = C == 1 ? 1.0f : expf(pc[0] - mx);
                    l += w * pc[1];
                    for (int64_t i = 0; i < D; i++) out[i] += w * pc[2 + i];
                }
                const float inv = 1.0f / l;
                for (int64_t i = 0; i < D; i++) out[i] *= inv;
            }
    }
    free(part);
    return status;
}

/* Arguments packed in one int64 array (one ctypes conversion per call):
 * q, kpool, vpool, tables, lens, out, slopes, B, H, KVH, D, BS, T, NB, window, scale (float32 bits), nthreads;
 * q and out are contiguous [B, H, D]. */
int kvq_paged_decode_packed(const int64_t *a) {
    struct pa_job j;
    j.q = (const float *)(intptr_t)a[0];
    j.kpool = (const float *)(intptr_t)a[1];
    j.vpool = (const float *)(intptr_t)a[2];
    j.tables = (const int64_t *)(intptr_t)a[3];
    j.lens = (const int64_t *)(intptr_t)a[4];
    j.out = (float *)(intptr_t)a[5];
    j.slopes = (const float *)(intptr_t)a[6];
    j.B = a[7], j.H = a[8], j.KVH = a[9], j.D = a[10], j.BS = a[11], j.T = a[12], j.NB = a[13], j.window = a[14];
    j.q_stride = j.out_stride = j.H * j.D;
    int32_t bits = (int32_t)a[15];
    memcpy(&j.scale, &bits, sizeof(float));
    return kvq_paged_decode_run(&j, (int)a[16]);
}
