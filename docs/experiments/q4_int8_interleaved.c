/* Experiment (not built or shipped): Q4_1 weights regrouped so that each 32-byte vector holds 4 weights of each of
 * 8 consecutive blocks, activations rounded to int8 per 32-value block, `vpmaddubsw` products summed in int16
 * over a block's 8 vectors, then one widening `vpmaddwd`, one conversion and one FMA per 8 blocks and row
 * (kvinfer's kernel spends two `vpmaddwd`, a conversion, a broadcast and an FMA per block and row). Compares
 * itself with kvq_matmul on the same random Q4_1 matrix, one thread, and checks its result against a double
 * precision reference with the same int8 rounding (agrees to ~1e-7). K must be a multiple of 256 here (no tail).
 *
 *   cd kvinfer/kernels && gcc -O3 -ffp-contract=off -fno-math-errno -fopenmp -mavx2 -mfma -mf16c -DKVQ_LEVEL=1 \
 *       -I. ../../docs/experiments/q4_int8_interleaved.c qmatmul.c -o /tmp/q4i8 -lm && /tmp/q4i8 576 1536 8
 *
 * Measured 2026-12-02, AMD EPYC Zen 3 (AVX2/FMA/F16C, no AVX-512), 1 thread, ns per row and 32-weight block,
 * kvq_matmul vs this: N=576 K=1536: 1 row 1.62 vs 0.69 (2.4x, weights in L2), 4 rows 0.98 vs 0.58, 8 rows
 * 0.89 vs 0.58, 64 rows 0.86 vs 0.55 (1.55-1.7x; N=1536 K=512: 1.4-1.75x at 4-64 rows); N=24576 K=1536 (weights from memory): 1 row 2.15 vs 1.75
 * (1.23x), 5 rows 1.01 vs 0.65, 8 rows 0.98 vs 0.63 (1.56x). Relative RMS difference from the int16 kernel's
 * result on this random data: 5-7e-3 (int8 rounding; llama.cpp rounds activations to 8 bits too).
 */
#include "kernels.h"
#include "simd.h"
#include <stdlib.h>
#include <stdio.h>
#include <time.h>
int kvq_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N, int64_t ldw, int qt,
               const float *bias, float *y, int64_t ldy, int nthreads);
#define GB 160 /* d[8] m[8] fp16, q: 4 x 32 bytes */
/* byte layout: load L (0..3) of 32 bytes: byte 4j+e (j block, e 0..3): low nibble = element 4L+e of block j,
   high nibble = element 16+4L+e. So lo vector = elements t=L (4L..4L+3), hi vector = t=L+4 (16+4L..). */
