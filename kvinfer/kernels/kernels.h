/* The library's ABI: declarations shared by the kernel sources (every .c here and in amx/). Each level's library
 * is built from all of them with the same KVQ_LEVEL; the structs are mirrored by ctypes in abi.py. */
#ifndef KVINFER_KERNELS_H
#define KVINFER_KERNELS_H
#include <stdint.h>

enum {
    KVQ_OK = 0, KVQ_EBADTYPE = -1, KVQ_EBADSHAPE = -2, KVQ_ENOMEM = -4, KVQ_EROWBYTES = -5, KVQ_EBADBLOCK = -6
};
enum {
    QT_F32 = 0, QT_F16 = 1, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_IQ4_NL = 20,
    QT_BF16 = 30
};
/* KV cache element types: float32; 8-bit values (int8, or fp8 e4m3) with a float32 scale per group of 32;
 * bfloat16 (the float32 value rounded to nearest even, no scale). */
enum { KV_F32 = 0, KV_INT8 = 1, KV_FP8 = 2, KV_BF16 = 3 };
#define KV_IS_8BIT(dt) ((dt) == KV_INT8 || (dt) == KV_FP8)

/* y[r * ldy + n] = sum_k x[r * ldx + k] * W[n, k] (+ bias[n]); W rows of ldw bytes of type qt. kept: W's kept copy
 * (kvq_amx_tiles_pack's output for exactly this W, made by this level's library), or NULL. A copy travels with its
 * weight in every call that reads the weight, as the bias does: the routes that have a kept layout read it instead
 * of W's rows (which may have been dropped), the others ignore it; the bits are the same either way. */
int kvq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw, int qt,
               const uint8_t *kept, const float *bias, float *y, int64_t ldy, int nthreads);

/* K-quant super-blocks (kquants.c; kvq_matmul and kvq_embed_rows hand them over), and the activations' int16
 * rounding per block of 32 they share with qmatmul.c. */
int kvq_kq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw,
                  int qt, const uint8_t *kept, const float *bias, float *y, int64_t ldy, int nthreads);
int kvq_kq_embed_rows(const uint8_t *w, int64_t ldw, int qt, const int64_t *ids, int64_t n, int64_t K, float *out);
void kvq_quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int16_t *xq, float *dx, float *sx);
/* The bits activations are rounded to where they meet quantised weights: 16 (default) or 8; any other value
 * changes nothing. Returns the bits in use (process-wide, for every route of this library). */
int kvq_activation_bits(int bits);
/* 1 where the kept copies are prefetched into L2 rather than L1 (AMD family 19h: Zen 3, Zen 4), else 0. */
int kvq_prefetch_l2(void);
/* The kept copies of K-quant weights, laid out once for byte dot products (kquants_kept.c; kvq_amx_tiles_bytes /
 * pack hand them over, 0 bytes / KVQ_EBADTYPE at the generic level), and the activations' two bytes per int16
 * (hi + 128, lo; 64 bytes per block of 32). */
int64_t kvq_kq_kept_bytes(int64_t N, int64_t K, int qt);
int kvq_kq_kept_pack(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, uint8_t *dst, int nthreads);
/* Rows ids[0..n) of a kept weight as the GGUF bytes it was packed from (out: n rows ldo bytes apart), so that
 * the source rows may be dropped: Q4_0, Q4_1, Q8_0, Q3_K..Q6_K and IQ4_XS; KVQ_EBADTYPE for other types and levels. */
int kvq_kept_rows(const uint8_t *kept, int64_t N, int64_t K, int qt, const int64_t *ids, int64_t n, uint8_t *out,
                  int64_t ldo);
int kvq_kq_kept_rows(const uint8_t *kept, int64_t N, int64_t K, int qt, const int64_t *ids, int64_t n, uint8_t *out,
                     int64_t ldo);
void kvq_split_bytes(const int16_t *xq, int64_t M, int64_t K, int hi_offset, uint8_t *xu);

/* AMX tiles (amx/qmatmul_int8.c): on = 1 use them where the OS grants them, 0 not, -1 query. At the avx512 level
 * a quantised weight may be kept in tile layout (kept.c: bytes, pack) and passed as kvq_matmul's kept; both the AMX
 * and the vector route then read that copy (the other levels return 0 bytes / KVQ_EBADTYPE but for K-quants). */
int kvq_amx_enable(int on);
int kvq_amx_min_rows(void); /* rows from which a quantised matmul runs on the tiles (0: no tiles) */
int64_t kvq_amx_tiles_bytes(int64_t N, int64_t K, int qt);
int kvq_amx_tiles_pack(const uint8_t *w, int64_t N, int64_t K, int64_t ldw, int qt, uint8_t *dst, int nthreads);
/* Prompt rows on AMX bfloat16 tiles over a kept weight (exact per CPU; see amx/qmatmul_bf16.c): enable (on as above;
 * needs the int8 tiles on, AMX-BF16 and AVX512_BF16), then kvq_matmul's arguments; KVQ_EBADTYPE when the route
 * is off or the weight has no kept copy. */
