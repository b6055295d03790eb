/* ---- Prompt rows on AMX bfloat16 tiles (kvq_attention_prompt) ----
 * A prompt token's route is its role, as in the matmuls (qmatmul_bf16.c, kvq_matmul_prompt): the runner sends the rows of
 * prompt tokens here and every other row to kvq_attention. Per (sequence, kv head) the keys and values of
 * positions [0, last query position] are rounded to bfloat16 (a bfloat16 cache's already are) and laid out once
 * per call as tile operands: keys as B tiles of S = Q K^T (16 positions, 32 dimensions each), values as B tiles of
 * O = P V (32 positions, 16 dimensions each). Then for a tile of up to 16 consecutive query tokens of a sequence
 * and a query head, piece by piece (the same fixed CHUNK positions counted from 0 as kvq_attention, merged by
 * kvqi_attn_merge): q rounded to bfloat16, S by tdpbf16ps over 16 positions at a time, per row times the scale (plus
 * ALiBi), its maximum m, p = exp(s - m) rounded to bfloat16 with l the sum of those rounded values (16 lanes,
 * then the lanes in order), and O = P V by tdpbf16ps over 32 positions at a time into four 16 x 16 float tiles.
 * Positions past a row's own (causal) and past the sequence's last query enter with p = 0, which adds exact
 * zeros, so a row's result depends on its own q and its positions' keys and values only: not on the rows beside
 * it in its tile, the chunking of its prompt or the threads. tdpbf16ps rounds as its CPU does, so the bits are
 * that CPU's (as kvq_matmul_prompt's). Head sizes that are multiples of 64 up to 256; no sliding window;
 * float32 and bfloat16 caches. */
#include "../attn.h"

#if KVQ_LEVEL >= 2 && defined(__AMX_TILE__)
#define PA_PACK_BYTES (32 << 20) /* the most a call lays out at once (kv heads in groups beyond it) */
#define PA_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))

PA_TARGET static void pa_config(void) {
    struct kvq_tile_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64; /* 0: S, 1: A (q or p), 2-3: B, 4-7: O */
    _tile_loadconfig(&c);
}

/* One (sequence, kv head)'s keys and values as tile operands, positions [0, npos) (npos a multiple of 32; zeros
 * past the last query's position): kt[(k * D / 32 + half) * 512 + 32 r + 2 n + e] = key(16 k + n)[32 half + 2 r + e]
 * and vp[(k * D / 16 + t) * 512 + 32 r + 2 d + e] = value(32 k + 2 r + e)[16 t + d]. */
struct pa_seq {
    int64_t seq, last, npos;
    uint16_t *kt, *vp;
};

/* Positions 32 kb .. 32 kb + 31 of kv head g of sequence ps into ps's tiles; rows: scratch of 64 * D values. */
PA_TARGET static void pa_pack(const struct kvq_attn *j, const struct pa_seq *ps, int64_t g, int64_t kb,
                              uint16_t *rows) {
    const int64_t D = j->D;
    const int64_t *table = j->tables + ps->seq * j->table_stride;
    uint16_t *kr = rows, *vr = rows + 32 * D;
    for (int u = 0; u < 32; u++) {
        const int64_t p = 32 * kb + u;
        if (p > ps->last) {
            memset(kr + u * D, 0, sizeof(uint16_t) * (size_t)D);
            memset(vr + u * D, 0, sizeof(uint16_t) * (size_t)D);
            continue;
        }
        const int64_t off = table[p / j->BS] * j->block_stride + (p % j->BS) * j->tok_stride + g * j->head_stride;
        if (j->kv_dtype == KV_BF16) {
            memcpy(kr + u * D, (const uint16_t *)j->k + off, sizeof(uint16_t) * (size_t)D);
            memcpy(vr + u * D, (const uint16_t *)j->v + off, sizeof(uint16_t) * (size_t)D);
        } else {
            for (int64_t d = 0; d < D; d += 32) {
                const float *k = (const float *)j->k + off + d, *v = (const float *)j->v + off + d;
                _mm512_storeu_si512(kr + u * D + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(k + 16),
                                                                                 _mm512_loadu_ps(k)));
                _mm512_storeu_si512(vr + u * D + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16),
                                                                                 _mm512_loadu_ps(v)));
            }
        }
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int w = 0; w < 2; w++) /* the two 16-position key tiles */
        for (int64_t half = 0; half < D / 32; half++) {
            uint16_t *dst = ps->kt + ((2 * kb + w) * (D / 32) + half) * 512;
            /* dword r of the half of position 16 w + n, for n = 0..15 */
            const __m512i base = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * w)),
                                                                     _mm512_set1_epi32((int)(D / 2))),
                                                  _mm512_set1_epi32((int)(16 * half)));
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(dst + 32 * r,
                                    _mm512_i32gather_epi32(_mm512_add_epi32(base, _mm512_set1_epi32(r)), kr, 4));
        }
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t t = 0; t < D / 16; t++) {
        uint16_t *dst = ps->vp + (kb * (D / 16) + t) * 512;
        for (int r = 0; r < 16; r++) {
            const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vr + 2 * r * D + 16 * t)));
            const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vr + (2 * r + 1) * D + 16 * t)));
            _mm512_storeu_si512(dst + 32 * r, _mm512_permutex2var_epi16(a, idx, b));
        }
    }
}

