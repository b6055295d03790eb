/* A whole decode step of a Llama-style decoder (RMSNorm, fused QKV, rotate-half RoPE, paged GQA attention,
 * fused gate-up SwiGLU, residuals) over every layer in one call, for float32 activations and GGML-quantised
 * weights: the per-layer Python and per-op dispatch cost of the eager path goes away, the arithmetic is the
 * same kernels' (kvq_matmul, kvq_paged_decode_run).
 *
 * x [B, hidden] is the residual stream after the embedding; on return it holds the last layer's output (the
 * caller applies the final norm and the head). Each sequence contributes one token: its K and V are written to
 * slot_mapping[b] of the layer's pools before attention reads them.
 */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DS_OK = 0, DS_EBADSHAPE = -2, DS_ENOMEM = -4 };

/* Per-layer pointers and matmul parameters, as the int64 rows of the layer table. */
enum {
    L_ATTN_NORM, L_QKV, L_QKV_LDW, L_QKV_QT, L_O, L_O_LDW, L_O_QT, L_FFN_NORM,
    L_GU, L_GU_LDW, L_GU_QT, L_DOWN, L_DOWN_LDW, L_DOWN_QT, L_KPOOL, L_VPOOL, L_FIELDS
};

static void rms_norm(const float *x, const float *w, float *y, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* Rotate-half RoPE of nh heads of width D in place, with this token's cos/sin [D / 2]. */
static void rope(float *v, int64_t nh, int64_t D, const float *cs, const float *sn) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < nh; h++) {
        float *a = v + h * D, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            float x1 = a[i], x2 = b[i];
            a[i] = x1 * cs[i] - x2 * sn[i];
            b[i] = x2 * cs[i] + x1 * sn[i];
        }
    }
}

