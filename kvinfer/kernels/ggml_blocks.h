/* GGML block families the kernels read as stored: the K-quants' type ids (GGUF's) and layouts. Elements and bytes
 * per block of every type are types.h's table.
 *
 * K-quants group 256 weights in a super-block (little-endian fp16 fields):
 *   Q4_K (144 B): d dmin scales[12] qs[128]         8 sub-blocks of 32: w = (d * sc_j) * q - dmin * m_j, q 0..15
 *   Q5_K (176 B): d dmin scales[12] qh[32] qs[128]  the same with a fifth bit from qh: q 0..31
 *   Q6_K (210 B): ql[128] qh[64] scales[16] d       16 sub-blocks of 16: w = (d * sc_j) * (q - 32), sc_j int8
 *   Q2_K (84 B): scales[16] qs[64] d dmin         16 sub-blocks of 16: w = (d * sc_j) * q - dmin * m_j, q 0..3
 *                 (qs[32n + l] bits 2s..: value 32 (4n + s) + l), sc_j / m_j the low / high nibble of scales[j]
 *   Q3_K (110 B): hmask[32] qs[64] scales[12] d   16 sub-blocks of 16: w = (d * (sc_j - 32)) * q, q = 2 bits of qs
 *                 minus 4 where the hmask bit is clear (-4..3); sc_j 6 bits (kq_q3k_scale)
 *   IQ4_XS (136 B): d scales_h(u16) scales_l[4] qs[128]  8 sub-blocks of 32: w = (d * (ls_j - 32)) * T[q], q 0..15
 *                   an index into T (KQ_IQ4NL, int8), ls_j 6 bits: nibble j of scales_l, bits 2j..2j+1 of scales_h
 *                   on top; sub-block j's quants are qs[16j..16j+16): low nibbles its first 16, high its last
 * Q4_K / Q5_K's 6-bit sc_j, m_j are packed in scales[12] (kq_scale_min). d * sc_j and dmin * m_j are exact in
 * float (an 11-bit fp16 significand times a 6- or 8-bit integer), and so is IQ4_XS's d * (ls_j - 32). */
#ifndef KVINFER_GGML_BLOCKS_H
#define KVINFER_GGML_BLOCKS_H
#include <stdint.h>

#define QK_K 256
enum { QT_Q2_K = 10, QT_Q3_K = 11, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14, QT_IQ4_XS = 23 };

/* Whether a type's super-block has 16 sub-blocks of 16 (Q6_K, Q3_K, Q2_K), and whether a minimum is subtracted
 * per sub-block (Q4_K, Q5_K, Q2_K). */
static inline int kq_sub16(int qt) { return qt == QT_Q6_K || qt == QT_Q3_K || qt == QT_Q2_K; }
static inline int kq_has_min(int qt) { return qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q2_K; }

/* Q3_K sub-block j's (0..15) scale sc_j - 32: low nibble j % 8 of bytes 0..7 of scales (low halves first), the high
 * two bits from byte 8 + j % 4, bits 2 (j / 4)... */
static inline int kq_q3k_scale(const uint8_t *blk, int j) {
    const uint8_t *s = blk + 96;
    const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* IQ4_NL / IQ4_XS's 16 non-linear values (ggml's kvalues_iq4nl). */
static const int8_t KQ_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IQ4_XS sub-block j's (0..7) 6-bit scale ls_j. */
static inline int kq_iq4xs_ls(const uint8_t *blk, int j) {
    const int h = blk[2] | (blk[3] << 8);
    return ((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | (((h >> (2 * j)) & 3) << 4);
}

/* Sub-block j's (0..7) 6-bit scale and min from Q4_K / Q5_K's scales[12]. */
static inline void kq_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
#endif
