/* Drawing one token from a row of logits: temperature, top-k, top-p (nucleus) and min-p, then one uniform number
 * u in [0, 1) by inverse CDF. The sampler calls it for every sampled row on the CPU (a step's plain rows at once
 * through kvq_sample_rows), and the fused multi-step decode (kvq_decode_steps) calls it between steps, so a token
 * is the same whether its step was fused or not.
 *
 * The arithmetic, fixed: x = logit / temperature (float32); top-k keeps x >= the k-th largest x (ties kept);
 * e = exp(x - max x) by the vector exp every level shares (simd.h), exactly 0 where a token is masked (a -inf
 * logit, top-k) or below min_p * (largest e); top-p keeps the tokens whose mass ranked before them (largest e
 * first, ties by index) is below top_p times the total; the draw finds the first index whose running mass, in
 * index order and in double, exceeds u times the kept total (summed chunk by chunk: chunked_total). Probabilities
 * are never normalised: the draw scales u instead, the same distribution without a division per token.
 */
#include "kernels.h"
#include "simd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The k-th largest of a[0..n) (1 <= k <= n, no NaN), reordering a: Hoare's selection. */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1; /* index of the k-th largest in descending order */
    while (lo < hi) {
        const float pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const float t = a[i];
                a[i] = a[j], a[j] = t;
                i++, j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* The k-th largest of x[0..n) (1 <= k <= n, no NaN) through a min-heap of the k largest seen (heap: k floats):
 * one comparison per value once the heap holds values as large as most of the row. */
static float kth_largest_heap(const float *x, int64_t n, int64_t k, float *heap) {
    int64_t size = 0;
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        int64_t j;
        if (size < k) { /* sift up */
            j = size++;
            while (j > 0 && heap[(j - 1) / 2] > v) {
                heap[j] = heap[(j - 1) / 2];
                j = (j - 1) / 2;
            }
            heap[j] = v;
            continue;
        }
        if (!(v > heap[0])) continue;
        j = 0; /* replace the smallest, sift down */
        for (;;) {
            int64_t c = 2 * j + 1;
            if (c >= k) break;
            if (c + 1 < k && heap[c + 1] < heap[c]) c++;
            if (!(heap[c] < v)) break;
            heap[j] = heap[c];
            j = c;
        }
        heap[j] = v;
    }
    return heap[0];
}

struct ranked {
    float e;
    int64_t i;
};

static int by_rank(const void *pa, const void *pb) {
    const struct ranked *a = (const struct ranked *)pa, *b = (const struct ranked *)pb;
    if (a->e != b->e) return a->e > b->e ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

#define NUCLEUS_BUCKETS 4096 /* by a positive float's top 12 bits after the sign: exponent + 4 mantissa bits */

static inline uint32_t bucket_of(float e) {
    uint32_t b;
    memcpy(&b, &e, 4);
    return b >> 19;
}

/* Top-p over e[0..n) (entries >= 0; total = their sum, > 0): zeroes the tokens outside the nucleus. The mass
 * ranked before a token is the sums of the buckets above its own (each summed in index order, added from the
 * top), plus the tokens ranked before it in its bucket;
 * every token of a lower bucket has at least the mass of all higher ones, so the cut falls in one bucket, the only
 * one sorted. Returns KVQ_ENOMEM when out of memory, else 0. */
static int nucleus(float *e, int64_t n, double total, double top_p) {
    double *sums = (double *)calloc(NUCLEUS_BUCKETS, sizeof(double));
    if (!sums) return KVQ_ENOMEM;
    for (int64_t i = 0; i < n; i++)
        if (e[i] > 0.0f) sums[bucket_of(e[i])] += e[i];
    const double target = top_p * total;
    double before = 0.0;
    int cut = -1;
    for (int b = NUCLEUS_BUCKETS - 1; b >= 0; b--) {
        if (sums[b] == 0.0) continue;
        if (before + sums[b] >= target) {
            cut = b;
            break;
        }
        before += sums[b];
    }
    free(sums);
    if (cut < 0) return 0; /* rounding kept the target out of reach: every token stays */
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (e[i] > 0.0f && (int)bucket_of(e[i]) == cut) m++;
    struct ranked *r = (struct ranked *)malloc(sizeof(struct ranked) * (size_t)m);
    if (!r) return KVQ_ENOMEM;
    m = 0;
    for (int64_t i = 0; i < n; i++)
        if (e[i] > 0.0f && (int)bucket_of(e[i]) == cut) r[m].e = e[i], r[m].i = i, m++;
    qsort(r, (size_t)m, sizeof(struct ranked), by_rank);
    double run = before;
    for (int64_t j = 0; j < m; j++) {
        if (run >= target) e[r[j].i] = 0.0f; /* the mass ranked before it reached top_p */
        run += r[j].e;
    }
    free(r);
    for (int64_t i = 0; i < n; i++)
        if (e[i] > 0.0f && (int)bucket_of(e[i]) < cut) e[i] = 0.0f;
    return 0;
}

/* The index of the first largest value of row[0..n) (a NaN counts as the largest, the first one wins): numpy's
 * argmax, which the sampler's greedy path takes (kvq_argmax_rows exposes it to the tests that hold the two equal). */
int64_t kvq_argmax_row(const float *row, int64_t n) {
    int64_t best = 0;
    if (row[0] != row[0]) return 0;
    for (int64_t i = 1; i < n; i++) {
        if (row[i] != row[i]) return i;
        if (row[i] > row[best]) best = i;
    }
    return best;
}

#define CHUNK 64 /* the draw's unit: a chunk's mass is summed first, then the chunk holding the target walked */

/* The sum of e[0..n) in double as the draw defines it: each chunk of CHUNK entries in 8 interleaved partial sums
 * (entry i into partial i % 8, in index order) added pairwise, the chunks' sums (kept in sums[]) in order. Plain C
 * with a fixed order of operations, so every level's build gives the same bits. */
static double chunked_total(const float *e, int64_t n, double *sums) {
    double total = 0.0;
    for (int64_t c = 0; c * CHUNK < n; c++) {
        const float *p = e + c * CHUNK;
        const int64_t len = n - c * CHUNK < CHUNK ? n - c * CHUNK : CHUNK;
        double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= len; i += 8)
            for (int l = 0; l < 8; l++) a[l] += (double)p[i + l];
        for (; i < len; i++) a[i % 8] += (double)p[i];
        sums[c] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        total += sums[c];
    }
    return total;
}

