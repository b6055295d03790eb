/* A whole decode step of a Llama-style decoder (RMSNorm, fused QKV with optional biases (Qwen2), optional q/k norms,
 * rotate-half RoPE, K/V store, paged attention, fused gate-up SwiGLU or a mixture of SwiGLU experts, residuals) over
 * every layer in one call, for float32 activations and GGML-quantised weights. It calls the very functions the
 * eager path calls one op at a time (kvq_matmul, kvq_attention, kvq_rms_norm_row, kvq_rope, kvq_silu_mul,
 * kvq_moe_route), in the same order, so a token decoded here or in a mixed eager step gets the same bits; what goes
 * away is the eager path's per-op dispatch cost.
 *
 * x [B, hidden] is the residual stream: the embedding rows of ids on entry (looked up here when embed is set);
 * on return it holds the last layer's output, and with final_norm set the step also applies the final norm (into
 * out) and, with head set, the LM head (into logits) -- the same kernels the eager path calls for them. Each
 * sequence contributes one token: its K and V are written to slots[b] of each layer's pools before attention
 * reads them.
 */
#include "kernels.h"

#include <stdlib.h>
#include <string.h>

/* y[B, N] = x @ W^T (+ bias) for a projection of N output columns: one matrix, or parts side by side (each part's
 * columns computed by the same kernel a matmul of that part alone runs, so the bits are the per-op path's). The
 * bias goes into kvq_matmul, as the eager path's QuantLinear passes it (one add after each column's sum); a
 * projection in parts takes each part's own bias slice, as each part's QuantLinear holds it, and bias is unused. */
static int project(const float *x, int64_t B, int64_t K, const uint8_t *w, int64_t N, int64_t ldw, int qt,
                   const uint8_t *kept, const float *bias, const struct kvq_part *parts, int nparts, float *y,
                   int nthreads) {
    if (nparts <= 0) return kvq_matmul(x, B, K, K, w, N, ldw, qt, kept, bias, y, N, nthreads);
    int64_t col = 0;
    for (int i = 0; i < nparts; i++) {
        if (col + parts[i].rows > N) return KVQ_EBADSHAPE;
        const int rc = kvq_matmul(x, B, K, K, parts[i].w, parts[i].rows, parts[i].ldw, parts[i].qt, parts[i].kept,
                                  parts[i].bias, y + col, N, nthreads);
        if (rc) return rc;
        col += parts[i].rows;
    }
    return col == N ? KVQ_OK : KVQ_EBADSHAPE;
}

/* y[b] += sigmoid(gate . h[b]) * shared(h[b]) for each of the B rows: the gated shared expert, added after the
 * routed experts' sum as MoE.forward adds it, by the same calls. The gate's one-column matmul (kvq_matmul, as
 * KernelLinear runs it); moe.py's _sigmoid: kvq_silu_mul_rows over rows [g, 1] (g * sigmoid(g)), divided by g, 0.5
 * where g is 0; the SwiGLU over all B rows at once (gate-up, kvq_silu_mul_rows, down), as the module runs it; then
 * per element a product and a sum, each rounded, as torch's two elementwise ops: the library is built with
 * -ffp-contract=off, so the compiler cannot fuse them into one FMA. */
