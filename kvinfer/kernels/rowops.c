/* Row operations of the decoder: RMSNorm, LayerNorm, SwiGLU's silu(g) * u, GELU, rotate-half RoPE, the
 * mixture-of-experts routing. Each row's result is a fixed sequence of operations on that row alone (reductions:
 * 8-lane partial sums, then a sequential tail), and elementwise functions give a value the same result in a vector
 * lane or in the tail; the eager path and the fused decode step call these same functions. */
#include "kernels.h"
#include "simd.h"

#include <stdlib.h>
#include <string.h>

#define PAR_MIN 32768 /* elements below which a second thread is not worth waking */

/* sum of (x[i] - c)^2 */
static inline float sum_sq(const float *x, int64_t n, float c) {
    vf acc = vf_zero();
    const vf vc = vf_set1(c);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        vf d = vf_sub(vf_load(x + i), vc);
        acc = vf_fma(d, d, acc);
    }
    float s = vf_hsum(acc);
    for (; i < n; i++) s = fmaf(x[i] - c, x[i] - c, s);
    return s;
}

static inline float sum(const float *x, int64_t n) {
    vf acc = vf_zero();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = vf_add(acc, vf_load(x + i));
    float s = vf_hsum(acc);
    for (; i < n; i++) s = s + x[i];
    return s;
}

void kvq_rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    const float r = 1.0f / sqrtf(sum_sq(x, n, 0.0f) / (float)n + eps);
    int64_t i = 0;
    const vf vr = vf_set1(r);
    for (; i + 8 <= n; i += 8) vf_store(y + i, vf_mul(vf_mul(vf_load(x + i), vr), vf_load(w + i)));
    for (; i < n; i++) y[i] = (x[i] * r) * w[i];
}

void kvq_rms_norm(const float *x, int64_t rows, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t n,
                  float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (rows * n >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) kvq_rms_norm_row(x + r * ldx, w, y + r * ldy, n, eps);
}

static void layer_norm_row(const float *x, const float *w, const float *b, float *y, int64_t n, float eps) {
    const float mean = sum(x, n) / (float)n;
    const float r = 1.0f / sqrtf(sum_sq(x, n, mean) / (float)n + eps);
    int64_t i = 0;
    const vf vm = vf_set1(mean), vr = vf_set1(r);
    for (; i + 8 <= n; i += 8) {
        vf v = vf_mul(vf_mul(vf_sub(vf_load(x + i), vm), vr), vf_load(w + i));
        vf_store(y + i, b ? vf_add(v, vf_load(b + i)) : v);
    }
    for (; i < n; i++) {
        float v = ((x[i] - mean) * r) * w[i];
        y[i] = b ? v + b[i] : v;
    }
}

void kvq_layer_norm(const float *x, int64_t rows, int64_t ldx, const float *w, const float *b, float *y,
                    int64_t ldy, int64_t n, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (rows * n >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) layer_norm_row(x + r * ldx, w, b, y + r * ldy, n, eps);
}

/* kvq_silu_mul's first elements, per level: at the AVX-512 level 16 lanes, the same operations (faster on
 * prefill activations: docs/BENCHMARKS.md); returns how many it did. */
#if KVQ_LEVEL >= 2
static inline int64_t silu_mul_wide(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = v16_exp(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                              _mm512_loadu_ps(u + i)));
    }
    return i;
}
#else
static inline int64_t silu_mul_wide(const float *g, const float *u, float *y, int64_t n) {
    (void)g, (void)u, (void)y, (void)n;
    return 0;
}
#endif

/* y[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u */
void kvq_silu_mul(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = silu_mul_wide(g, u, y, n);
    const vf one = vf_set1(1.0f), zero = vf_zero();
    for (; i + 8 <= n; i += 8) {
        vf x = vf_load(g + i);
        vf_store(y + i, vf_mul(vf_div(x, vf_add(one, vf_exp(vf_sub(zero, x)))), vf_load(u + i)));
    }
    for (; i < n; i++) y[i] = g[i] / (1.0f + kvq_exp1(0.0f - g[i])) * u[i];
}

void kvq_silu_mul_rows(const float *gu, int64_t rows, int64_t inter, int64_t ld_in, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (rows * inter >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) kvq_silu_mul(gu + r * ld_in, gu + r * ld_in + inter, out + r * inter, inter);
}

/* GELU: tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) with tanh(a) = 1 - 2 / (exp(2a) + 1), or the
 * erf form 0.5 x (1 + erf(x / sqrt 2)) with Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7). */