int kvq_amx_bf16_enable(int on);
int kvq_matmul_prompt(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw,
                      int qt, const uint8_t *kept, const float *bias, float *y, int64_t ldy, int nthreads);

/* Attention of T query tokens over a KV cache addressed through block tables; see attn.c. */
struct kvq_attn {
    const float *q;          /* [T, q_stride]: each row starts with H * D query values */
    float *out;              /* [T, out_stride]: H * D values per row */
    const void *k, *v;       /* cache bases: key/value of (block b, offset o, kv head g) at element
                                b * block_stride + o * tok_stride + g * head_stride */
    const float *k_scale, *v_scale; /* 8-bit caches: the scale of each group of 32 values (or of D when D is not
                                       a multiple of 32) at the group's offset / group size */
    const int64_t *tables;   /* [sequences, table_stride] block ids */
    const int64_t *tok_seq;  /* [T] the sequence (row of tables) of each query token */
    const int64_t *tok_pos;  /* [T] its position: it attends to positions [first, pos] */
    const float *slopes;     /* [H] ALiBi slopes, or NULL */
    int64_t T, H, KVH, D, BS, NB, table_stride, q_stride, out_stride;
    int64_t block_stride, tok_stride, head_stride, window;
    float scale;
    int32_t nthreads, kv_dtype;
};
int kvq_attention(const struct kvq_attn *j);
/* The prompt rows' route (AMX-BF16 tiles where kvq_matmul_prompt's route is on): the same job, every row a prompt
 * token's; KVQ_EBADTYPE when the route is off or the job is not of its kind (the caller then uses kvq_attention). */
int kvq_attention_prompt(const struct kvq_attn *j);

/* Quantise T rows of KVH heads x D floats (row stride src_stride) into an 8-bit or bfloat16 cache: row t, head g
 * goes to element dst_off[t] + g * head_stride of dst; an 8-bit cache's group scales go to the group's element
 * offset / group size (dst_scale is not used for bfloat16). */
void kvq_kv_store(const float *src, int64_t T, int64_t src_stride, int64_t KVH, int64_t D, const int64_t *dst_off,
                  int64_t head_stride, void *dst, float *dst_scale, int kv_dtype);
float kvq_fp8_value(uint8_t b);

/* Row operations (rowops.c). */
void kvq_rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps);
void kvq_rms_norm(const float *x, int64_t rows, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t n,
                  float eps, int nthreads);
void kvq_layer_norm(const float *x, int64_t rows, int64_t ldx, const float *w, const float *b, float *y,
                    int64_t ldy, int64_t n, float eps, int nthreads);
void kvq_silu_mul(const float *g, const float *u, float *y, int64_t n);
void kvq_silu_mul_rows(const float *gu, int64_t rows, int64_t inter, int64_t ld_in, float *out, int nthreads);
void kvq_gelu(const float *x, float *y, int64_t n, int tanh_approx, int nthreads);
void kvq_rope(float *v, int64_t nh, int64_t D, const float *cs, const float *sn);
void kvq_rope_rows(float *x, int64_t tokens, int64_t ld, int64_t nh, int64_t D, const float *cosb, const float *sinb,
                   int nthreads);
float kvq_exp_shift_sum(float *s, int64_t n, float mx);
/* A mixture-of-experts router's choice for each of rows rows of logits [rows, E]: the softmax over the E experts
 * (kvq_exp_shift_sum, then a division by the sum), its k largest probabilities, highest first (of equal ones the
 * lower expert first), divided by their sum (added in rank order) when renorm is set. weights [rows, k],
 * experts [rows, k]. The eager path (layers/moe.py: route) and the fused step both call it. */
int kvq_moe_route(const float *logits, int64_t rows, int64_t E, int64_t k, int renorm, float *weights,
                  int64_t *experts);

/* A whole decode step of a Llama-style quantised model (decode_step.c). */
/* One part of a fused projection whose parts differ in type (Q4_K_M's q/k/v in Q4_K and Q6_K): rows output
 * columns, side by side with the other parts'; kept: w's kept copy or NULL (kvq_matmul's kept). */
