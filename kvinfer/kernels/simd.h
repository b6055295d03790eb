/* The vector vocabulary every kernel is written in: 8 float lanes (vf), 8 int32 lanes (vi), one definition per
 * ISA level. KVQ_LEVEL is set by the build: 0 portable C, 1 AVX2+FMA+F16C, 2 AVX-512 (F/BW/VL/DQ/VNNI).
 *
 * Exactness across levels is by construction: every float operation is one IEEE operation with the same
 * operands on every level (add, mul, div, sqrt, a fused multiply-add as fmaf, round-to-nearest-even), in the
 * same order, lane for lane; integer work (the quantised dot products) is exact, so it may be done any way a
 * level likes. The portable level spells the lanes out in C; built with -ffp-contract=off everywhere, so the
 * compiler never fuses a multiply and an add on its own. The AVX-512 level keeps 8-lane vectors (the order of
 * a reduction is part of the result) and gains VNNI dot products and twice the registers; where its code uses
 * 16 lanes (attn.c's head-size-64 pieces, qmatmul.c's dot products) a register holds two 8-lane vectors side by
 * side, or exact integers.
 */
#ifndef KVINFER_SIMD_H
#define KVINFER_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef KVQ_LEVEL
#error "KVQ_LEVEL must be defined (0 portable, 1 avx2, 2 avx512)"
#endif

static inline uint16_t kvq_rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2); /* GGML blocks are only 2-byte aligned; data is little-endian like every target here */
    return v;
}

/* IEEE half -> float, exact (the portable twin of F16C's conversion). */
static inline float kvq_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (ex == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* subnormal or zero: man * 2^-24, exact */
        return sign ? -f : f;
    }
    bits = ex == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((ex + 112u) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float kvq_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if KVQ_LEVEL >= 1
#include <immintrin.h>

typedef __m256 vf;
typedef __m256i vi;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }   /* a * b + c, one rounding */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); } /* c - a * b, one rounding */
static inline vf vf_rint(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vi vf_to_vi(vf a) { return _mm256_cvtps_epi32(a); } /* nearest, ties to even */
static inline vf vi_to_vf(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf vi_as_vf(vi a) { return _mm256_castsi256_ps(a); }
static inline vi vi_exp2_bits(vi n) { return _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23); }

/* Lane sum in a fixed tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). */
static inline float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 fp16 / bf16 values at p (unaligned) as floats. */
static inline vf vf_load_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* ---- 8-bit KV cache reads ---- */
typedef __m256i vs; /* 16 int16 lanes */
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_store(int32_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }

/* Lane r: the sum of v[r]'s 8 lanes (exact integers, so the order is free). */
static inline vi vi_hsum8x8(const int32_t *v) {
    const __m256i h01 = _mm256_hadd_epi32(vi_load(v), vi_load(v + 8)), h23 = _mm256_hadd_epi32(vi_load(v + 16), vi_load(v + 24));
    const __m256i h45 = _mm256_hadd_epi32(vi_load(v + 32), vi_load(v + 40)), h67 = _mm256_hadd_epi32(vi_load(v + 48), vi_load(v + 56));
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Lane r of *lo: the sum of v[r]'s low 4 lanes; of *hi: of its high 4 lanes (8 vectors held in registers). */
static inline void vi_sum4x2(const vi *v, vi *lo, vi *hi) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    *lo = _mm256_permute2x128_si256(a, b, 0x20), *hi = _mm256_permute2x128_si256(a, b, 0x31);
}

/* Lane r: the sum of v[r]'s 8 lanes, for 8 vectors held in registers. */
static inline vi vi_sum8(const vi *v) {
    vi lo, hi;
    vi_sum4x2(v, &lo, &hi);
    return _mm256_add_epi32(lo, hi);
}

/* Lane r: vf_hsum of the 8 floats at v + 8r, the same tree ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)),
 * for 8 vectors at once (a transpose-add instead of 8 horizontal sums). */
static inline vf vf_hsum_each8(const float *v) {
    __m256 u[4];
    for (int i = 0; i < 4; i++) { /* [lo + hi of vector 2i | of vector 2i + 1]: lanes a0..a3 = l0+l4 .. l3+l7 */
        const __m256 x = vf_load(v + 16 * i), y = vf_load(v + 16 * i + 8);
        u[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
    /* (a0 + a2), (a1 + a3) per vector: p holds vectors 0, 2 (low half) / 1, 3 (high), q 4, 6 / 5, 7 */
    const __m256 p = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xee));
    const __m256 q = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44), _mm256_shuffle_ps(u[2], u[3], 0xee));
    /* (a0 + a2) + (a1 + a3): lanes hold vectors 0, 2, 4, 6 | 1, 3, 5, 7 */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(p, q, 0x88), _mm256_shuffle_ps(p, q, 0xdd));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#if KVQ_LEVEL >= 2