static float f32_from_bits(int64_t bits) {
    int32_t b = (int32_t)bits;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/*
 * a: x, B, hidden, H, KVH, D, inter, L, layers (int64 [L, L_FIELDS]), cos [B, D/2], sin [B, D/2],
 *    slot_mapping [B], tables [B, T], lens [B], T, BS, NB, eps bits, scale bits, nthreads, window, slopes
 */
int kvq_decode_step_packed(const int64_t *a) {
    float *x = (float *)(intptr_t)a[0];
    const int64_t B = a[1], hid = a[2], H = a[3], KVH = a[4], D = a[5], inter = a[6], L = a[7];
    const int64_t *layers = (const int64_t *)(intptr_t)a[8];
    const float *cosb = (const float *)(intptr_t)a[9], *sinb = (const float *)(intptr_t)a[10];
    const int64_t *slots = (const int64_t *)(intptr_t)a[11];
    const int64_t *tables = (const int64_t *)(intptr_t)a[12], *lens = (const int64_t *)(intptr_t)a[13];
    const int64_t T = a[14], BS = a[15], NB = a[16];
    const float eps = f32_from_bits(a[17]), scale = f32_from_bits(a[18]);
    const int nt = (int)a[19];
    const int64_t window = a[20];
    const float *slopes = (const float *)(intptr_t)a[21];

    if (B <= 0 || hid <= 0 || H <= 0 || KVH <= 0 || H % KVH || D <= 0 || D % 2 || inter <= 0 || L <= 0)
        return DS_EBADSHAPE;
    const int64_t qs = H * D, kvs = KVH * D, nqkv = qs + 2 * kvs;
    for (int64_t b = 0; b < B; b++)
        if (slots[b] < 0 || slots[b] >= NB * BS) return KVQ_EBADBLOCK;
    float *h = (float *)malloc(sizeof(float) * (size_t)(B * hid));
    float *qkv = (float *)malloc(sizeof(float) * (size_t)(B * nqkv));
    float *att = (float *)malloc(sizeof(float) * (size_t)(B * qs));
    float *gu = (float *)malloc(sizeof(float) * (size_t)(B * 2 * inter));
    float *act = (float *)malloc(sizeof(float) * (size_t)(B * inter));
    float *y = (float *)malloc(sizeof(float) * (size_t)(B * hid));
    int rc = DS_OK;
    if (!h || !qkv || !att || !gu || !act || !y) {
        rc = DS_ENOMEM;
        goto done;
    }
    for (int64_t l = 0; l < L && rc == DS_OK; l++) {
        const int64_t *p = layers + l * L_FIELDS;
        float *kpool = (float *)(intptr_t)p[L_KPOOL], *vpool = (float *)(intptr_t)p[L_VPOOL];

        for (int64_t b = 0; b < B; b++) rms_norm(x + b * hid, (const float *)(intptr_t)p[L_ATTN_NORM], h + b * hid, hid, eps);
        rc = kvq_matmul(h, B, hid, hid, (const uint8_t *)(intptr_t)p[L_QKV], nqkv, p[L_QKV_LDW], (int)p[L_QKV_QT],
                        qkv, nqkv, nt, 0);
        if (rc) break;
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * nqkv;
            rope(row, H, D, cosb + b * (D / 2), sinb + b * (D / 2));
            rope(row + qs, KVH, D, cosb + b * (D / 2), sinb + b * (D / 2));
            memcpy(kpool + slots[b] * kvs, row + qs, sizeof(float) * (size_t)kvs);
            memcpy(vpool + slots[b] * kvs, row + qs + kvs, sizeof(float) * (size_t)kvs);
        }
        struct pa_job j = {qkv, kpool, vpool, slopes, tables, lens, att, B, H, KVH, D, BS, T, NB, window, nqkv, qs,
                           scale};
        rc = kvq_paged_decode_run(&j, nt);
        if (rc) break;
        rc = kvq_matmul(att, B, qs, qs, (const uint8_t *)(intptr_t)p[L_O], hid, p[L_O_LDW], (int)p[L_O_QT], y, hid,
                        nt, 0);
        if (rc) break;
        for (int64_t i = 0; i < B * hid; i++) x[i] += y[i];

        for (int64_t b = 0; b < B; b++) rms_norm(x + b * hid, (const float *)(intptr_t)p[L_FFN_NORM], h + b * hid, hid, eps);
        rc = kvq_matmul(h, B, hid, hid, (const uint8_t *)(intptr_t)p[L_GU], 2 * inter, p[L_GU_LDW], (int)p[L_GU_QT],
                        gu, 2 * inter, nt, 0);
        if (rc) break;
        for (int64_t b = 0; b < B; b++) kvq_silu_mul(gu + b * 2 * inter, gu + b * 2 * inter + inter, act + b * inter, inter);
        rc = kvq_matmul(act, B, inter, inter, (const uint8_t *)(intptr_t)p[L_DOWN], hid, p[L_DOWN_LDW],
                        (int)p[L_DOWN_QT], y, hid, nt, 0);
        if (rc) break;
        for (int64_t i = 0; i < B * hid; i++) x[i] += y[i];
    }
done:
    free(h), free(qkv), free(att), free(gu), free(act), free(y);
    return rc;
}

/* ---- Row kernels for the eager path's prefill steps (one pass over memory instead of torch's several) ---- */

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i] for r < rows: SwiGLU on the fused gate-up output (row stride
 * ld_in floats; out is contiguous [rows, inter]). */
void kvq_silu_mul_rows(const float *gu, int64_t rows, int64_t inter, int64_t ld_in, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (rows * inter >= 32768) schedule(static)
    for (int64_t r = 0; r < rows; r++) kvq_silu_mul(gu + r * ld_in, gu + r * ld_in + inter, out + r * inter, inter);
}

/* Rotate-half RoPE in place on `tokens` rows of nh heads of width D each (row stride ld floats, heads
 * contiguous within a row), with per-token cos/sin rows [tokens, D / 2]. */
void kvq_rope_rows(float *x, int64_t tokens, int64_t ld, int64_t nh, int64_t D, const float *cosb, const float *sinb,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (tokens * nh * D >= 32768) schedule(static)
    for (int64_t t = 0; t < tokens; t++) rope(x + t * ld, nh, D, cosb + t * (D / 2), sinb + t * (D / 2));
}