/* Row i's scores S[i][0:n) (float; times the scale, plus ALiBi) to p = bf16(exp(s - m)) in P[i][0:np) (zeros from
 * n on); returns m and l = the sum of the rounded p. */
PA_TARGET static void pa_softmax_row(float *s, int64_t n, int64_t np, float scale, float slope, int64_t rel0,
                                     uint16_t *p, float *m_out, float *l_out) {
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 k = n - x >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - x)) - 1);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + x), sc);
        if (slope != 0.0f) /* slope * (position - query position), as kvq_attention adds it */
            v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(slope),
                                               _mm512_add_ps(lane, _mm512_set1_ps((float)(rel0 + x)))));
        _mm512_mask_storeu_ps(s + x, k, v);
        mv = _mm512_mask_max_ps(mv, k, v, mv);
    }
    const float mx = _mm512_reduce_max_ps(mv);
    __m512 acc = _mm512_setzero_ps();
    int64_t x = 0;
    for (; x < n; x += 16) {
        const __mmask16 k = n - x >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - x)) - 1);
        const __m512 e = v16_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + x), _mm512_set1_ps(mx)));
        const __m256i b = _mm256_maskz_mov_epi16(k, (__m256i)_mm512_cvtneps_pbh(e));
        _mm256_storeu_si256((__m256i *)(p + x), b);
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    for (; x < np; x += 16) _mm256_storeu_si256((__m256i *)(p + x), _mm256_setzero_si256());
    float lanes[16], l = 0.0f;
    _mm512_storeu_ps(lanes, acc);
    for (int i = 0; i < 16; i++) l = l + lanes[i];
    *m_out = mx, *l_out = l;
}

/* Query tokens t0 .. t0 + n - 1 (one sequence, consecutive positions), kv head g: every piece of every query head
 * of the group into local (token i's pieces at local + i * per_tok), then merged into out. Scratch: S (16 x CHUNK
 * floats), P (16 x CHUNK bfloat16), qb (G x 16 x D bfloat16), O (16 x D floats). */