static inline vf gelu8(vf x, int tanh_approx) {
    const vf one = vf_set1(1.0f), half = vf_set1(0.5f), two = vf_set1(2.0f);
    if (tanh_approx) {
        vf a = vf_mul(vf_set1(0.7978845608028654f), vf_add(x, vf_mul(vf_set1(0.044715f), vf_mul(x, vf_mul(x, x)))));
        vf th = vf_sub(one, vf_div(two, vf_add(vf_exp(vf_mul(two, a)), one)));
        return vf_mul(vf_mul(half, x), vf_add(one, th));
    }
    vf z = vf_mul(x, vf_set1(0.7071067811865476f)), az = vf_abs(z);
    vf t = vf_div(one, vf_add(one, vf_mul(vf_set1(0.3275911f), az)));
    vf p = vf_set1(1.061405429f);
    p = vf_fma(p, t, vf_set1(-1.453152027f));
    p = vf_fma(p, t, vf_set1(1.421413741f));
    p = vf_fma(p, t, vf_set1(-0.284496736f));
    p = vf_fma(p, t, vf_set1(0.254829592f));
    vf e = vf_sub(one, vf_mul(vf_mul(p, t), vf_exp(vf_sub(vf_zero(), vf_mul(az, az)))));  /* erf(|z|) */
    float lanes[8], zl[8];
    vf_store(lanes, e), vf_store(zl, z);
    for (int l = 0; l < 8; l++) lanes[l] = zl[l] < 0.0f ? -lanes[l] : lanes[l];
    return vf_mul(vf_mul(half, x), vf_add(one, vf_load(lanes)));
}

void kvq_gelu(const float *x, float *y, int64_t n, int tanh_approx, int nthreads) {
    const int64_t n8 = n & ~(int64_t)7;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (n >= PAR_MIN) schedule(static)
    for (int64_t i = 0; i < n8; i += 8) vf_store(y + i, gelu8(vf_load(x + i), tanh_approx));
    if (n8 < n) { /* the tail through the same lanes, padded */
        float in[8] = {0}, out[8];
        memcpy(in, x + n8, sizeof(float) * (size_t)(n - n8));
        vf_store(out, gelu8(vf_load(in), tanh_approx));
        memcpy(y + n8, out, sizeof(float) * (size_t)(n - n8));
    }
}

/* Rotate-half RoPE of nh heads of width D in place, with this token's cos/sin [D / 2]. */
void kvq_rope(float *v, int64_t nh, int64_t D, const float *cs, const float *sn) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < nh; h++) {
        float *a = v + h * D, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * cs[i] - x2 * sn[i];
            b[i] = x2 * cs[i] + x1 * sn[i];
        }
    }
}

void kvq_rope_rows(float *x, int64_t tokens, int64_t ld, int64_t nh, int64_t D, const float *cosb, const float *sinb,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) if (tokens * nh * D >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < tokens; t++) kvq_rope(x + t * ld, nh, D, cosb + t * (D / 2), sinb + t * (D / 2));
}

/* The softmax's exp is kvq_exp_shift_sum's, which gives the same bits at every level; the top-k is a selection
 * pass per rank (k is small), so its order does not depend on a sort's. */
int kvq_moe_route(const float *logits, int64_t rows, int64_t E, int64_t k, int renorm, float *weights,
                  int64_t *experts) {
    if (rows < 0 || E <= 0 || k <= 0 || k > E) return KVQ_EBADSHAPE;
    float *p = (float *)malloc(sizeof(float) * (size_t)E);
    unsigned char *taken = (unsigned char *)malloc((size_t)E);
    if (!p || !taken) {
        free(p), free(taken);
        return KVQ_ENOMEM;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *z = logits + r * E;
        float mx = z[0];
        for (int64_t e = 1; e < E; e++) mx = z[e] > mx ? z[e] : mx;
        memcpy(p, z, sizeof(float) * (size_t)E);
        const float sum = kvq_exp_shift_sum(p, E, mx);
        for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
        memset(taken, 0, (size_t)E);
        float *w = weights + r * k;
        int64_t *ex = experts + r * k;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1, ex[j] = best, w[j] = p[best];
        }
        if (renorm) {
            float s = w[0];
            for (int64_t j = 1; j < k; j++) s = s + w[j];
            for (int64_t j = 0; j < k; j++) w[j] = w[j] / s;
        }
    }
    free(p), free(taken);
    return KVQ_OK;
}