/* The filtered weights of a row into work (see kvq_sample_row for its layout): e = work + n, the chunks' sums
 * after it, their total in *total. Returns 0, 1 when the row has a NaN or nothing finite (the caller takes its
 * argmax instead), or a negative KVQ_E* code. */
static int weights(const float *logits, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                   float *work, double *total) {
    if (n <= 0 || !(temperature > 0.0f)) return KVQ_EBADSHAPE;
    float *x = work, *e = work + n;
    double *sums = (double *)(void *)(work + 2 * n + (n & 1)); /* 8-byte aligned: work is */
    const vf vt = vf_set1(temperature);
    vf vmx = vf_set1(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const vf v = vf_div(vf_load(logits + i), vt);
        vf_store(x + i, v);
        vmx = vf_max(vmx, v);
    }
    float mx = vf_hmax(vmx);
    for (; i < n; i++) {
        x[i] = logits[i] / temperature;
        if (x[i] > mx) mx = x[i];
    }
    int nan = 0;
    for (i = 0; i < n; i++) nan |= x[i] != x[i];
    if (nan || mx == -INFINITY) return 1;
    float thr = -INFINITY;
    if (top_k > 0 && top_k < n) {
        if (top_k <= n / 16) {
            thr = kth_largest_heap(x, n, top_k, e);
        } else {
            memcpy(e, x, sizeof(float) * (size_t)n);
            thr = kth_largest(e, n, top_k);
        }
    }
    const vf vm = vf_set1(mx);
    for (i = 0; i + 8 <= n; i += 8) vf_store(e + i, vf_exp(vf_sub(vf_load(x + i), vm)));
    for (; i < n; i++) e[i] = kvq_exp1(x[i] - mx);
    /* The largest e is exp(0) = 1 exactly, so min-p's floor is min_p itself. */
    const float floor_e = min_p > 0.0f ? min_p : 0.0f;
    for (i = 0; i < n; i++) e[i] = x[i] >= thr && x[i] > -INFINITY && e[i] >= floor_e ? e[i] : 0.0f;
    *total = chunked_total(e, n, sums);
    if (top_p < 1.0f) {
        if (nucleus(e, n, *total, top_p)) return KVQ_ENOMEM;
        *total = chunked_total(e, n, sums);
    }
    return 0;
}

/* The distribution kvq_sample_row draws from, as probabilities (e / total, rounded to float) in probs[0..n): a
 * point mass on the argmax for a row with a NaN or nothing finite. Returns 0 or a negative KVQ_E* code. */
