/* Shared declarations of the kvinfer C kernels (qgemv.c, paged_attn.c, decode_step.c). */
#ifndef KVINFER_KERNELS_H
#define KVINFER_KERNELS_H
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Sum of the 8 lanes. */
static inline float kvq_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* y[r * ldy + n] = sum_k x[r * ldx + k] * W[n, k]; see qgemv.c. */
int kvq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw, int qt,
               float *y, int64_t ldy, int nthreads, int impl);

/* One step of decode attention over the paged cache; see paged_attn.c. */
struct pa_job {
    const float *q;      /* [B, q_stride]: each row starts with H * D query values */
    const float *kpool, *vpool, *slopes;
    const int64_t *tables, *lens;
    float *out;          /* [B, out_stride]: H * D values per row */
    int64_t B, H, KVH, D, BS, T, NB, window, q_stride, out_stride;
    float scale;
};
int kvq_paged_decode_run(const struct pa_job *j, int nthreads);

enum { KVQ_EBADBLOCK = -6 };

/* s[i] = exp(s[i] - mx), returning the sum; y = silu(g) * u (both vectorised; see paged_attn.c). */
float kvq_exp_shift_sum(float *s, int64_t n, float mx);
void kvq_silu_mul(const float *g, const float *u, float *y, int64_t n);

/* Row kernels of the eager path (decode_step.c): SwiGLU over fused gate-up rows, rotate-half RoPE in place. */
void kvq_silu_mul_rows(const float *gu, int64_t rows, int64_t inter, int64_t ld_in, float *out, int nthreads);
void kvq_rope_rows(float *x, int64_t tokens, int64_t ld, int64_t nh, int64_t D, const float *cosb, const float *sinb,
                   int nthreads);
#endif