static int shared_ffn(const float *h, int64_t B, int64_t hid, const struct kvq_decode_layer *p, float *y,
                      int nthreads) {
    const int64_t I = p->shared_inter;
    const struct kvq_expert *s = &p->shared;
    float *g = (float *)malloc(sizeof(float) * (size_t)(4 * B)); /* g [B], then [B, 2] rows [g, 1], then [B] */
    float *gu = (float *)malloc(sizeof(float) * (size_t)(B * 2 * I));
    float *act = (float *)malloc(sizeof(float) * (size_t)(B * I));
    float *out = (float *)malloc(sizeof(float) * (size_t)(B * hid));
    int rc = KVQ_OK;
    if (!g || !gu || !act || !out) {
        rc = KVQ_ENOMEM;
        goto done;
    }
    float *g1 = g + B, *sig = g + 3 * B;
    rc = kvq_matmul(h, B, hid, hid, p->shared_gate, 1, p->shared_gate_ldw, p->shared_gate_qt, NULL, NULL, g, 1,
                    nthreads);
    if (rc) goto done;
    for (int64_t b = 0; b < B; b++) g1[2 * b] = g[b], g1[2 * b + 1] = 1.0f; /* [B, 2]: torch.cat([g, 1]) */
    kvq_silu_mul_rows(g1, B, 1, 2, sig, nthreads);
    for (int64_t b = 0; b < B; b++) sig[b] = g[b] == 0.0f ? 0.5f : sig[b] / g[b];
    rc = project(h, B, hid, s->gate_up, 2 * I, s->gate_up_ldw, s->gate_up_qt, s->gate_up_kept, NULL,
                 s->gate_up_parts, s->gate_up_nparts, gu, nthreads);
    if (rc) goto done;
    kvq_silu_mul_rows(gu, B, I, 2 * I, act, nthreads);
    rc = kvq_matmul(act, B, I, I, s->down, hid, s->down_ldw, s->down_qt, s->down_kept, NULL, out, hid, nthreads);
    if (rc) goto done;
    for (int64_t b = 0; b < B; b++) {
        float *yr = y + b * hid;
        const float *o = out + b * hid, sb = sig[b];
        for (int64_t i = 0; i < hid; i++) yr[i] = yr[i] + sb * o[i];
    }
done:
    free(g), free(gu), free(act), free(out);
    return rc;
}

/* y[B, hid] = the mixture-of-experts FFN of the normed rows h [B, hid], as layers/moe.py's MoE.forward computes
 * it: router logits by kvq_matmul, each row's experts and weights by kvq_moe_route, the rows' (row, rank) entries
 * grouped by expert (stably: by row, then rank, within an expert), each expert's gate-up over its rows, one
 * kvq_silu_mul_rows pass over all of them, each expert's down, then per row weight * output of each rank, summed
 * in rank order. The matmuls are row-invariant, so a row's bits do not depend on which rows share an expert. */