/* An AMX tile configuration (ldtilecfg's 64-byte operand, palette 1): qmatmul.c's and attn.c's tiles. */
struct kvq_tile_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* vf_exp of 16 floats: the same operations lane for lane (each an IEEE operation), so the same bits. */
static inline __m512 v16_exp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* 16 bfloat16 values at p (unaligned) as floats: exact. */
static inline __m512 v16_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* vf_hsum_each8 of the vectors a0 + a1 of 8 zmm registers z[i] = [a0 | a1] (two 8-lane accumulators side by side:
 * attention's dot64_pair, the float matmul's tile_f16): the same additions in the same order, two or four vectors
 * per register. */
static inline __attribute__((always_inline)) vf hsum_pairs8(const __m512 *z) {
    __m512 t[4];
    for (int i = 0; i < 4; i++) /* [a0 + a1 of row 2i | of row 2i + 1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xee));
    /* lo + hi 128 bits of rows 0..3 (and 4..7): lanes l0+l4 .. l3+l7, a row per 128 bits */
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xdd));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xdd));
    /* (a0 + a2), (a1 + a3): 128 bits v hold rows v and v + 4 */
    const __m512 p = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xee));
    /* (a0 + a2) + (a1 + a3): lane 0 of 128 bits v is row v, lane 1 row v + 4 */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p, p, 0x88), _mm512_shuffle_ps(p, p, 0xdd));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r));
}

/* acc + lane j's exact int32 sum a[2j] b[2j] + a[2j + 1] b[2j + 1] of 16 int16 lanes: one VNNI instruction here,
 * a multiply-add and an add at the avx2 level (below); the same integers. */
static inline vi vi_dp16(vi acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
static inline vi vi_dp16(vi acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

/* The fp16 fields at p + u * stride (d) and p + 2 + u * stride (m) of 8 blocks, as floats. Built in registers:
 * 8 small stores read back as one vector cannot be forwarded, and a gather is slower still on AMD. */
static inline void vf_load_half2_strided(const uint8_t *p, int stride, vf *d, vf *m) {
    __m128i g[8];
    for (int u = 0; u < 8; u++) g[u] = _mm_loadu_si32(p + u * stride);
    const __m128i g01 = _mm_unpacklo_epi32(g[0], g[1]), g23 = _mm_unpacklo_epi32(g[2], g[3]);
    const __m128i g45 = _mm_unpacklo_epi32(g[4], g[5]), g67 = _mm_unpacklo_epi32(g[6], g[7]);
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi64(g01, g23)),
                                              _mm_unpacklo_epi64(g45, g67), 1);
    const __m256i dm = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(v, 16)), 0xd8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
}

/* Lane r: ((v[r]0 + v[r]1) + (v[r]2 + v[r]3)) + ((v[r]4 + v[r]5) + (v[r]6 + v[r]7)) for 8 vectors at v. */
static inline vf vf_hsum8x8(const float *v) {
    const __m256 h01 = _mm256_hadd_ps(vf_load(v), vf_load(v + 8)), h23 = _mm256_hadd_ps(vf_load(v + 16), vf_load(v + 24));
    const __m256 h45 = _mm256_hadd_ps(vf_load(v + 32), vf_load(v + 40)), h67 = _mm256_hadd_ps(vf_load(v + 48), vf_load(v + 56));
    const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* 8 int8 values of two rows interleaved as int16: a0 b0 a1 b1 ... a7 b7. */
static inline vs vs_pair_i8(const int8_t *a, const int8_t *b) {
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}

/* Lane r: x[2r] * w[0] + x[2r + 1] * w[1] (w: two int16 in one int32), exact. */
static inline vi vs_madd_pair(vs x, int32_t w) { return _mm256_madd_epi16(x, _mm256_set1_epi32(w)); }

/* Lane l: a[2l] b[2l] + a[2l + 1] b[2l + 1] of 16 int16 values at a and b, exact. */
static inline vi vs_madd16(const int16_t *a, const int16_t *b) {
    return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b));
}

