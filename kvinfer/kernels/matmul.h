/* Internal to the matmul sources (qmatmul.c, fmatmul.c, matmul.c, kept.c, amx/): the job a matmul call runs, the
 * tile sizes, and the kept copy's layout. Functions shared between those files are declared here with hidden
 * visibility (kvqi_ names): the library's ABI stays kernels.h. */
#ifndef KVINFER_MATMUL_H
#define KVINFER_MATMUL_H
#include "internal.h"
#include "kernels.h"
#include "simd.h"
#include "types.h"

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* The avx512 level built with the AMX flags: the int8 tile route, the kept copy's 16-column layout and the
 * vector route over it exist (the OS grant is asked for at run time, kvq_amx_enable). */
#if KVQ_LEVEL >= 2 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVQ_HAVE_AMX 1
#endif

#define QK 32
#if KVQ_LEVEL >= 2
#define MT_MAX 16 /* x rows per tile of quantised weights (a row holds one accumulator at this level) */
#else
#define MT_MAX 8 /* x rows per tile of quantised weights */
#endif
#define NG 8                         /* output columns per group: one 8-lane vector of results */
#define MF_MAX 4                     /* x rows per tile of float weights (2 accumulators each in registers) */
#define W_SLAB_BYTES (256 * 1024)    /* weight rows kept in L2 while successive row tiles revisit them */
#define MIN_BYTES_PER_THREAD (16 * 1024)
/* Weight bytes ahead of the block being read that a first pass over a slab asks the cache for. The hardware
 * prefetchers alone leave a one-row decode short (docs/BENCHMARKS.md). Later row tiles find the slab in L2 and
 * skip it. */
#define PREFETCH_BYTES 1024
#if KVQ_LEVEL >= 2
#define QNG 16 /* output columns per group of the quantised route: one per lane (tile_q_lanes) */
#else
#define QNG NG
#endif

/* Bytes per block of a 32-weight type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), per element of a float type; 0 for
 * any other type. */
static inline int block_bytes(int qt) { return kvq_type_bytes(qt, QK); }
static inline int elem_bytes(int qt) { return kvq_type_bytes(qt, 1); }
/* Of a 32-weight type: whether it adds a minimum per block (w = d * q + m: Q4_1, Q5_1); whether its quants have a
 * fifth bit (Q5_0, Q5_1: bit i of the little-endian dword qh for element i) and where qh is; where its nibbles (or
 * Q8_0's bytes) start; and the offset its quants are stored with (w = d * (q - offset): Q4_0 8, Q5_0 16). */
static inline int q_has_min(int qt) { return qt == QT_Q4_1 || qt == QT_Q5_1; }
static inline int q_has_qh(int qt) { return qt == QT_Q5_0 || qt == QT_Q5_1; }
static inline int q_qh_offset(int qt) { return qt == QT_Q5_1 ? 4 : 2; }
static inline int q_qs_offset(int qt) { return qt == QT_Q5_1 ? 8 : qt == QT_Q5_0 ? 6 : qt == QT_Q4_1 ? 4 : 2; }
static inline int q_offset(int qt) { return qt == QT_Q4_0 ? 8 : qt == QT_Q5_0 ? 16 : 0; }
/* IQ4_NL: d qs[16], w = d * KQ_IQ4NL[nibble] (Q4_0's nibbles through a table): Q8_0's arithmetic on the table's
 * integers, the bits of the same blocks rewritten as Q8_0 (gguf_plan.as_q8_0). */
static inline int q_is_nl(int qt) { return qt == QT_IQ4_NL; }

static inline float load_w1(const uint8_t *row, int64_t k, int qt) {
    if (qt == QT_F32) return ((const float *)row)[k];
    uint16_t h = ((const uint16_t *)row)[k];
    return qt == QT_BF16 ? kvq_bf16(h) : kvq_half(h);
}