static int moe_ffn(const float *h, int64_t B, int64_t hid, const struct kvq_decode_layer *p, float *y,
                   int nthreads) {
    const int64_t E = p->n_experts, k = p->top_k, I = p->expert_inter, n = B * k;
    if (E <= 0 || k <= 0 || k > E || I <= 0) return KVQ_EBADSHAPE;
    float *logits = (float *)malloc(sizeof(float) * (size_t)(B * E)), *w = (float *)malloc(sizeof(float) * (size_t)n);
    int64_t *ex = (int64_t *)malloc(sizeof(int64_t) * (size_t)n), *at = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    int64_t *start = (int64_t *)calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *live = (int64_t *)malloc(sizeof(int64_t) * (size_t)E);
    int64_t nlive = 0;
    float *xs = (float *)malloc(sizeof(float) * (size_t)(n * hid));
    float *gu = (float *)malloc(sizeof(float) * (size_t)(n * 2 * I));
    float *act = (float *)malloc(sizeof(float) * (size_t)(n * I));
    float *out = (float *)malloc(sizeof(float) * (size_t)(n * hid));
    int rc = KVQ_OK;
    if (!logits || !w || !ex || !at || !start || !live || !xs || !gu || !act || !out) {
        rc = KVQ_ENOMEM;
        goto done;
    }
    rc = kvq_matmul(h, B, hid, hid, p->router, E, p->router_ldw, p->router_qt, NULL, NULL, logits, E, nthreads);
    if (rc) goto done;
    rc = kvq_moe_route(logits, B, E, k, p->renorm, w, ex);
    if (rc) goto done;
    /* entry i (row i / k, rank i % k) goes to slot at[i]: the experts' runs in expert order, entries in order */
    for (int64_t i = 0; i < n; i++) start[ex[i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < n; i++) {
        at[i] = start[ex[i]]++;
        memcpy(xs + at[i] * hid, h + (i / k) * hid, sizeof(float) * (size_t)hid);
    }
    /* start[e] is now where expert e's run ends. With enough experts in use, each thread takes whole experts (one
     * thread per matmul) instead of every matmul splitting its columns over the threads: the same bits (a column's
     * arithmetic does not depend on the thread count), two thread wake-ups per layer instead of two per expert. */
    for (int64_t e = 0; e < E; e++)
        if (start[e] > (e ? start[e - 1] : 0)) live[nlive++] = e;
    const int by_expert = nthreads > 1 && nlive >= 2 * (int64_t)nthreads;
    const int inner = by_expert ? 1 : nthreads;
#pragma omp parallel for num_threads(by_expert ? nthreads : 1) schedule(dynamic, 1) if (by_expert)
    for (int64_t j = 0; j < nlive; j++) {
        const int64_t e = live[j], a = e ? start[e - 1] : 0, c = start[e] - a;
        const struct kvq_expert *x = p->experts + e;
        const int r = project(xs + a * hid, c, hid, x->gate_up, 2 * I, x->gate_up_ldw, x->gate_up_qt, x->gate_up_kept,
                              NULL, x->gate_up_parts, x->gate_up_nparts, gu + a * 2 * I, inner);
        if (r) {
#pragma omp atomic write
            rc = r;
        }
    }
    if (rc) goto done;
    kvq_silu_mul_rows(gu, n, I, 2 * I, act, nthreads);
#pragma omp parallel for num_threads(by_expert ? nthreads : 1) schedule(dynamic, 1) if (by_expert)
    for (int64_t j = 0; j < nlive; j++) {
        const int64_t e = live[j], a = e ? start[e - 1] : 0, c = start[e] - a;
        const struct kvq_expert *x = p->experts + e;
        const int r = kvq_matmul(act + a * I, c, I, I, x->down, hid, x->down_ldw, x->down_qt, x->down_kept, NULL,
                                 out + a * hid, hid, inner);
        if (r) {
#pragma omp atomic write
            rc = r;
        }
    }
    if (rc) goto done;
    for (int64_t b = 0; b < B; b++) {
        float *yr = y + b * hid;
        const float *o0 = out + at[b * k] * hid, w0 = w[b * k];
        if (k == 1) {
            for (int64_t i = 0; i < hid; i++) yr[i] = o0[i] * w0;
            continue;
        }
        const float *o1 = out + at[b * k + 1] * hid, w1 = w[b * k + 1];
        for (int64_t i = 0; i < hid; i++) yr[i] = o0[i] * w0 + o1[i] * w1;
        for (int64_t r = 2; r < k; r++) {
            const float *o = out + at[b * k + r] * hid, wr = w[b * k + r];
            for (int64_t i = 0; i < hid; i++) yr[i] = yr[i] + o[i] * wr;
        }
    }
    if (p->shared_inter > 0) rc = shared_ffn(h, B, hid, p, y, nthreads);
done:
    free(logits), free(w), free(ex), free(at), free(start), free(live), free(xs), free(gu), free(act), free(out);
    return rc;
}

int kvq_decode_step(const struct kvq_decode *d) {
    const int64_t B = d->B, hid = d->hidden, H = d->H, KVH = d->KVH, D = d->D, inter = d->inter;
    if (B <= 0 || hid <= 0 || H <= 0 || KVH <= 0 || H % KVH || D <= 0 || D % 2 || inter <= 0 || d->L <= 0)
        return KVQ_EBADSHAPE;
    const int64_t qs = H * D, kvs = KVH * D, nqkv = qs + 2 * kvs;
    for (int64_t b = 0; b < B; b++) {
        if (d->slots[b] < 0 || d->slots[b] >= d->NB * d->BS || d->lens[b] <= 0) return KVQ_EBADBLOCK;
        if (d->lens[b] > d->rope_rows) return KVQ_EBADSHAPE;
    }
    if (d->embed) {
        const int rc = kvq_embed_rows(d->embed, d->embed_ldw, d->embed_qt, d->embed_kept, d->ids, B, d->vocab, hid,
                                     d->x);
        if (rc) return rc;
    }
    float *h = (float *)malloc(sizeof(float) * (size_t)(B * hid));
    float *qkv = (float *)malloc(sizeof(float) * (size_t)(B * nqkv));
    float *att = (float *)malloc(sizeof(float) * (size_t)(B * qs));
    float *gu = (float *)malloc(sizeof(float) * (size_t)(B * 2 * inter));
    float *act = (float *)malloc(sizeof(float) * (size_t)(B * inter));
    float *y = (float *)malloc(sizeof(float) * (size_t)(B * hid));
    int64_t *seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)B), *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)B);
    int rc = KVQ_OK;
    if (!h || !qkv || !att || !gu || !act || !y || !seq || !pos) {
        rc = KVQ_ENOMEM;
        goto done;
    }
    for (int64_t b = 0; b < B; b++) seq[b] = b, pos[b] = d->lens[b] - 1;
    for (int64_t l = 0; l < d->L && rc == KVQ_OK; l++) {
        const struct kvq_decode_layer *p = d->layers + l;
        kvq_rms_norm(d->x, B, hid, p->attn_norm, h, hid, hid, d->eps, 1);
        rc = project(h, B, hid, p->qkv, nqkv, p->qkv_ldw, p->qkv_qt, p->qkv_kept, p->qkv_bias, p->qkv_parts,
                     p->qkv_nparts, qkv, d->nthreads);
        if (rc) break;
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * nqkv;
            /* in place: the row function reads a head whole before it writes it */
            if (p->q_norm) kvq_rms_norm(row, H, D, p->q_norm, row, D, D, d->eps, 1);
            if (p->k_norm) kvq_rms_norm(row + qs, KVH, D, p->k_norm, row + qs, D, D, d->eps, 1);
            const float *c = d->cos + pos[b] * (D / 2), *s = d->sin + pos[b] * (D / 2);
            kvq_rope(row, H, D, c, s);
            kvq_rope(row + qs, KVH, D, c, s);
            if (d->kv_dtype == KV_F32) {
                memcpy((float *)p->kpool + d->slots[b] * kvs, row + qs, sizeof(float) * (size_t)kvs);
                memcpy((float *)p->vpool + d->slots[b] * kvs, row + qs + kvs, sizeof(float) * (size_t)kvs);
            } else { /* the same quantisation as the eager path's store */
                const int64_t off = d->slots[b] * kvs;
                kvq_kv_store(row + qs, 1, nqkv, KVH, D, &off, D, p->kpool, p->kscale, d->kv_dtype);
                kvq_kv_store(row + qs + kvs, 1, nqkv, KVH, D, &off, D, p->vpool, p->vscale, d->kv_dtype);
            }
        }
        const struct kvq_attn j = {qkv, att, p->kpool, p->vpool, p->kscale, p->vscale, d->tables, seq, pos, NULL,
                                   B, H, KVH, D, d->BS, d->NB, d->T, nqkv, qs, d->BS * kvs, kvs, D, d->window,
                                   d->scale, d->nthreads, d->kv_dtype};
        rc = kvq_attention(&j);
        if (rc) break;
        rc = kvq_matmul(att, B, qs, qs, p->o, hid, p->o_ldw, p->o_qt, p->o_kept, p->o_bias, y, hid, d->nthreads);
        if (rc) break;
        for (int64_t i = 0; i < B * hid; i++) d->x[i] = d->x[i] + y[i];

        kvq_rms_norm(d->x, B, hid, p->ffn_norm, h, hid, hid, d->eps, 1);
        if (p->experts) {
            rc = moe_ffn(h, B, hid, p, y, d->nthreads);
            if (rc) break;
            for (int64_t i = 0; i < B * hid; i++) d->x[i] = d->x[i] + y[i];
            continue;
        }
        rc = project(h, B, hid, p->gate_up, 2 * inter, p->gate_up_ldw, p->gate_up_qt, p->gate_up_kept,
                     p->gate_up_bias, p->gate_up_parts, p->gate_up_nparts, gu, d->nthreads);
        if (rc) break;
        kvq_silu_mul_rows(gu, B, inter, 2 * inter, act, d->nthreads);
        rc = kvq_matmul(act, B, inter, inter, p->down, hid, p->down_ldw, p->down_qt, p->down_kept, p->down_bias, y,
                        hid, d->nthreads);
        if (rc) break;
        for (int64_t i = 0; i < B * hid; i++) d->x[i] = d->x[i] + y[i];
    }
    if (rc == KVQ_OK && d->final_norm) {
        kvq_rms_norm(d->x, B, hid, d->final_norm, d->out, hid, hid, d->final_eps, 1);
        if (d->head)
            rc = kvq_matmul(d->out, B, hid, hid, d->head, d->head_rows, d->head_ldw, d->head_qt, d->head_kept, NULL,
                            d->logits, d->head_rows, d->nthreads);
    }
