/* Internal to the K-quant sources (kquants.c: the matmul and embedding rows over GGUF super-blocks; kquants_kept.c:
 * the kept copies, their packing and readback, and the route that reads them): the job, and the kept copy's
 * layout, which both files read. */
#ifndef KVINFER_KQUANTS_H
#define KVINFER_KQUANTS_H
#include "internal.h"
#include "kernels.h"
#include "simd.h"
#include "types.h"

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define KG 8 /* output columns per group: one 8-lane vector */

struct kq_job {
    const int16_t *xq;
    const float *dx, *sx, *bias;
    const float *sx16; /* Q2_K: the exact float sum of each 16 activations [M, K / 16] (else NULL) */
    const int32_t *c16; /* Q6_K, Q3_K over a kept copy: what D takes back per 16 activations [M, K / 16] (kc_off) */
    const uint8_t *w;
    float *y;
    int64_t M, K, N, ldw, ldy;
    int qt;
    const uint8_t *kept; /* avx2: the weight's kept copy, read by this route instead of the GGUF rows (or NULL) */
};

#if KVQ_LEVEL >= 2
#define KC 16 /* output columns per kept group (below): one 512-bit register of int32 */
#elif KVQ_LEVEL == 1
#define KC 8 /* one 256-bit register (= KG) */
#define KC_ROUTE_ROWS 2 /* rows up to which the copy's own route runs (docs/BENCHMARKS.md) */
#endif

/* Q4_K and Q5_K quants are unsigned and below 32, so they can be vpdpbusd's unsigned operand against the signed hi
 * bytes: D = 256 * sum(hi q) + sum(lo q), the same int32 without S, whose dot products cost as much as hi's at one
 * row. Q6_K and Q3_K do the same with their stored, unsigned quants u = q + off (kc_off) and take off times the
 * activations' sums back (kq_job.c16). Their activations come with hi as a signed byte (kvq_split_bytes without the
 * + 128); IQ4_XS's table values are signed, so its hi bytes keep the + 128. */
static inline int kc_signed_hi(int qt) { return qt != QT_IQ4_XS; }
static inline int kc_off(int qt) { return qt == QT_Q6_K ? 32 : qt == QT_Q3_K ? 4 : 0; }
/* Whether lo multiplies the stored u too (c16 then takes off * sum(x) back), or q = u - off (c16: off * 256 *
 * sum(hi)): at avx2 vpmaddubsw's sums of two lo * u pairs would pass 2^15 for Q6_K's u < 64. */
static inline int kc_lo_stored(int qt) { return KVQ_LEVEL >= 2 || qt == QT_Q3_K; }

#if KVQ_LEVEL >= 1
/* ---- kept copies (the avx2 and avx512 levels): the super-blocks of KC output columns laid out once ----
 * kvq_amx_tiles_pack hands K-quant weights here, and kvq_kq_matmul reads the copy it is passed instead of the GGUF
 * rows. Per group of KC columns (16 at the avx512 level, 8 at avx2), super-block after super-block (kc_sb_bytes
 * each, a multiple of 64), in rows of R = 4 KC bytes (4 bytes of each column):
 *   Q4_K / Q5_K: the 128 quant bytes as 32 rows (row 8c + k: bytes 32c + 4k..32c + 4k + 3 of each column: low
 *   nibbles are sub-block 2c's quants 4k.., high nibbles sub-block 2c + 1's), Q5_K then its 32 high-bit bytes as
 *   8 rows the same way (bit j: sub-block j), then sc[j][column], m[j][column] (one byte each), then the KC
 *   columns' d, dmin as fp16 bits.
 *   Q6_K: ql as 32 rows (row 16h + 8p + k: ql[64h + 32p + 4k..]), qh as 16 rows (row 8h + k: qh[32h + 4k..]),
 *   sc[t][column] (int8), the KC d as fp16 bits, padding.
 *   Q3_K: qs as 16 rows (row 8h + k: qs[32h + 4k..]), hmask as 8 rows (row k: hmask[4k..]), sc_j - 32
 *   [j][column] (int8), the KC d as fp16 bits, padding.
 *   IQ4_XS (the avx512 level only: at avx2 its table's values would saturate vpmaddubsw's int16 pair sums): qs as
 *   32 rows (row 4j + k: qs[16j + 4k..]; low nibbles are sub-block j's values 4k.., high nibbles 16 + 4k..), then
 *   ls_j - 32 [j][column] (int8), the KC d as fp16 bits, padding.
 *   Q2_K: qs as 16 rows (row 8h + k: qs[32h + 4k..]; bits 2g.. of a byte are sub-blocks 8h + 2g and 8h + 2g + 1's
 *   quants), the 16 scale bytes [t][column] as stored, then the KC d and the KC dmin as fp16 bits.
 * That is the GGUF bytes' size (plus 0-5%), so a one-row decode reads no more. A 32-value block's 8 rows of quants
 * meet the activations' two bytes (hi, lo; kvq_split_bytes) in byte dot products (vpdpbusd at the avx512 level;
 * vpmaddubsw + vpmaddwd at avx2, whose int16 pair sums stay below 2^15 for these quants). IQ4_XS's hi comes + 128,
 * as qmatmul.c's kept_rows has it: with S the column's sum of q, D = 256 * (sum((hi + 128) q) - 128 S) + sum(lo q).
 * The others' hi is signed (kc_signed_hi). D is the exact int32 kq_cols computes, then its float operations in its
 * order, one column per lane: the same bits. */