PA_TARGET static void pa_tile(const struct kvq_attn *j, const struct pa_seq *ps, int64_t t0, int n, int64_t g,
                              float *S, uint16_t *P, uint16_t *qb, float *O, float *local, int64_t per_tok) {
    const int64_t G = j->H / j->KVH, D = j->D;
    for (int64_t h = 0; h < G; h++) {
        uint16_t *qh = qb + h * 16 * D;
        for (int i = 0; i < 16; i++)
            for (int64_t d = 0; d < D; d += 32) {
                __m512i v = _mm512_setzero_si512();
                if (i < n) {
                    const float *q = j->q + (t0 + i) * j->q_stride + (g * G + h) * D + d;
                    v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
                }
                _mm512_storeu_si512(qh + i * D + d, v);
            }
    }
    const int64_t C = num_pieces(j, t0 + n - 1);
    for (int64_t c = 0; c < C; c++) {
        int a = 0; /* tokens whose positions reach piece c: a suffix of the tile */
        while (c >= num_pieces(j, t0 + a)) a++;
        const int64_t p0 = c * CHUNK, P1 = j->tok_pos[t0 + n - 1] + 1 < p0 + CHUNK ? j->tok_pos[t0 + n - 1] + 1
                                                                                  : p0 + CHUNK;
        const int64_t nkt = (P1 - p0 + 15) / 16, npair = (P1 - p0 + 31) / 32;
        for (int i = 0; i < a; i++) memset(P + i * CHUNK, 0, sizeof(uint16_t) * (size_t)(npair * 32));
        for (int64_t h = 0; h < G; h++) {
            const uint16_t *qh = qb + h * 16 * D;
            for (int64_t k = 0; k < nkt; k++) {
                _tile_zero(0);
                for (int64_t half = 0; half < D / 32; half++) {
                    _tile_loadd(1, qh + 32 * half, (int)(D * 2));
                    _tile_loadd(2, ps->kt + ((p0 / 16 + k) * (D / 32) + half) * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, S + 16 * k, CHUNK * 4);
            }
            float mx[QTILE], l[QTILE];
            for (int i = a; i < n; i++) {
                const int64_t pos = j->tok_pos[t0 + i], ni = (pos + 1 < P1 ? pos + 1 : P1) - p0;
                pa_softmax_row(S + i * CHUNK, ni, npair * 32, j->scale, j->slopes ? j->slopes[g * G + h] : 0.0f,
                               p0 - pos, P + i * CHUNK, &mx[i], &l[i]);
            }
            for (int64_t dg = 0; dg < D / 64; dg++) {
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                const uint16_t *vb = ps->vp + ((p0 / 32) * (D / 16) + dg * 4) * 512;
                for (int64_t k = 0; k < npair; k++, vb += (D / 16) * 512) {
                    _tile_loadd(1, P + 32 * k, CHUNK * 2);
                    _tile_loadd(2, vb, 64);
                    _tile_dpbf16ps(4, 1, 2);
                    _tile_loadd(3, vb + 512, 64);
                    _tile_dpbf16ps(5, 1, 3);
                    _tile_loadd(2, vb + 1024, 64);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_loadd(3, vb + 1536, 64);
                    _tile_dpbf16ps(7, 1, 3);
                }
                _tile_stored(4, O + dg * 64, (int)(D * 4));
                _tile_stored(5, O + dg * 64 + 16, (int)(D * 4));
                _tile_stored(6, O + dg * 64 + 32, (int)(D * 4));
                _tile_stored(7, O + dg * 64 + 48, (int)(D * 4));
            }
            for (int i = a; i < n; i++) {
                float *part = local + i * per_tok + c * G * (D + 2) + h * (D + 2);
                part[0] = mx[i], part[1] = l[i];
                memcpy(part + 2, O + i * D, sizeof(float) * (size_t)D);
            }
        }
    }
    for (int i = 0; i < n; i++)
        for (int64_t h = 0; h < G; h++)
            kvqi_attn_merge(local + i * per_tok + h * (D + 2), num_pieces(j, t0 + i), G, D,
                  j->out + (t0 + i) * j->out_stride + (g * G + h) * D);
}

PA_TARGET int kvq_attention_prompt(const struct kvq_attn *jp) {
    const struct kvq_attn j = *jp;
    if (!kvq_amx_bf16_enable(-1) || j.D % 64 || j.D > 256 || j.window > 0 ||
        (j.kv_dtype != KV_F32 && j.kv_dtype != KV_BF16))
        return KVQ_EBADTYPE;
    const int rc = kvqi_attn_check(&j);
    if (rc != KVQ_OK || j.T == 0) return rc;
    const int64_t G = j.H / j.KVH, D = j.D;
    /* the sequences, each with its last query position; the tiles of consecutive tokens */
    int64_t *tile0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * j.T + 1));
    struct pa_seq *seqs = (struct pa_seq *)malloc(sizeof(struct pa_seq) * (size_t)j.T);
    if (!tile0 || !seqs) {
        free(tile0), free(seqs);
        return KVQ_ENOMEM;
    }
    int64_t *tile_seq = tile0 + j.T + 1, ntiles = 0, nseq = 0, maxc = 1;
    for (int64_t t = 0; t < j.T; t++) {
        int64_t s = 0;
        while (s < nseq && seqs[s].seq != j.tok_seq[t]) s++;
        if (s == nseq) seqs[nseq++] = (struct pa_seq){j.tok_seq[t], j.tok_pos[t], 0, NULL, NULL};
        if (j.tok_pos[t] > seqs[s].last) seqs[s].last = j.tok_pos[t];
        if (!(ntiles && t - tile0[ntiles - 1] < QTILE && j.tok_seq[t] == j.tok_seq[t - 1] &&
              j.tok_pos[t] == j.tok_pos[t - 1] + 1))
            tile_seq[ntiles] = s, tile0[ntiles++] = t;
        maxc = num_pieces(&j, t) > maxc ? num_pieces(&j, t) : maxc;
    }
    tile0[ntiles] = j.T;
    /* packed operands: per sequence, per kv head, npos * D values of keys and of values; kv heads in groups
     * whose operands fit PA_PACK_BYTES (a long context's copy stays bounded) */
    size_t per_head = 0;
    for (int64_t s = 0; s < nseq; s++) {
        seqs[s].npos = (seqs[s].last + 32) / 32 * 32;
        per_head += sizeof(uint16_t) * (size_t)(seqs[s].npos * D * 2);
    }
    int64_t gh = (int64_t)(PA_PACK_BYTES / per_head);
    gh = gh < 1 ? 1 : gh > j.KVH ? j.KVH : gh;
    uint16_t *packed = (uint16_t *)aligned_alloc(64, (per_head * (size_t)gh + 63) / 64 * 64);
    if (!packed) {
        free(tile0), free(seqs);
        return KVQ_ENOMEM;
    }
    int64_t units = 0; /* pack work: (sequence, 32 positions) */
    for (int64_t s = 0, off = 0; s < nseq; s++) {
        seqs[s].kt = packed + off, seqs[s].vp = packed + off + seqs[s].npos * D * gh;
        off += seqs[s].npos * D * 2 * gh;
        units += seqs[s].npos / 32;
    }
    const int64_t per_tok = maxc * G * (D + 2);
    int status = KVQ_OK;
    for (int64_t g0 = 0; g0 < j.KVH && status == KVQ_OK; g0 += gh) {
        const int64_t ng = j.KVH - g0 < gh ? j.KVH - g0 : gh, items = ntiles * ng;
        int nt = j.nthreads > 0 ? j.nthreads : 1;
        if (nt > items) nt = (int)items;
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            const size_t fl = (size_t)(16 * CHUNK) + (size_t)(16 * D) + (size_t)(QTILE * per_tok);
            const size_t hw = (size_t)(16 * CHUNK) + (size_t)(G * 16 * D) + (size_t)(64 * D);
            char *scr = (char *)aligned_alloc(64, (sizeof(float) * fl + sizeof(uint16_t) * hw + 127) / 64 * 64);
            if (!scr) {
#pragma omp atomic write
                status = KVQ_ENOMEM;
            }
            float *S = (float *)scr, *O = S + 16 * CHUNK, *local = O + 16 * D;
            uint16_t *P = (uint16_t *)(local + QTILE * per_tok), *qb = P + 16 * CHUNK, *rows = qb + G * 16 * D;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units * ng; u++) {
                if (!scr) continue;
                int64_t g = u % ng, kb = u / ng, s = 0;
                while (kb >= seqs[s].npos / 32) kb -= seqs[s++].npos / 32;
                struct pa_seq ps = seqs[s];
                ps.kt += g * ps.npos * D, ps.vp += g * ps.npos * D;
                pa_pack(&j, &ps, g0 + g, kb, rows);
            }
            if (scr) pa_config();
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                if (!scr || status != KVQ_OK) continue;
                const int64_t g = it / ntiles, ti = it % ntiles;
                struct pa_seq ps = seqs[tile_seq[ti]];
                ps.kt += g * ps.npos * D, ps.vp += g * ps.npos * D;
                pa_tile(&j, &ps, tile0[ti], (int)(tile0[ti + 1] - tile0[ti]), g0 + g, S, P, qb, O, local,
                        per_tok);
            }
            if (scr) _tile_release();
            free(scr);
        }
    }
    free(packed), free(tile0), free(seqs);
    return status;
}
#else
int kvq_attention_prompt(const struct kvq_attn *jp) {
    (void)jp;
    return KVQ_EBADTYPE;
}
#endif
