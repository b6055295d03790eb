/* Storing K/V rows into an 8-bit or bfloat16 cache (kvq_kv_store); the attention kernels read them back (attn.c,
 * attn_kv8.c). */
#include "attn.h"

/* ---- 8-bit caches: int8, or fp8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no infinities, max
 * 448); each group of KV_GROUP values of a row (the whole row when D is not a multiple) has a float32 scale (its
 * largest |value| / 127, or / 448): one outlier channel coarsens 32 values, not the whole head ---- */


float kvq_fp8_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = (float)m * 0.001953125f; /* subnormal: m * 2^-9 */
    else v = ldexpf(1.0f + (float)m * 0.125f, e - 7);
    return (b & 0x80) ? -v : v;
}

float kvqi_fp8_table[256];
__attribute__((constructor)) static void fp8_init(void) {
    for (int i = 0; i < 256; i++) kvqi_fp8_table[i] = kvq_fp8_value((uint8_t)i);
}

/* Round to the nearest e4m3 value (ties to even), saturating at +-448. */
static uint8_t fp8_encode(float v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    float a = fabsf(v);
    if (a != a) return sign | 0x7f;
    if (a >= 464.0f) return sign | 0x7e; /* 464 is halfway between 448 and the (absent) 480 */
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormals (8 rounds up to 2^-6) */
    int ex;
    const float f = frexpf(a, &ex); /* a = f * 2^ex, f in [0.5, 1) */
    int m = (int)nearbyintf((f * 2.0f - 1.0f) * 8.0f), biased = ex - 1 + 7;
    if (m == 8) m = 0, biased++;
    if (biased > 15 || (biased == 15 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)(biased << 3 | m);
}

/* float32 -> bfloat16, round to nearest even (NaN kept a quiet NaN): integer arithmetic, the same bits on every
 * level. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void kvq_kv_store(const float *src, int64_t T, int64_t src_stride, int64_t KVH, int64_t D, const int64_t *dst_off,
                  int64_t head_stride, void *dst, float *dst_scale, int kv_dtype) {
    if (kv_dtype == KV_BF16) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < KVH; g++) {
                const float *x = src + t * src_stride + g * D;
                uint16_t *q = (uint16_t *)dst + dst_off[t] + g * head_stride;
                for (int64_t i = 0; i < D; i++) q[i] = bf16_round(x[i]);
            }
        return;
    }
    const float top = kv_dtype == KV_INT8 ? 127.0f : 448.0f;
    const int64_t GS = kv_group(D);
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < KVH; g++) {
            float row[kv_rotated(D) ? D : 1];
            const float *src_row = src + t * src_stride + g * D;
            if (kv_rotated(D)) {
                memcpy(row, src_row, sizeof(float) * (size_t)D);
                rotate(row, D, 1.0f);
                src_row = row;
            }
            for (int64_t j = 0; j < D; j += GS) {
                const float *x = src_row + j;
                const int64_t off = dst_off[t] + g * head_stride + j;
                float amax = 0.0f;
                for (int64_t i = 0; i < GS; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
                const float inv = amax > 0.0f ? top / amax : 0.0f;
                dst_scale[off / GS] = amax / top;
                if (kv_dtype == KV_INT8) {
                    int8_t *q = (int8_t *)dst + off;
                    for (int64_t i = 0; i < GS; i++) {
                        const float r = nearbyintf(x[i] * inv);
                        q[i] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r);
                    }
                } else {
                    uint8_t *q = (uint8_t *)dst + off;
                    for (int64_t i = 0; i < GS; i++) q[i] = fp8_encode(x[i] * inv);
                }
            }
        }
}