#define KC_R (4 * KC) /* bytes per row of the copy */
#if KVQ_LEVEL >= 2
#define KC_MT 16 /* x rows per tile */
#else
#define KC_MT 4 /* (up to KC_ROUTE_ROWS rows at 16 activation bits; every row at 8) */
#endif
#define KC_AHEAD 4 /* super-blocks of the copy asked for ahead of the one multiplied */

/* Where the scales start (Q4_K / Q5_K), and a super-block's bytes in the copy. */
static inline int kc_so(int qt) { return qt == QT_Q5_K ? 40 * KC_R : 32 * KC_R; }
static inline int kc_sb_bytes(int qt) {
    switch (qt) {
    case QT_Q4_K:
    case QT_Q5_K: return kc_so(qt) + 20 * KC;
    case QT_Q6_K: return (210 * KC + 63) / 64 * 64;
    case QT_Q3_K: return (114 * KC + 63) / 64 * 64;
    case QT_IQ4_XS: return kvq_type_kept(qt) ? (138 * KC + 63) / 64 * 64 : 0;
    case QT_Q2_K: return kvq_type_kept(qt) ? (84 * KC + 63) / 64 * 64 : 0;
    default: return 0;
    }
}
#define KC6_SC (48 * KC_R)          /* Q6_K: int8 scales */
#define KC6_D (48 * KC_R + 16 * KC) /* Q6_K: d */
#define KC3_SC (24 * KC_R)          /* Q3_K: sc_j - 32 */
#define KC3_D (24 * KC_R + 16 * KC) /* Q3_K: d */
#define KI_LS (32 * KC_R)         /* IQ4_XS: ls_j - 32 */
#define KI_D (32 * KC_R + 8 * KC) /* IQ4_XS: d */
#define KC2_SC (16 * KC_R)         /* Q2_K: scale bytes as stored (sc | m << 4) */
#define KC2_D (16 * KC_R + 16 * KC) /* Q2_K: d, then dmin */

#endif

/* This level's kept-copy routes, in one place: up to KC_OWN_ROWS rows (every row at 8 activation bits) the copy's
 * own route (kvqi_kc_cols, byte products) runs; above them (avx2) kq_cols reads the copy (kquants.c: kc_pairs8, or
 * kc_gguf8 back to GGUF bytes). The generic level keeps no copy (KC_OWN_ROWS < 0: a copy passed is not read). */
#if KVQ_LEVEL >= 2
#define KC_OWN_ROWS INT64_MAX
#elif KVQ_LEVEL == 1
#define KC_OWN_ROWS KC_ROUTE_ROWS
#else
#define KC KG
#define KC_OWN_ROWS (-1)
#endif

/* The kept copy's route over output columns n0..n1 (whole groups of KC), every row (kquants_kept.c; never called at
 * the generic level). */
KVQ_HIDDEN void kvqi_kc_cols(const struct kq_job *j, const uint8_t *xu, const uint8_t *kept, int64_t n0, int64_t n1);
KVQ_HIDDEN void kvqi_kc_run(const struct kq_job *j, const uint8_t *xu, const uint8_t *kept, int64_t u, int64_t runs,
                            int64_t groups);
#endif