struct job {
    const float *x, *bias;
    const uint8_t *w;
    float *y;
    int64_t M, K, ldx, N, ldw, ldy;
    int qt;
    const int16_t *xq;
    const float *dx, *sx;
    const uint8_t *xu, *kept; /* kept_rows' activation bytes and the weight's kept copy, or NULL */
};

/* The row tiles of each route, indexed by the number of rows (1..max): a route per level, chosen where the
 * tables are defined (qmatmul.c, fmatmul.c). */
typedef void (*tile_q_fn)(const int16_t *, const float *, const float *, int64_t, const uint8_t *, int64_t, int,
                          float *, int64_t, int64_t, int64_t, int);
typedef void (*tile_f_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, int, float *, int64_t, int64_t,
                          int64_t);
typedef void (*kept_fn)(const uint8_t *, const float *, const float *, int64_t, int, const uint8_t *, float *,
                        int64_t, int64_t, int64_t);
extern KVQ_HIDDEN const tile_q_fn kvqi_tiles_q[MT_MAX + 1];
extern KVQ_HIDDEN const tile_f_fn kvqi_tiles_f[];
extern KVQ_HIDDEN const int kvqi_mf_max; /* rows per float tile */
/* the vector route over a kept copy (KVQ_HAVE_AMX; NULL entries elsewhere, where no job has a kept copy) */
extern KVQ_HIDDEN const kept_fn kvqi_kepts[MT_MAX + 1];

#if KVQ_LEVEL >= 2
/* out[t], lane c: dword t (t = 0..3) of the 16 bytes at p[c] + off. */
static inline __attribute__((always_inline)) void dw_transpose16x4(const uint8_t *const *p, int64_t off,
                                                                   __m512i out[4]) {
    __m512i s[4];
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[4 * i] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[4 * i + 1] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[4 * i + 2] + off)), 2);
        s[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[4 * i + 3] + off)), 3);
    }
    /* s[i] dword 4k + t: column 4i + k's dword t. Lanes 0-7: dword t of columns 0-7 (or 8-15), lanes 8-15: t+1 */
    const __m512i i01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i i23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i ab01 = _mm512_permutex2var_epi32(s[0], i01, s[1]), ab23 = _mm512_permutex2var_epi32(s[0], i23, s[1]);
    const __m512i cd01 = _mm512_permutex2var_epi32(s[2], i01, s[3]), cd23 = _mm512_permutex2var_epi32(s[2], i23, s[3]);
    out[0] = _mm512_shuffle_i64x2(ab01, cd01, 0x44);
    out[1] = _mm512_shuffle_i64x2(ab01, cd01, 0xee);
    out[2] = _mm512_shuffle_i64x2(ab23, cd23, 0x44);
    out[3] = _mm512_shuffle_i64x2(ab23, cd23, 0xee);
}

#endif

#ifdef KVQ_HAVE_AMX
/* Rows from which the int8 tiles run. Tiles vs vectors, end to end: the vector route won up to 20 sequences, the
 * tiles drew at 24 and won at 32 (docs/BENCHMARKS.md, "Figures behind code decisions"). */
#define AMX_MIN_ROWS 24
#define AMX_COLS 32 /* output columns per pass: two 16-column tiles */
extern KVQ_HIDDEN int kvqi_amx_on; /* the int8 tiles are granted and in use (kvq_amx_enable) */
KVQ_HIDDEN uint8_t *kvqi_amx_scratch(size_t n); /* a thread's tile operands, kept between calls */
KVQ_HIDDEN int kvqi_amx_matmul(const struct job *j, int16_t *xq, float *dx, float *sx, int nt, const uint8_t *kept);
KVQ_HIDDEN void kvqi_amx_pack(const uint8_t *w, int64_t ldw, int qt, int64_t nb, int64_t c0, int64_t c1, int8_t *bt,
                              float *d, float *m);