done:
    free(h), free(qkv), free(att), free(gu), free(act), free(y), free(seq), free(pos);
    return rc;
}

void kvq_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = kvq_argmax_row(x + r * n, n);
}

/* Up to nsteps decode steps of d->B sequences in one call (the engine's multi-step decode: one call, then Python
 * looks at the tokens, instead of a return to Python per token). Step s is kvq_decode_step at position
 * lens[b] - 1 + s of each sequence, its K/V slot found through the sequence's block table (which must already
 * hold those positions), its logits kept in logits_all[s] ([B, head_rows]), and each row's next input its argmax
 * (sp NULL, or a temperature of 0) or a token drawn by kvq_sample_row with that sequence's parameters and the
 * step's uniform number sp->u[s * B + b] -- what the sampler draws from the same row and number.
 * d->ids and d->lens give step 0 and are not written (d->slots is not read: every step's slots come from the
 * tables); d->embed, d->final_norm and d->head must be set.
 * Stops after nsteps, or after a step in which a sequence's token is one of stop_ids. tokens[s * B + b]: the
 * token of step s. Returns the steps done (>= 1), or a negative KVQ_E* code. The same arithmetic per step as one
 * kvq_decode_step call each: a token does not depend on how many steps one call makes. */
int kvq_decode_steps(const struct kvq_decode *d, int64_t nsteps, const int64_t *stop_ids, int64_t nstop,
                     const struct kvq_sampling *sp, float *logits_all, int64_t *tokens) {
    const int64_t B = d->B, V = d->head_rows;
    if (nsteps < 1 || B <= 0 || !d->embed || !d->final_norm || !d->head || V <= 0 || d->T <= 0 || d->BS <= 0)
        return KVQ_EBADSHAPE;
    for (int64_t b = 0; b < B; b++) {
        const int64_t last = d->lens[b] - 1 + nsteps - 1; /* the last position written */
        if (d->lens[b] <= 0 || last / d->BS >= d->T) return KVQ_EBADSHAPE;
        for (int64_t i = (d->lens[b] - 1) / d->BS; i <= last / d->BS; i++)
            if (d->tables[b * d->T + i] < 0 || d->tables[b * d->T + i] >= d->NB) return KVQ_EBADBLOCK;
    }
    int sampled = 0;
    for (int64_t b = 0; sp && b < B; b++) sampled |= sp->temperature[b] > 0.0f;
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * B));
    float *work = sampled ? (float *)malloc((size_t)kvq_sample_work_bytes(V)) : NULL;
    if (!ids || (sampled && !work)) {
        free(ids), free(work);
        return KVQ_ENOMEM;
    }
    int64_t *slots = ids + B, *lens = ids + 2 * B;
    memcpy(ids, d->ids, sizeof(int64_t) * (size_t)B);
    memcpy(lens, d->lens, sizeof(int64_t) * (size_t)B);
    struct kvq_decode j = *d;
    j.ids = ids, j.slots = slots, j.lens = lens;
    int64_t s = 0;
    int rc = KVQ_OK;
    for (; s < nsteps; s++) {
        for (int64_t b = 0; b < B; b++) {
            const int64_t p = lens[b] - 1;
            slots[b] = d->tables[b * d->T + p / d->BS] * d->BS + p % d->BS;
        }
        j.logits = logits_all + s * B * V;
        rc = kvq_decode_step(&j);
        if (rc) break;
        int stop = 0;
        for (int64_t b = 0; b < B; b++) {
            const float *row = j.logits + b * V;
            const int64_t t = sp && sp->temperature[b] > 0.0f
                ? kvq_sample_row(row, V, sp->temperature[b], sp->top_k[b], sp->top_p[b], sp->min_p[b],
                                 sp->u[s * B + b], work)
                : kvq_argmax_row(row, V);
            if (t < 0) {
                rc = (int)t;
                break;
            }
            tokens[s * B + b] = ids[b] = t;
            lens[b]++;
            for (int64_t k = 0; k < nstop; k++) stop |= stop_ids[k] == t;
        }
        if (rc) break;
        if (stop) {
            s++;
            break;
        }
    }
    free(ids), free(work);
    if (rc) return rc;
    return (int)s;
}
