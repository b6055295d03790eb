/* Every weight type the kernels take, in one table: GGUF's type id, its name, elements and bytes per block, and the
 * levels at which a weight of that type may be kept in a copy laid out for the level's route (kvq_amx_tiles_pack).
 * Float types are blocks of one element. Every source reads block sizes from here; the Python side reads the same
 * table through kvq_type_traits (tests/test_kernel_traits.py checks it against kvinfer.kernels and gguf). */
#ifndef KVINFER_TYPES_H
#define KVINFER_TYPES_H
#include "ggml_blocks.h"
#include "kernels.h"

#include <stdint.h>

#define KVQ_KEPT_AT(level) (1 << (level)) /* a kept copy exists at this ISA level (KVQ_LEVEL) */
#define KVQ_KEPT_VNNI (KVQ_KEPT_AT(1) | KVQ_KEPT_AT(2))

struct kvq_type {
    const char *name; /* NULL: not a type the kernels take */
    int32_t block_elems, block_bytes;
    int32_t kept_levels; /* KVQ_KEPT_AT bits */
};

/* IQ4_XS has no avx2 copy: its table's values would saturate vpmaddubsw's int16 pair sums (kquants.h). The
 * 32-weight types are kept in the AMX tiles' layout, at the avx512 level only. */
#define KVQ_NTYPES 31
static const struct kvq_type KVQ_TYPES[KVQ_NTYPES] = {
    [QT_F32] = {"F32", 1, 4, 0},
    [QT_F16] = {"F16", 1, 2, 0},
    [QT_Q4_0] = {"Q4_0", 32, 18, KVQ_KEPT_AT(2)},
    [QT_Q4_1] = {"Q4_1", 32, 20, KVQ_KEPT_AT(2)},
    [QT_Q5_0] = {"Q5_0", 32, 22, KVQ_KEPT_AT(2)},
    [QT_Q5_1] = {"Q5_1", 32, 24, KVQ_KEPT_AT(2)},
    [QT_Q8_0] = {"Q8_0", 32, 34, KVQ_KEPT_AT(2)},
    [QT_Q2_K] = {"Q2_K", QK_K, 84, KVQ_KEPT_VNNI},
    [QT_Q3_K] = {"Q3_K", QK_K, 110, KVQ_KEPT_VNNI},
    [QT_Q4_K] = {"Q4_K", QK_K, 144, KVQ_KEPT_VNNI},
    [QT_Q5_K] = {"Q5_K", QK_K, 176, KVQ_KEPT_VNNI},
    [QT_Q6_K] = {"Q6_K", QK_K, 210, KVQ_KEPT_VNNI},
    [QT_IQ4_XS] = {"IQ4_XS", QK_K, 136, KVQ_KEPT_AT(2)},
    [QT_IQ4_NL] = {"IQ4_NL", 32, 18, KVQ_KEPT_AT(2)},
    [QT_BF16] = {"BF16", 1, 2, 0},
};

/* The type's entry, or NULL for an id the kernels do not take. */
static inline const struct kvq_type *kvq_type(int qt) {
    return qt >= 0 && qt < KVQ_NTYPES && KVQ_TYPES[qt].name ? &KVQ_TYPES[qt] : (const struct kvq_type *)0;
}

/* Bytes per block of qt when its blocks hold `elems` elements, else 0: the kernels are written per block family
 * (1: float rows, 32: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, QK_K: the 256-weight super-blocks). */
static inline int kvq_type_bytes(int qt, int elems) {
    const struct kvq_type *t = kvq_type(qt);
    return t && t->block_elems == elems ? t->block_bytes : 0;
}

/* Whether this level keeps a copy of a weight of type qt. */
static inline int kvq_type_kept(int qt) {
    const struct kvq_type *t = kvq_type(qt);
    return t && (t->kept_levels & KVQ_KEPT_AT(KVQ_LEVEL));
}

/* The 256-weight super-block types kquants.c reads (IQ4_XS is not a K-quant by name, but is one in shape). */
static inline int kq_is_kquant(int qt) { return kvq_type_bytes(qt, QK_K) != 0; }
static inline int kq_block_bytes(int qt) { return kvq_type_bytes(qt, QK_K); }
#endif
