/* The layout of every struct that abi.py mirrors with ctypes, as this compiler lays it out: tests compare each
 * mirror's size and field offsets with it (tests/test_kernel_abi.py), so a field added, dropped or reordered on
 * one side only fails a test instead of reading the wrong bytes. */
#include <stddef.h>
#include <string.h>

#include "kernels.h"

struct layout {
    const char *type, *field; /* field NULL: the struct's size */
    int64_t value;
};

#define SIZE(s) {#s, NULL, (int64_t)sizeof(struct s)}
#define AT(s, f) {#s, #f, (int64_t)offsetof(struct s, f)}

static const struct layout layouts[] = {
    SIZE(kvq_attn),
    AT(kvq_attn, q), AT(kvq_attn, out), AT(kvq_attn, k), AT(kvq_attn, v), AT(kvq_attn, k_scale),
    AT(kvq_attn, v_scale), AT(kvq_attn, tables), AT(kvq_attn, tok_seq), AT(kvq_attn, tok_pos),
    AT(kvq_attn, slopes), AT(kvq_attn, T), AT(kvq_attn, H), AT(kvq_attn, KVH), AT(kvq_attn, D), AT(kvq_attn, BS),
    AT(kvq_attn, NB), AT(kvq_attn, table_stride), AT(kvq_attn, q_stride), AT(kvq_attn, out_stride),
    AT(kvq_attn, block_stride), AT(kvq_attn, tok_stride), AT(kvq_attn, head_stride), AT(kvq_attn, window),
    AT(kvq_attn, scale), AT(kvq_attn, nthreads), AT(kvq_attn, kv_dtype),

    SIZE(kvq_part),
    AT(kvq_part, w), AT(kvq_part, rows), AT(kvq_part, ldw), AT(kvq_part, qt), AT(kvq_part, kept), AT(kvq_part, bias),

    SIZE(kvq_expert),
    AT(kvq_expert, gate_up), AT(kvq_expert, down), AT(kvq_expert, gate_up_ldw), AT(kvq_expert, down_ldw),
    AT(kvq_expert, gate_up_qt), AT(kvq_expert, down_qt), AT(kvq_expert, gate_up_parts),
    AT(kvq_expert, gate_up_nparts), AT(kvq_expert, gate_up_kept), AT(kvq_expert, down_kept),

    SIZE(kvq_decode_layer),
    AT(kvq_decode_layer, attn_norm), AT(kvq_decode_layer, ffn_norm), AT(kvq_decode_layer, qkv),
    AT(kvq_decode_layer, o), AT(kvq_decode_layer, gate_up), AT(kvq_decode_layer, down),
    AT(kvq_decode_layer, qkv_ldw), AT(kvq_decode_layer, o_ldw), AT(kvq_decode_layer, gate_up_ldw),
    AT(kvq_decode_layer, down_ldw), AT(kvq_decode_layer, qkv_qt), AT(kvq_decode_layer, o_qt),
    AT(kvq_decode_layer, gate_up_qt), AT(kvq_decode_layer, down_qt), AT(kvq_decode_layer, kpool),
    AT(kvq_decode_layer, vpool), AT(kvq_decode_layer, kscale), AT(kvq_decode_layer, vscale),
    AT(kvq_decode_layer, qkv_parts), AT(kvq_decode_layer, gate_up_parts), AT(kvq_decode_layer, qkv_nparts),
    AT(kvq_decode_layer, gate_up_nparts), AT(kvq_decode_layer, q_norm), AT(kvq_decode_layer, k_norm),
    AT(kvq_decode_layer, experts), AT(kvq_decode_layer, router), AT(kvq_decode_layer, router_ldw),
    AT(kvq_decode_layer, n_experts), AT(kvq_decode_layer, top_k), AT(kvq_decode_layer, expert_inter),
    AT(kvq_decode_layer, router_qt), AT(kvq_decode_layer, renorm),
    AT(kvq_decode_layer, qkv_kept), AT(kvq_decode_layer, o_kept), AT(kvq_decode_layer, gate_up_kept),
    AT(kvq_decode_layer, down_kept), AT(kvq_decode_layer, shared), AT(kvq_decode_layer, shared_gate),
    AT(kvq_decode_layer, shared_gate_ldw), AT(kvq_decode_layer, shared_inter), AT(kvq_decode_layer, shared_gate_qt),
    AT(kvq_decode_layer, qkv_bias), AT(kvq_decode_layer, o_bias), AT(kvq_decode_layer, gate_up_bias),
    AT(kvq_decode_layer, down_bias),

    SIZE(kvq_decode),
    AT(kvq_decode, x), AT(kvq_decode, layers), AT(kvq_decode, cos), AT(kvq_decode, sin), AT(kvq_decode, slots),
    AT(kvq_decode, tables), AT(kvq_decode, lens), AT(kvq_decode, B), AT(kvq_decode, hidden), AT(kvq_decode, H),
    AT(kvq_decode, KVH), AT(kvq_decode, D), AT(kvq_decode, inter), AT(kvq_decode, L), AT(kvq_decode, T),
    AT(kvq_decode, BS), AT(kvq_decode, NB), AT(kvq_decode, window), AT(kvq_decode, rope_rows),
    AT(kvq_decode, eps), AT(kvq_decode, scale), AT(kvq_decode, nthreads), AT(kvq_decode, kv_dtype),
    AT(kvq_decode, ids), AT(kvq_decode, embed), AT(kvq_decode, embed_ldw), AT(kvq_decode, vocab),
    AT(kvq_decode, embed_qt), AT(kvq_decode, final_eps), AT(kvq_decode, final_norm), AT(kvq_decode, out),
    AT(kvq_decode, head), AT(kvq_decode, head_ldw), AT(kvq_decode, head_rows), AT(kvq_decode, head_qt),
    AT(kvq_decode, logits), AT(kvq_decode, embed_kept), AT(kvq_decode, head_kept),

    SIZE(kvq_sampling),
    AT(kvq_sampling, temperature), AT(kvq_sampling, top_k), AT(kvq_sampling, top_p), AT(kvq_sampling, min_p),
    AT(kvq_sampling, u),

    /* Array lengths the mirrors repeat. */
    {"KVQ_MAX_PARTS", NULL, KVQ_MAX_PARTS},
};

/* sizeof(struct type) (field NULL or empty), offsetof(struct type, field), or a constant's value; -1 when this
 * table does not have it. */
int64_t kvq_abi_layout(const char *type, const char *field) {
    if (!type) return -1;
    int whole = !field || !*field;
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        const struct layout *e = &layouts[i];
        if (strcmp(e->type, type) != 0) continue;
        if (whole ? e->field == NULL : e->field && strcmp(e->field, field) == 0) return e->value;
    }
    return -1;
}