static void repack(const uint8_t *w, int64_t N, int64_t K, uint8_t *o) {
  int64_t nb = K / 32, ng = nb / 8;
  for (int64_t n = 0; n < N; n++) for (int64_t g = 0; g < ng; g++) {
    uint8_t *G = o + (n * ng + g) * GB;
    for (int j = 0; j < 8; j++) {
      const uint8_t *blk = w + (n * nb + g * 8 + j) * 20;
      memcpy(G + 2 * j, blk, 2); memcpy(G + 16 + 2 * j, blk + 2, 2);
      for (int L = 0; L < 4; L++) for (int e = 0; e < 4; e++) {
        int el = 4 * L + e; /* < 16 */
        int lo = blk[4 + el] & 15, hi = blk[4 + el] >> 4; /* element el and el+16 */
        G[32 + L * 32 + 4 * j + e] = (uint8_t)(lo | (hi << 4));
      }
    }
  }
}
/* x: per group 8 vectors of 32 int8: vector t: bytes 4j+e = x_block j element 4t+e (t<4: elements 0..15, t>=4: 16+4(t-4)+e) */
static void quant(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx) {
  int64_t nb = K / 32;
  for (int64_t r = 0; r < M; r++) for (int64_t b = 0; b < nb; b++) {
    const float *xb = x + r * K + b * 32; float amax = 0, s = 0;
    for (int i = 0; i < 32; i++) { float a = fabsf(xb[i]); if (a > amax) amax = a; s += xb[i]; }
    float sc = amax > 0 ? 127.0f / amax : 0;
    dx[r * nb + b] = amax / 127.0f; sx[r * nb + b] = s;
    int64_t g = b / 8, j = b % 8;
    int8_t *X = xq + (r * nb + g * 8) * 32;
    for (int t = 0; t < 8; t++) for (int e = 0; e < 4; e++) {
      int el = t < 4 ? 4 * t + e : 16 + 4 * (t - 4) + e;
      X[t * 32 + 4 * j + e] = (int8_t)nearbyintf(xb[el] * sc);
    }
  }
}
static inline __attribute__((always_inline)) void tile(const int8_t *xq, const float *dx, const float *sx, int64_t nb,
    const uint8_t *w, int64_t ldw, float *y, int64_t ldy, int64_t n0, int64_t n1, const int MT) {
  const int64_t ng = nb / 8;
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *wrow = w + n * ldw;
    vf acc[8];
    for (int r = 0; r < MT; r++) acc[r] = vf_zero();
    for (int64_t g = 0; g < ng; g++) {
      const uint8_t *G = wrow + g * GB;
      __m256i s[8];
      for (int r = 0; r < MT; r++) s[r] = _mm256_setzero_si256();
      for (int L = 0; L < 4; L++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(G + 32 + 32 * L));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        for (int r = 0; r < MT; r++) {
          const int8_t *X = xq + (r * nb + g * 8) * 32;
          s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(X + 32 * L))));
          s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(X + 32 * (L + 4)))));
        }
      }
      const vf vd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)G));
      const vf vm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(G + 16)));
      for (int r = 0; r < MT; r++) {
        const __m256i d32 = _mm256_madd_epi16(s[r], ones); /* lane j: block j's dot */
        acc[r] = vf_fma(vi_to_vf(d32), vf_mul(vd, vf_load(dx + r * nb + g * 8)), acc[r]);
        acc[r] = vf_fma(vm, vf_load(sx + r * nb + g * 8), acc[r]);
      }
    }
    for (int r = 0; r < MT; r++) y[r * ldy + n] = vf_hsum(acc[r]);
  }
}
#define T(MT) static void tile##MT(const int8_t *xq, const float *dx, const float *sx, int64_t nb, const uint8_t *w, int64_t ldw, float *y, int64_t ldy, int64_t n0, int64_t n1) { tile(xq,dx,sx,nb,w,ldw,y,ldy,n0,n1,MT); }
T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8)
typedef void (*tf)(const int8_t *, const float *, const float *, int64_t, const uint8_t *, int64_t, float *, int64_t, int64_t, int64_t);
static tf tiles[9] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8};
static int MTMAX = 8;
static void mm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
  int64_t nb = K / 32; int8_t *xq = malloc(M * K); float *dx = malloc(4 * M * nb), *sx = malloc(4 * M * nb);
  quant(x, M, K, xq, dx, sx);
  int64_t ldw = nb / 8 * GB, nc = 256 * 1024 / ldw;
  for (int64_t c0 = 0; c0 < N; c0 += nc) { int64_t c1 = c0 + nc < N ? c0 + nc : N;
    for (int64_t r = 0; r < M; r += MTMAX) { int h = M - r < MTMAX ? M - r : MTMAX; tiles[h](xq + r * K, dx + r * nb, sx + r * nb, nb, w, ldw, y + r * N, N, c0, c1); } }
  free(xq); free(dx); free(sx);
}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
  int N = atoi(argv[1]), K = atoi(argv[2]), M = atoi(argv[3]), reps = 15; int nb = K / 32;
  if (argc > 4) MTMAX = atoi(argv[4]);
  uint8_t *w = malloc((size_t)N * nb * 20); for (size_t i = 0; i < (size_t)N * nb * 20; i++) w[i] = rand();
  for (int n = 0; n < N; n++) for (int b = 0; b < nb; b++) { uint16_t h = 0x2000; memcpy(w + (size_t)(n * nb + b) * 20, &h, 2); h = 0xa400 + (rand() & 0xff); memcpy(w + (size_t)(n * nb + b) * 20 + 2, &h, 2); }
  uint8_t *wi = malloc((size_t)N * nb / 8 * GB); repack(w, N, K, wi);
  float *x = malloc(4 * M * K); for (int i = 0; i < M * K; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
  float *y = malloc(4 * M * N), *y2 = malloc(4 * M * N);
  double bo = 1e9, bn = 1e9;
  for (int r = 0; r < reps; r++) {
    double t = now(); kvq_matmul(x, M, K, K, w, N, nb * 20, 3, NULL, y, N, 1); t = now() - t; if (t < bo) bo = t;
    t = now(); mm(x, M, K, wi, N, y2); t = now() - t; if (t < bn) bn = t; }
  { /* reference with the same int8 rounding, in double */
    double n2 = 0, d2 = 0;
    for (int r = 0; r < M; r++) for (int n = 0; n < N; n++) {
      double acc = 0;
      for (int b = 0; b < nb; b++) {
        const float *xb = x + r * K + b * 32; float amax = 0, sm = 0;
        for (int i = 0; i < 32; i++) { float a = fabsf(xb[i]); if (a > amax) amax = a; sm += xb[i]; }
        float sc = amax > 0 ? 127.0f / amax : 0; double dxv = amax / 127.0f;
        const uint8_t *blk = w + (size_t)(n * nb + b) * 20;
        double d = kvq_half(kvq_rd16(blk)), m = kvq_half(kvq_rd16(blk + 2));
        long dot = 0;
        for (int i = 0; i < 16; i++) { dot += (long)(blk[4 + i] & 15) * (long)nearbyintf(xb[i] * sc); dot += (long)(blk[4 + i] >> 4) * (long)nearbyintf(xb[16 + i] * sc); }
        acc += d * dxv * dot + m * sm;
      }
      n2 += (acc - y2[r * N + n]) * (acc - y2[r * N + n]); d2 += acc * acc;
    }
    printf("vs int8 reference: rel rms %.2e\n", sqrt(n2 / d2));
  }
  double num = 0, den = 0; for (int i = 0; i < M * N; i++) { num += (y[i] - y2[i]) * (y[i] - y2[i]); den += y[i] * y[i]; }
  printf("N=%d K=%d M=%d old %.3f new %.3f ns/row-block (%.2fx)  rel rms err %.2e\n", N, K, M, bo * 1e9 / ((double)M * N * nb), bn * 1e9 / ((double)M * N * nb), bo / bn, sqrt(num / den));
}
