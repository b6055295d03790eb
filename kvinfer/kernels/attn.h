/* Internal to the attention sources (attn.c, attn_kv8.c, kvstore.c, amx/attn_prompt.c): the fixed piece size,
 * the 8-bit caches' groups and their rotation, and the parts the files share. */
#ifndef KVINFER_ATTN_H
#define KVINFER_ATTN_H
#include "internal.h"
#include "kernels.h"
#include "simd.h"

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK 256
/* Query tokens of one sequence whose pieces are computed together (each row read once for all; a bfloat16 cache's
 * rows widened once for all). 16 rather than 4: faster long prefills (docs/BENCHMARKS.md). */
#define QTILE 16

/* ---- 8-bit caches: int8, or fp8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no infinities, max
 * 448); each group of KV_GROUP values of a row (the whole row when D is not a multiple) has a float32 scale (its
 * largest |value| / 127, or / 448): one outlier channel coarsens 32 values, not the whole head ---- */

#define KV_GROUP 32
static inline int64_t kv_group(int64_t D) { return D % KV_GROUP == 0 ? KV_GROUP : D; }

/* Rows of a head size that is a multiple of KV_GROUP are stored rotated: each group of R = KV_GROUP values goes
 * through an unnormalised Walsh-Hadamard transform (H H = R I) before it is quantised. An outlier channel is
 * spread over its group, so the group's scale, and with it every value's rounding step, shrinks; attention
 * rotates q the same way (q.k is unchanged: (H q / R).(H k) = q.k) and rotates its output back
 * (sum p H v = H sum p v). The butterflies run in a fixed order and 1/R is exact, so every level computes the
 * same bits. (Rotating whole 64-value heads instead was no better: docs/BENCHMARKS.md.) */
static inline void wht(float *x, int64_t n) {
    for (int64_t len = 1; len < n; len <<= 1)
        for (int64_t i = 0; i < n; i += len << 1)
            for (int64_t k = i; k < i + len; k++) {
                const float a = x[k], b = x[k + len];
                x[k] = a + b, x[k + len] = a - b;
            }
}

/* x[0:D] rotated group by group, times `mul` (1/R to go back, or 1 when storing). */
static inline void rotate(float *x, int64_t D, float mul) {
    for (int64_t c = 0; c < D; c += KV_GROUP) {
        wht(x + c, KV_GROUP);
        if (mul != 1.0f)
            for (int64_t e = 0; e < KV_GROUP; e++) x[c + e] = x[c + e] * mul;
    }
}

static inline int kv_rotated(int64_t D) { return D % KV_GROUP == 0; }

extern KVQ_HIDDEN float kvqi_fp8_table[256]; /* every e4m3 byte's value (kvstore.c) */

/* The pieces of query token t: [max(c * CHUNK, first), min((c + 1) * CHUNK, pos + 1)) for c = c0 .. c1 - 1. */
static inline int64_t first_pos(const struct kvq_attn *j, int64_t t) {
    const int64_t pos = j->tok_pos[t];
    return j->window > 0 && pos + 1 > j->window ? pos + 1 - j->window : 0;
}

static inline int64_t num_pieces(const struct kvq_attn *j, int64_t t) {
    return j->tok_pos[t] / CHUNK - first_pos(j, t) / CHUNK + 1;
}

/* attn.c: the job's shape and block ids checked (both routes); C pieces of a query head merged in order. */
KVQ_HIDDEN int kvqi_attn_check(const struct kvq_attn *jp);
KVQ_HIDDEN void kvqi_attn_merge(const float *part, int64_t C, int64_t G, int64_t D, float *out);
/* attn_kv8.c: the fast piece of an 8-bit cache with D a multiple of KV_GROUP, and its per-thread scratch. */
KVQ_HIDDEN void kvqi_piece8(const struct kvq_attn *j, int64_t t, int64_t g, int64_t p0, int64_t p1, char *scr,
                            float *part, int DT);
KVQ_HIDDEN size_t kvqi_piece8_scratch(int64_t G, int64_t D);
#endif