int kvq_sample_probs(const float *logits, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                     float *probs, float *work) {
    double total = 0.0;
    const int rc = weights(logits, n, temperature, top_k, top_p, min_p, work, &total);
    if (rc < 0) return rc;
    if (rc == 1) {
        memset(probs, 0, sizeof(float) * (size_t)n);
        probs[kvq_argmax_row(logits, n)] = 1.0f;
        return 0;
    }
    const float *e = work + n;
    for (int64_t i = 0; i < n; i++) probs[i] = (float)((double)e[i] / total);
    return 0;
}

/* One token from logits[0..n) (temperature > 0; top_k <= 0 or >= n: off; top_p >= 1: off; min_p <= 0: off; u in
 * [0, 1)). work: kvq_sample_work_bytes(n) bytes, 8-byte aligned. A row with a NaN, or nothing finite,
 * gives its argmax (numpy's rule) instead. Returns the token, or a negative KVQ_E* code. */
int64_t kvq_sample_row(const float *logits, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                       double u, float *work) {
    double total = 0.0;
    const int rc = weights(logits, n, temperature, top_k, top_p, min_p, work, &total);
    if (rc < 0) return rc;
    if (rc == 1) return kvq_argmax_row(logits, n);
    const float *e = work + n;
    const double *sums = (const double *)(const void *)(work + 2 * n + (n & 1));
    int64_t i;
    /* The first index whose running mass exceeds u * total: the chunk by the chunks' sums, then within it entry
     * by entry from the mass before it (if rounding lets the target slip past a chunk's entries: its last kept
     * one). */
    const double target = u * total;
    double run = 0.0;
    int64_t last = -1;
    for (int64_t c = 0; c * CHUNK < n; c++) {
        const int64_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        if (sums[c] == 0.0) continue;
        if (run + sums[c] > target) {
            for (i = lo; i < hi; i++) {
                if (e[i] > 0.0f) {
                    run += e[i];
                    last = i;
                    if (run > target) return i;
                }
            }
            return last;
        }
        run += sums[c];
        for (i = hi - 1; i >= lo; i--)
            if (e[i] > 0.0f) {
                last = i;
                break;
            }
    }
    return last >= 0 ? last : kvq_argmax_row(logits, n); /* u * total rounded up to the total */
}

/* Bytes of kvq_sample_row's work buffer for a row of n logits. */
int64_t kvq_sample_work_bytes(int64_t n) {
    return (int64_t)sizeof(float) * (2 * n + (n & 1)) + (int64_t)sizeof(double) * (n / CHUNK + 1);
}

/* Rows [rows, n] of logits, each to a token: the argmax (temperature[r] <= 0) or kvq_sample_row's draw with u[r];
 * with allow ([rows, words] bits, token i of row r allowed iff bit i % 32 of word i / 32 is set), a forbidden
 * token counts as a -inf logit, as if the row had been masked first (the same token as masking, then
 * kvq_argmax_row or kvq_sample_row). Rows are independent and split over up to nthreads threads. Returns 0 or a
 * negative KVQ_E* code (out[r] of the rows done is set). */
int kvq_sample_rows(const float *logits, int64_t rows, int64_t n, const float *temperature, const int64_t *top_k,
                    const float *top_p, const float *min_p, const double *u, const uint32_t *allow, int64_t words,
                    int64_t *out, int nthreads) {
    if (rows <= 0 || n <= 0 || (allow && words * 32 < n)) return KVQ_EBADSHAPE;
    const int64_t wb = kvq_sample_work_bytes(n) + (int64_t)sizeof(float) * n; /* + the masked row */
    int rc = KVQ_OK;
#pragma omp parallel num_threads(nthreads > 1 && rows > 1 ? nthreads : 1)
    {
        float *work = (float *)malloc((size_t)wb);
        if (!work) {
#pragma omp atomic write
            rc = KVQ_ENOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!work) continue;
            const float *row = logits + r * n;
            if (allow) {
                float *masked = work + (wb - (int64_t)sizeof(float) * n) / (int64_t)sizeof(float);
                const uint32_t *bits = allow + r * words;
                for (int64_t i = 0; i < n; i++) masked[i] = bits[i >> 5] >> (i & 31) & 1u ? row[i] : -INFINITY;
                row = masked;
            }
            const int64_t t = temperature[r] > 0.0f
                ? kvq_sample_row(row, n, temperature[r], top_k[r], top_p[r], min_p[r], u[r], work)
                : kvq_argmax_row(row, n);
            out[r] = t;
            if (t < 0) {
#pragma omp atomic write
                rc = (int)t;
            }
        }
        free(work);
    }
    return rc;
}