/* 8 fp8 e4m3 values times 2^-8, exact: with the sign moved to bit 15, an e4m3 code shifted left by 7 is the fp16
 * of its value times 2^-8 (exponent biases 7 and 15), subnormals included. */
static inline vf vf_load_e4m3(const uint8_t *p) {
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xbf80)));
}

/* 32 int16 values of a quantised weight block, elements 0-15 in lo and 16-31 in hi. */
typedef struct { __m256i lo, hi; } q32;

/* The exact integer dot product of a block's 32 quants with 32 int16 activations, as 8 int32 lanes: lane j holds
 * q[2j]x[2j] + q[2j+1]x[2j+1] + q[16+2j]x[16+2j] + q[17+2j]x[17+2j] (the lane split is part of the result). */
static inline vi q32_dot(q32 q, const int16_t *x) {
    const vi acc = vi_dp16(vi_zero(), q.lo, _mm256_loadu_si256((const __m256i *)x));
    return vi_dp16(acc, q.hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
}

/* 4-bit quants: byte i holds element i (low nibble) and i + 16 (high nibble); `off` is subtracted (Q4_0: 8). */
static inline q32 q32_from_q4(const uint8_t *qs, int off) {
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    q32 q;
    q.lo = _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(15)), _mm256_set1_epi16((short)off));
    q.hi = _mm256_sub_epi16(_mm256_srli_epi16(v, 4), _mm256_set1_epi16((short)off));
    return q;
}

static inline q32 q32_from_q8(const uint8_t *qs) {
    q32 q;
    q.lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
    q.hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    return q;
}

/* IQ4_NL's quants: the nibbles as q32_from_q4 reads them, each replaced by its entry of tbl (16 int8). */
static inline q32 q32_from_nl(const uint8_t *qs, const int8_t *tbl) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), t = _mm_loadu_si128((const __m128i *)tbl);
    const __m128i m = _mm_set1_epi8(15);
    q32 q;
    q.lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(v, m)));
    q.hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), m)));
    return q;
}

/* 16 bytes, byte i 16 where bit i of h (16 bits) is set, else 0: the fifth bits of 16 of a Q5_0 / Q5_1 block's
 * quants. */
static inline __m128i q5_high16(uint32_t h) {
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)h), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1,
                                                                                  1, 1, 1, 1));
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, bit), bit), _mm_set1_epi8(16));
}

/* Q5_0 / Q5_1's quants (0..31): the nibbles of qs as q32_from_q4 reads them, plus 16 where bit i of qh (4 bytes,
 * little-endian) is set for element i; then `off` subtracted (Q5_0: 16). */
static inline q32 q32_from_q5(const uint8_t *qh, const uint8_t *qs, int off) {
    uint32_t h;
    memcpy(&h, qh, 4);
    q32 q = q32_from_q4(qs, 0);
    const __m256i o = _mm256_set1_epi16((short)off);
    q.lo = _mm256_sub_epi16(_mm256_or_si256(q.lo, _mm256_cvtepu8_epi16(q5_high16(h & 0xffffu))), o);
    q.hi = _mm256_sub_epi16(_mm256_or_si256(q.hi, _mm256_cvtepu8_epi16(q5_high16(h >> 16))), o);
    return q;
}

/* Round 32 floats times `scale` to int16 (nearest, ties to even, saturating) into out[0..32). */
static inline void round_i16_32(const float *x, float scale, int16_t *out) {
    const __m256 s = _mm256_set1_ps(scale);
    for (int j = 0; j < 4; j += 2) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), s));
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j + 8), s));
        /* packs interleaves 128-bit lanes; the permute puts the 16 values back in order */
        _mm256_storeu_si256((__m256i *)(out + 8 * j), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xd8));
    }
}

#else /* ---------------------------------------------------------------------------- portable C, same lanes */

typedef struct { float v[8]; } vf;
typedef struct { int32_t v[8]; } vi;
#define KVQ_L8(expr) for (int _l = 0; _l < 8; _l++) expr