struct kvq_part {
    const uint8_t *w;
    int64_t rows, ldw;
    int32_t qt;
    const uint8_t *kept;
    const float *bias; /* float32 [rows], the part's own slice of the projection's bias (kvq_matmul's), or NULL */
};
#define KVQ_MAX_PARTS 3
/* One expert of a mixture-of-experts layer: its fused gate-up (2 * expert_inter rows, or parts) and its down. */
struct kvq_expert {
    const uint8_t *gate_up, *down;
    int64_t gate_up_ldw, down_ldw;
    int32_t gate_up_qt, down_qt;
    struct kvq_part gate_up_parts[KVQ_MAX_PARTS];
    int32_t gate_up_nparts;
    const uint8_t *gate_up_kept, *down_kept; /* the matrices' kept copies, or NULL */
};
struct kvq_decode_layer {
    const float *attn_norm, *ffn_norm;
    const uint8_t *qkv, *o, *gate_up, *down;
    int64_t qkv_ldw, o_ldw, gate_up_ldw, down_ldw;
    int32_t qkv_qt, o_qt, gate_up_qt, down_qt;
    void *kpool, *vpool;
    float *kscale, *vscale;  /* 8-bit caches only */
    /* nparts > 0: qkv (gate_up) is these parts instead of the one matrix above; 0: that matrix. */
    struct kvq_part qkv_parts[KVQ_MAX_PARTS], gate_up_parts[KVQ_MAX_PARTS];
    int32_t qkv_nparts, gate_up_nparts;
    /* Optional per-head RMSNorms of q and k ([D] each, the step's eps), applied before RoPE (Qwen3, OLMo 2);
     * NULL: none. */
    const float *q_norm, *k_norm;
    /* experts set: a mixture-of-experts layer in place of gate_up / down (see decode_step.c: moe_ffn). The router
     * [n_experts, hidden] is rows of router_ldw bytes of type router_qt; each row takes its top_k experts
     * (kvq_moe_route, renorm as there), each expert_inter wide. */
    const struct kvq_expert *experts;
    const uint8_t *router;
    int64_t router_ldw, n_experts, top_k, expert_inter;
    int32_t router_qt, renorm;
    const uint8_t *qkv_kept, *o_kept, *gate_up_kept, *down_kept; /* the matrices' kept copies, or NULL */
    /* shared_inter > 0 (with experts set): a gated shared expert beside the routed ones (Qwen2-MoE), run on every
     * row: shared (shared_inter wide) and its gate [1, hidden], a row of shared_gate_ldw bytes of type
     * shared_gate_qt (see decode_step.c: shared_ffn). */
    struct kvq_expert shared;
    const uint8_t *shared_gate;
    int64_t shared_gate_ldw, shared_inter;
    int32_t shared_gate_qt;
    /* Float32 biases of the dense projections ([N] each, passed to kvq_matmul as the eager path passes them: one add
     * after a column's sum), or NULL: Qwen2's q/k/v. A projection in parts takes its parts' biases instead. */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
};
struct kvq_decode {
    float *x;                                  /* [B, hidden] residual stream, updated in place */
    const struct kvq_decode_layer *layers;     /* [L] */
    const float *cos, *sin;                    /* RoPE tables [rope_rows, D / 2]: row lens[b] - 1 */
    const int64_t *slots, *tables, *lens;      /* [B], [B, T], [B] */
    int64_t B, hidden, H, KVH, D, inter, L, T, BS, NB, window, rope_rows;
    float eps, scale;
    int32_t nthreads, kv_dtype;
    /* Optional. embed: x = rows ids[b] of this [vocab, hidden] matrix first (else x holds them on entry).
     * final_norm: afterwards out = RMSNorm(x) (eps final_eps), and with head, logits = out @ head^T instead. */
    const int64_t *ids;
    const uint8_t *embed;
    int64_t embed_ldw, vocab;
    int32_t embed_qt;
    float final_eps;
    const float *final_norm;
    float *out;
    const uint8_t *head;
    int64_t head_ldw, head_rows;
    int32_t head_qt;
    float *logits;                             /* [B, head_rows] */
    const uint8_t *embed_kept, *head_kept;     /* their kept copies, or NULL */
};
int kvq_decode_step(const struct kvq_decode *d);
int64_t kvq_argmax_row(const float *row, int64_t n);
void kvq_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out);
/* Per sequence of a multi-step call: how its next token is chosen after each step. */
struct kvq_sampling {
    const float *temperature; /* [B]; 0: the argmax */
    const int64_t *top_k;     /* [B]; <= 0: off */
    const float *top_p;       /* [B]; >= 1: off */
    const float *min_p;       /* [B]; <= 0: off */
    const double *u;          /* [nsteps, B]: each step's uniform number in [0, 1) */
};
int64_t kvq_sample_row(const float *logits, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                       double u, float *work);
int64_t kvq_sample_work_bytes(int64_t n);
int kvq_sample_rows(const float *logits, int64_t rows, int64_t n, const float *temperature, const int64_t *top_k,
                    const float *top_p, const float *min_p, const double *u, const uint32_t *allow, int64_t words,
                    int64_t *out, int nthreads);
int kvq_sample_probs(const float *logits, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                     float *probs, float *work);
int kvq_decode_steps(const struct kvq_decode *d, int64_t nsteps, const int64_t *stop_ids, int64_t nstop,
                     const struct kvq_sampling *sp, float *logits_all, int64_t *tokens);
int kvq_embed_rows(const uint8_t *w, int64_t ldw, int qt, const uint8_t *kept, const int64_t *ids, int64_t n,
                   int64_t N, int64_t K, float *out);

int kvq_level(void);
/* Type qt's elements and bytes per block (either pointer may be NULL): returns 1 when this level keeps a copy of
 * a weight of that type (kvq_amx_tiles_pack), 0 when not, KVQ_EBADTYPE for a type the kernels do not take. */
int kvq_type_traits(int qt, int64_t *block_elems, int64_t *block_bytes);
int kvq_max_threads(void);
#endif
