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
 * Query heads h share kv head h / (H / KVH) (MHA, GQA and MQA alike). A work item is one sequence (or one
 * of its kv heads when there are fewer sequences than threads): each key and value row is read once for
 * all the query heads that share it. Scores are exact float32
 * softmax (max subtracted), so results match scaled_dot_product_attention up to summation order.
 */
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

enum { PA_OK = 0, PA_EBADSHAPE = -2, PA_ENOMEM = -4, PA_EBADBLOCK = -6 };

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
    __m256 v = _mm256_add_ps(acc0, acc1);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    s = _mm_cvtss_f32(lo);
#endif
    for (; i < d; i++) s += a[i] * b[i];
    return s;
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

struct pa_job {
    const float *q, *kpool, *vpool, *slopes;
    const int64_t *tables, *lens;
    float *out;
    int64_t B, H, KVH, D, BS, T, NB, window;
    float scale;
};

/* Sequence b, kv heads h0..h1-1 (and their query heads); scores is scratch of at least H * len floats.
 * Tokens are the outer loop: a block's rows ([KVH, D] per token) are read front to back exactly once. */
static int pa_item(const struct pa_job *j, int64_t b, int64_t h0, int64_t h1, float *scores) {
    const int64_t G = j->H / j->KVH, D = j->D, BS = j->BS, KVH = j->KVH;
    const int64_t len = j->lens[b];
    const int64_t first = (j->window > 0 && len > j->window) ? len - j->window : 0;
    const int64_t n = len - first;
    const int64_t *table = j->tables + b * j->T;
    const int64_t q0 = h0 * G, q1 = h1 * G; /* query heads of this item */
    const float *q = j->q + b * j->H * D;
    float *out = j->out + b * j->H * D;
    const int64_t row = KVH * D; /* floats per token in a block */

    for (int64_t t = first; t < len; t++) {
        int64_t blk = table[t / BS];
        if (blk < 0 || blk >= j->NB) return PA_EBADBLOCK;
        const float *k = j->kpool + (blk * BS + t % BS) * row;
        for (int64_t h = q0; h < q1; h++) scores[h * n + (t - first)] = dot(q + h * D, k + (h / G) * D, D) * j->scale;
    }
    for (int64_t h = q0; h < q1; h++) {
        float *s = scores + h * n;
        if (j->slopes) {
            float slope = j->slopes[h];
            for (int64_t i = 0; i < n; i++) s[i] += slope * (float)(first + i - (len - 1));
        }
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            s[i] = expf(s[i] - mx);
            sum += s[i];
        }
        float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; i++) s[i] *= inv;
        memset(out + h * D, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t t = first; t < len; t++) {
        const float *v = j->vpool + (table[t / BS] * BS + t % BS) * row;
        for (int64_t h = q0; h < q1; h++) axpy(out + h * D, scores[h * n + (t - first)], v + (h / G) * D, D);
    }
    return PA_OK;
}

/* Arguments packed in one int64 array (one ctypes conversion per call):
 * q, kpool, vpool, tables, lens, out, slopes, B, H, KVH, D, BS, T, NB, window, scale (float32 bits), nthreads */
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
    int32_t bits = (int32_t)a[15];
    memcpy(&j.scale, &bits, sizeof(float));
    int nthreads = (int)a[16];
    if (j.B < 0 || j.H <= 0 || j.KVH <= 0 || j.H % j.KVH || j.D <= 0 || j.BS <= 0 || j.T < 0 || j.NB <= 0)
        return PA_EBADSHAPE;
    int64_t maxlen = 0;
    for (int64_t b = 0; b < j.B; b++) {
        if (j.lens[b] <= 0 || j.lens[b] > j.T * j.BS) return PA_EBADSHAPE;
        if (j.lens[b] > maxlen) maxlen = j.lens[b];
    }
    if (j.B == 0) return PA_OK;
    int nt = nthreads > 0 ? nthreads : 1;
    /* Whole sequences per item when there are enough of them to keep the threads busy; otherwise one kv head
     * per item, so that a single sequence still uses every thread. */
    const int64_t per = j.B >= 2 * (int64_t)nt ? j.KVH : 1;
    const int64_t groups = j.KVH / per, items = j.B * groups;
    if (nt > items) nt = (int)items;
    int status = PA_OK;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(j.H * maxlen));
        /* Longest sequences vary a lot: hand out items one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t b = it / groups, h0 = it % groups * per;
            int rc = scores ? pa_item(&j, b, h0, h0 + per, scores) : PA_ENOMEM;
            if (rc) {
#pragma omp atomic write
                status = rc;
            }
        }
        free(scores);
    }
    return status;
}