/* ---- weights kept in tile layout ----
 * Unpacking a pass of weights costs about a third of a 16-row matmul, every call. A weight may instead be
 * unpacked once (kvq_amx_tiles_pack) and passed with it (kvq_matmul's kept); its matmuls then read that copy: the AMX
 * route loads its tiles straight from it, and below AMX_MIN_ROWS (or with the tiles off) the vector route's
 * kept_rows reads it instead of transposing the GGML blocks. Per 16 output columns (a group, kept_group_bytes
 * apart): a plane of quants, block after block (kept_quants: Q8_0 as 8 rows of 64 bytes, row k holding quants
 * 32 b + 4 k + i of each column; 4-bit types as the GGML nibbles, 4 rows; Q5_0 / Q5_1 those 4 rows and a fifth of
 * their fifth bits, bit k of byte 4 c + i holding column c's bit 4 k + i of qh, so that bit k of every byte is row k
 * of Q8_0's layout), then the blocks' d of the 16 columns as fp16 bits, then (Q4_1, Q5_1) their m. That is the GGML
 * bytes' size (Q8_0: 544 per block of 16 columns, Q4_1: 320, Q5_0: 352, Q4_0 and IQ4_NL: 288), so a one-row decode
 * reads no more than
 * from the GGML rows. Same quants into the same exact integer products: same results (the gain: docs/BENCHMARKS.md,
 * "Figures behind code decisions"). */
#define KEPT_COLS 16
static inline int kept_qbytes(int qt) { /* quants of a block of 16 columns */
    return qt == QT_Q8_0 ? 8 * 64 : q_has_qh(qt) ? 5 * 64 : 4 * 64;
}
static inline int64_t kept_group_bytes(int64_t nb, int qt) {
    const int64_t b = nb * (kept_qbytes(qt) + KEPT_COLS * 2 * (q_has_min(qt) ? 2 : 1));
    return (b + 63) / 64 * 64;
}

/* Block b's quants of a kept group as 8 rows of 64 signed bytes (row k: quants 4k..4k+3 of each column, minus
 * q_offset). A 4-bit group keeps the GGML nibbles, row k (k < 4) holding the 4 bytes 4k..4k+3 of each column's
 * block: low nibbles are quants 4k.., high nibbles quants 16 + 4k...; a 5-bit group's fifth-bit row adds 16 where
 * its bit k is set (a mask per row: one test and one masked add); IQ4_NL's nibbles index its table (a byte
 * shuffle). */
static inline __attribute__((always_inline)) void kept_quants(const uint8_t *gq, int64_t b, int qt, __m512i W[8]) {
    if (qt == QT_Q8_0) {
        for (int k = 0; k < 8; k++) W[k] = _mm512_load_si512(gq + b * 512 + 64 * k);
        return;
    }
    const int qb = kept_qbytes(qt);
    const __m512i lo = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8), f0 = _mm512_set1_epi8((char)0xf0);
    for (int k = 0; k < 4; k++) {
        const __m512i v = _mm512_load_si512(gq + b * qb + 64 * k);
        if (qt == QT_Q5_0) { /* the nibble with bits 4..7 set is nibble - 16; the fifth bit adds the 16 back */
            W[k] = _mm512_or_si512(v, f0);
            W[k + 4] = _mm512_or_si512(_mm512_srli_epi16(v, 4), f0);
            continue;
        }
        W[k] = _mm512_and_si512(v, lo);
        W[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
        if (q_is_nl(qt)) {
            const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KQ_IQ4NL));
            W[k] = _mm512_shuffle_epi8(tbl, W[k]), W[k + 4] = _mm512_shuffle_epi8(tbl, W[k + 4]);
        }
        if (qt == QT_Q4_0) W[k] = _mm512_sub_epi8(W[k], eight), W[k + 4] = _mm512_sub_epi8(W[k + 4], eight);
    }
    if (q_has_qh(qt)) {
        const __m512i h = _mm512_load_si512(gq + b * qb + 4 * 64), sixteen = _mm512_set1_epi8(16);
        for (int k = 0; k < 8; k++)
            W[k] = _mm512_mask_add_epi8(W[k], _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << k))), W[k],
                                        sixteen);
    }
}

#endif
#endif