static inline vf vf_zero(void) { vf r; KVQ_L8(r.v[_l] = 0.0f); return r; }
static inline vf vf_set1(float x) { vf r; KVQ_L8(r.v[_l] = x); return r; }
static inline vf vf_load(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void vf_store(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
static inline vf vf_add(vf a, vf b) { KVQ_L8(a.v[_l] = a.v[_l] + b.v[_l]); return a; }
static inline vf vf_sub(vf a, vf b) { KVQ_L8(a.v[_l] = a.v[_l] - b.v[_l]); return a; }
static inline vf vf_mul(vf a, vf b) { KVQ_L8(a.v[_l] = a.v[_l] * b.v[_l]); return a; }
static inline vf vf_div(vf a, vf b) { KVQ_L8(a.v[_l] = a.v[_l] / b.v[_l]); return a; }
/* maxps / minps semantics: the second operand when either is NaN or both are zeros */
static inline vf vf_max(vf a, vf b) { KVQ_L8(a.v[_l] = a.v[_l] > b.v[_l] ? a.v[_l] : b.v[_l]); return a; }
static inline vf vf_min(vf a, vf b) { KVQ_L8(a.v[_l] = a.v[_l] < b.v[_l] ? a.v[_l] : b.v[_l]); return a; }
static inline vf vf_abs(vf a) { KVQ_L8(a.v[_l] = fabsf(a.v[_l])); return a; }
static inline vf vf_fma(vf a, vf b, vf c) { KVQ_L8(a.v[_l] = fmaf(a.v[_l], b.v[_l], c.v[_l])); return a; }
static inline vf vf_fnma(vf a, vf b, vf c) { KVQ_L8(a.v[_l] = fmaf(-a.v[_l], b.v[_l], c.v[_l])); return a; }
static inline vf vf_rint(vf a) { KVQ_L8(a.v[_l] = nearbyintf(a.v[_l])); return a; }
static inline vi vf_to_vi(vf a) { vi r; KVQ_L8(r.v[_l] = (int32_t)nearbyintf(a.v[_l])); return r; }
static inline vf vi_to_vf(vi a) { vf r; KVQ_L8(r.v[_l] = (float)a.v[_l]); return r; }
static inline vf vi_as_vf(vi a) { vf r; memcpy(r.v, a.v, sizeof r.v); return r; }
static inline vi vi_exp2_bits(vi n) { KVQ_L8(n.v[_l] = (int32_t)((uint32_t)(n.v[_l] + 127) << 23)); return n; }

static inline float vf_hsum(vf v) {
    const float *l = v.v;
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static inline float vf_hmax(vf v) {
    float m = v.v[0];
    for (int i = 1; i < 8; i++) m = v.v[i] > m ? v.v[i] : m;
    return m;
}

static inline vf vf_load_half(const uint16_t *p) { vf r; KVQ_L8(r.v[_l] = kvq_half(p[_l])); return r; }
static inline vf vf_load_bf16(const uint16_t *p) { vf r; KVQ_L8(r.v[_l] = kvq_bf16(p[_l])); return r; }
static inline vf vf_load_i8(const int8_t *p) { vf r; KVQ_L8(r.v[_l] = (float)p[_l]); return r; }

typedef struct { int16_t v[16]; } vs;
static inline vi vi_zero(void) { vi r; KVQ_L8(r.v[_l] = 0); return r; }
static inline vi vi_add(vi a, vi b) { KVQ_L8(a.v[_l] = (int32_t)((uint32_t)a.v[_l] + (uint32_t)b.v[_l])); return a; }
static inline vi vi_load(const int32_t *p) { vi r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void vi_store(int32_t *p, vi v) { memcpy(p, v.v, sizeof v.v); }

static inline vi vi_hsum8x8(const int32_t *v) {
    vi r;
    for (int i = 0; i < 8; i++) {
        uint32_t t = 0;
        for (int l = 0; l < 8; l++) t += (uint32_t)v[8 * i + l];
        r.v[i] = (int32_t)t;
    }
    return r;
}

static inline vi vi_sum8(const vi *v) {
    vi r;
    for (int i = 0; i < 8; i++) {
        uint32_t t = 0;
        for (int l = 0; l < 8; l++) t += (uint32_t)v[i].v[l];
        r.v[i] = (int32_t)t;
    }
    return r;
}

static inline void vf_load_half2_strided(const uint8_t *p, int stride, vf *d, vf *m) {
    for (int u = 0; u < 8; u++) {
        d->v[u] = kvq_half(kvq_rd16(p + u * stride));
        m->v[u] = kvq_half(kvq_rd16(p + u * stride + 2));
    }
}

static inline vf vf_hsum_each8(const float *v) {
    vf r;
    for (int i = 0; i < 8; i++) r.v[i] = vf_hsum(vf_load(v + 8 * i));
    return r;
}

static inline vf vf_hsum8x8(const float *v) {
    vf r;
    for (int i = 0; i < 8; i++) {
        const float *l = v + 8 * i;
        r.v[i] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    }
    return r;
}

static inline vs vs_pair_i8(const int8_t *a, const int8_t *b) {
    vs r;
    for (int i = 0; i < 8; i++) r.v[2 * i] = a[i], r.v[2 * i + 1] = b[i];
    return r;
}

static inline vi vs_madd_pair(vs x, int32_t w) {
    const int32_t w0 = (int16_t)(uint16_t)((uint32_t)w & 0xffff), w1 = (int16_t)(uint16_t)((uint32_t)w >> 16);
    vi r;
    KVQ_L8(r.v[_l] = x.v[2 * _l] * w0 + x.v[2 * _l + 1] * w1);
    return r;
}

static inline vi vs_madd16(const int16_t *a, const int16_t *b) {
    vi r;
    KVQ_L8(r.v[_l] = (int32_t)a[2 * _l] * b[2 * _l] + (int32_t)a[2 * _l + 1] * b[2 * _l + 1]);
    return r;
}

static inline vf vf_load_e4m3(const uint8_t *p) {
    vf r;
    KVQ_L8(r.v[_l] = kvq_half((uint16_t)(((uint16_t)(int16_t)(int8_t)p[_l] << 7) & 0xbf80)));
    return r;
}

typedef struct { int16_t q[32]; } q32;

static inline vi q32_dot(q32 q, const int16_t *x) {
    vi r;
    for (int j = 0; j < 8; j++)
        r.v[j] = (int32_t)q.q[2 * j] * x[2 * j] + (int32_t)q.q[2 * j + 1] * x[2 * j + 1] +
                 (int32_t)q.q[16 + 2 * j] * x[16 + 2 * j] + (int32_t)q.q[17 + 2 * j] * x[17 + 2 * j];
    return r;
}

static inline q32 q32_from_q4(const uint8_t *qs, int off) {
    q32 q;
    for (int i = 0; i < 16; i++) {
        q.q[i] = (int16_t)((qs[i] & 15) - off);
        q.q[i + 16] = (int16_t)((qs[i] >> 4) - off);
    }
    return q;
}

static inline q32 q32_from_q8(const uint8_t *qs) {
    q32 q;
    for (int i = 0; i < 32; i++) q.q[i] = (int16_t)(int8_t)qs[i];
    return q;
}

static inline q32 q32_from_nl(const uint8_t *qs, const int8_t *tbl) {
    q32 q;
    for (int i = 0; i < 16; i++) q.q[i] = tbl[qs[i] & 15], q.q[i + 16] = tbl[qs[i] >> 4];
    return q;
}

static inline q32 q32_from_q5(const uint8_t *qh, const uint8_t *qs, int off) {
    uint32_t h;
    memcpy(&h, qh, 4);
    q32 q = q32_from_q4(qs, 0);
    for (int i = 0; i < 32; i++) q.q[i] = (int16_t)((q.q[i] | (int16_t)(((h >> i) & 1u) << 4)) - off);
    return q;
}

static inline void round_i16_32(const float *x, float scale, int16_t *out) {
    for (int i = 0; i < 32; i++) {
        float r = nearbyintf(x[i] * scale);
        out[i] = (int16_t)(r > 32767.0f ? 32767 : r < -32768.0f ? -32768 : (int32_t)r);
    }
}
#undef KVQ_L8
#endif

/* ---- shared by every level: built from the operations above only ---- */

/* exp of 8 floats: Cephes' expf polynomial after range reduction by ln 2 (about 2 ulp). Inputs are clamped to
 * [-87, 88], so exp of a very negative score is ~1e-38 rather than 0, which no softmax sum can notice. */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(88.0f));
    vf n = vf_rint(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnma(n, vf_set1(0.693359375f), x);
    r = vf_fnma(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fma(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_mul(p, vi_as_vf(vi_exp2_bits(vf_to_vi(n))));
}

/* The same exp for one float, operation for operation, so a tail element equals the lane it would have had. */
static inline float kvq_exp1(float x) {
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float e;
    memcpy(&e, &bits, 4);
    return p * e;
}

#endif
